"""What an evaluation depends on, as a fingerprint: a cached result is reused only when the
fingerprint it was stored with matches the job's now."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import Environment, JudgeSettings


RENDERING_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


def model_identity(model: str) -> Any:
    """What names a model's weights and how its prompts render: a hub id as given; for a folder,
    its config, the tokenizer / chat template / generation config files (whole), and a sampled
    hash of every weight file (64 KiB at 64 evenly spaced offsets, plus the size). Re-saving
    trained weights into the same folder changes it; copying the folder to a new node does not.
    Hashing every byte of a 16 GB model at each start would cost more than it protects."""
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return model
    files = {}
    for f in sorted(folder.iterdir()):
        if f.suffix not in (".safetensors", ".bin", ".pt", ".gguf"):
            continue
        size, h = f.stat().st_size, hashlib.sha256()
        with open(f, "rb") as fh:
            for i in range(64):
                fh.seek(size * i // 64)
                h.update(fh.read(64 * 1024))
        files[f.name] = [size, h.hexdigest()]
    # how prompts are rendered and where completions end: the chat template, the tokenizer, EOS ids
    rendering = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())
                 if f.name in RENDERING_FILES}
    return {"config": json.loads((folder / "config.json").read_text()), "weights": files, "rendering": rendering}


def reward_identity(ref: str) -> str:
    """A file reward by its content (the same file fetched to another path on a new node is the
    same reward); a module reward by its name."""
    module, _, func = ref.rpartition(":")
    if module.endswith(".py") and Path(module).is_file():
        return f"sha256:{hashlib.sha256(Path(module).read_bytes()).hexdigest()}:{func}"
    return ref


def _judge_identity(judge: JudgeSettings) -> dict[str, Any]:
    return {"url": judge.url, "model": judge.model, "prompt": judge.prompt, "range": [judge.low, judge.high],
            "maxTokens": judge.max_tokens}


def baseline_fingerprint(model: str, env: Environment, p: GRPOParams) -> str:
    """sha256 over everything the baseline evaluation depends on: the model's identity, the
    environment's rewards (with their weights), its episodes environment (by content) and maxTurns,
    and eval tasks, the generation settings, the batching and the seed."""
    payload = {
        "model": model_identity(model), "method": p.method, "environment": env.name,
        # a group reward (scored with its group) is another reward than the same function per completion
        # a reward model by its config and weights (model_identity), as the policy; a judge by its
        # url, model, prompt, range and reply length (not its key, its limits or its timeout)
        "rewards": [[r.name, _judge_identity(r.judge) if r.judge else model_identity(r.ref) if r.model
                     else reward_identity(r.ref), r.weight, *(["group"] if r.group else [])] for r in env.rewards],
        "evalTasks": list(env.eval_tasks),
        "maxCompletionLength": p.maxCompletionLength, "evalTemperature": p.evalTemperature,
        "evalBatchSize": p.evalBatchSize, "seed": p.seed,
        # how prompts are rendered and completions end
        "systemPrompt": p.systemPrompt, "chatTemplateKwargs": p.chatTemplateKwargs,
        "repetitionPenalty": p.repetitionPenalty, "stopStrings": list(p.stopStrings),
    }
    if env.episodes is not None:        # the environment that answers, by its file's content, and its turns
        payload["episodes"] = [reward_identity(env.episodes.ref), env.episodes.max_turns]
        if env.episodes.step_timeout_s:  # a slow step ends its episode there
            payload["stepTimeoutSeconds"] = env.episodes.step_timeout_s
        if env.episodes.tools:          # the tools that answer, by content, and how long one may take
            payload["tools"] = [[reward_identity(t) for t in env.episodes.tools], env.episodes.tool_timeout_s]
    if p.compileDecode:                 # compiled kernels may round differently
        payload["compileDecode"] = True
    if p.evalTemperature > 0:           # greedy evaluation draws nothing: top-k / top-p do not matter
        payload.update(topK=p.topK, topP=p.topP)
    return _sha(payload)


def final_fingerprint(baseline: str, manifest: dict[str, Any]) -> str:
    """The final evaluation's: the baseline's, and the whole job as written (the trained weights
    follow from it and the seed)."""
    return _sha({"baseline": baseline, "job": manifest.get("spec")})


def _sha(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
