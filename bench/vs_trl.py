"""grpo-run against TRL's GRPOTrainer, side by side on this machine: completion tokens per second.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"      # TRL, for this benchmark only
    .venv/bin/python bench/vs_trl.py                  # configs A, B, C; ~15 min on 2 cores
    .venv/bin/python bench/vs_trl.py --configs A --steps 100
    .venv/bin/python bench/vs_trl.py --configs A --rounds 5     # five back-to-back pairs, their median

Both trainers get the same model, task, reward, seed and settings, one after the other in one run:
LoRA r=8 (alpha 16, every linear layer), the per-sequence GRPO loss with the sample std, beta 0,
constant learning rate, temperature 1, gradient checkpointing on, no checkpoints.

    A  the demo: tiny:char, arithmetic, G=8, 8 prompts, 8-token completions, lr 2e-3
    B  tiny:char, arithmetic, G=4, 8 prompts, 64-token completions
    C  a bigger model (4 layers x 256 hidden, the demo's tokenizer), G=4, 8 prompts, 64 tokens

grpo-run runs as `grpo-run apply -f JOB` runs it by default (a supervisor process, its trainer
process, the grader and the checkpoint writer, with the thread settings the supervisor gives the
trainer); TRL as a user runs it (one `python` process, GRPOTrainer with its defaults overridden
to match). Measured per trainer: seconds per step (median interval between steps), completion
tokens per second (completion tokens of all steps / the time from the first step's start to the
last step's end; `length` is the mean completion length in tokens, which each trainer's policy
learns for itself, so tokens/s also moves with how long the completions it writes are), the share
of step time spent generating, the peak resident set of the whole
process tree, and the held-out reward after the same steps (greedy, the environment's 30 held-out
tasks; grpo-run's own final evaluation, the same greedy decoding done by hand for TRL).

`--rounds R` runs each config R times, grpo-run then TRL each round: a round's ratio compares two
runs made back to back, so a slow minute of a shared machine weighs on both. Each config's line
then shows the median of the rounds' figures, and the ratios line the median and the range of the
rounds' ratios (on this machine single runs of config A, 16-30 ms steps, move 10-30% apart).

Last line: a JSON object with tokens_per_s_ratio (grpo-run / TRL, the worst config's median over
the rounds), step_seconds_ratio (grpo-run / TRL, the worst median), and each config's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    "A": {"model": "tiny:char", "G": 8, "B": 8, "tokens": 8, "lr": 2e-3},
    "B": {"model": "tiny:char", "G": 4, "B": 8, "tokens": 64, "lr": 2e-3},
    "C": {"model": "bigger", "G": 4, "B": 8, "tokens": 64, "lr": 5e-4},
}


def build_bigger(folder: Path) -> str:
    """4 layers x 256 hidden, the demo's character tokenizer, random weights (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from grpo_run.trainer.model.tinymodel import build_tokenizer

    out = folder / "bigger"
    if (out / "config.json").exists():
        return str(out)
    tok = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                         initializer_range=0.1, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, layer_types=["full_attention"] * 4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


class TreePeak:
    """The peak resident set of a process and all its descendants, polled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root, self.peak, self._done = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        import psutil

        while not self._done.wait(0.2):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass

    def stop(self) -> int:
        self._done.set()
        return self.peak


def grpo_job(cfg: dict, model: str, steps: int, save_steps: int, name: str = "vs-trl") -> dict:
    """The job file grpo-run gets (bench/goodput.py runs the same one, with checkpoints)."""
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": model, "environment": {"name": "arithmetic"},
                     "parameters": {"numGenerations": cfg["G"], "promptsPerStep": cfg["B"],
                                    "maxCompletionLength": cfg["tokens"], "learningRate": cfg["lr"],
                                    "maxSteps": steps, "saveSteps": save_steps, "seed": 0, "lora": {"r": 8},
                                    "lossType": "grpo", "advantageStd": "sample", "beta": 0.0}}}


def run_grpo_run(cfg: dict, model: str, steps: int, home: Path) -> dict:
    path = home / "job.yaml"
    path.write_text(yaml.safe_dump(grpo_job(cfg, model, steps, steps + 1)))
    env = {**os.environ, "GRPO_RUN_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(path)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = TreePeak(proc.pid)
    _, err = proc.communicate()
    rss = peak.stop()
    if proc.returncode:
        raise RuntimeError(f"grpo-run apply failed ({proc.returncode}):\n{err[-3000:]}")
    from datetime import datetime

    from grpo_run.state.record import Record

    with Record(home / "runs" / "vs-trl" / "state.db") as record:
        logged = [datetime.fromisoformat(r["logged"]).timestamp()
                  for r in record.db["steps"].rows_where(order_by="step")]
        rows = record.steps()
        final = record.eval("final")
    tokens = sum(r["completionLength"] * cfg["G"] * cfg["B"] for r in rows)
    elapsed = logged[-1] - logged[0] + rows[0]["stepSeconds"]      # first step's start to last step's end
    return {"stepSeconds": statistics.median(b - a for a, b in zip(logged, logged[1:])),
            "tokensPerSecond": tokens / elapsed,
            "generationShare": sum(r["sampleSeconds"] for r in rows) / elapsed, "peakRssMB": rss / 2**20,
            "heldOutReward": final["meanReward"], "completionLength": statistics.mean(r["completionLength"] for r in rows)}


def run_trl(cfg: dict, model: str, steps: int, home: Path) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--trl-one", json.dumps({**cfg, "model": model, "steps": steps})],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GRPO_RUN_HOME": str(home)})
    peak = TreePeak(proc.pid)
    out, err = proc.communicate()
    rss = peak.stop()
    if proc.returncode:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{err[-3000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "peakRssMB": rss / 2**20}


def trl_trainer(spec: dict, output_dir: str, callbacks: list, **overrides):
    """(GRPOTrainer, tokenizer, held-out tasks): TRL on the job grpo-run gets, its defaults
    overridden to match (bench/goodput.py runs it with checkpoints: save_strategy, save_steps)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_run.trainer.envs.catalog import arithmetic_reward, arithmetic_tasks
    from grpo_run.runner.home import ensure_model

    path = ensure_model(spec["model"])
    train, held_out = arithmetic_tasks(0, None, None)

    def reward(completions, answer, **_):
        return [arithmetic_reward(c, {"answer": a}) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=output_dir, num_generations=spec["G"], per_device_train_batch_size=spec["G"] * spec["B"],
        max_completion_length=spec["tokens"], learning_rate=spec["lr"], lr_scheduler_type="constant",
        beta=0.0, loss_type="grpo", scale_rewards="group", temperature=1.0, max_steps=spec["steps"],
        logging_steps=1, report_to="none", use_cpu=True, seed=0, bf16=False,
        gradient_checkpointing=True, disable_tqdm=True, **overrides)
    tok = AutoTokenizer.from_pretrained(path)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list([{"prompt": t["prompt"], "answer": t["answer"]} for t in train]),
                          processing_class=tok, peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                          callbacks=callbacks)
    return trainer, tok, held_out


def held_out_reward(model, tok, held_out: list[dict], tokens: int) -> float:
    """The mean reward on the held-out tasks, greedy, as grpo-run's evaluation decodes."""
    import torch

    from grpo_run.trainer.envs.catalog import arithmetic_reward

    model = model.eval()
    tok.padding_side = "left"
    enc = tok([t["prompt"] for t in held_out], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=tokens, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc.input_ids.size(1):], skip_special_tokens=True)
    return sum(arithmetic_reward(c, t) for c, t in zip(texts, held_out)) / len(held_out)


def trl_one(spec: dict) -> dict:
    """TRL's GRPOTrainer on the same job, in this process, as a user writes it."""
    import trl.extras.profiling as profiling
    from transformers import TrainerCallback

    spent: dict[str, float] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):                       # TRL times its phases; keep the totals
        spent[self.name] = spent.get(self.name, 0.0) + duration
        return original(self, duration)

    profiling.ProfilingContext._log_metrics = record
    stamps: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer, tok, held_out = trl_trainer(spec, tempfile.mkdtemp(), [Clock()], save_strategy="no")
    trainer.train()
    elapsed = stamps[-1] - stamps[0]
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    generate = sum(v for k, v in spent.items() if "generate" in k)

    score = held_out_reward(trainer.model, tok, held_out, spec["tokens"])
    tokens = sum(lengths) * spec["G"] * spec["B"]
    return {"stepSeconds": statistics.median(intervals), "tokensPerSecond": tokens / elapsed,
            "generationShare": generate / elapsed, "heldOutReward": score, "completionLength": statistics.mean(lengths)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each trainer per config, alternating (default 1)")
    ap.add_argument("--trl-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_one:
        print(json.dumps(trl_one(json.loads(args.trl_one))))
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: .venv/bin/pip install -c constraints.txt -e \".[bench]\"", file=sys.stderr)
        return 2
    results = {}
    models = Path(tempfile.mkdtemp())
    print(f"{'config':6} {'trainer':9} {'s/step':>7} {'tokens/s':>9} {'length':>6} {'generating':>10} {'peak RSS':>9} "
          f"{'held-out':>8}")
    for name in args.configs:
        cfg = CONFIGS[name]
        model = build_bigger(models) if cfg["model"] == "bigger" else cfg["model"]
        runs: dict[str, list[dict]] = {"grpo-run": [], "TRL": []}
        for i in range(args.rounds):
            for trainer, run in (("grpo-run", run_grpo_run), ("TRL", run_trl)):
                runs[trainer].append(r := run(cfg, model, args.steps, Path(tempfile.mkdtemp())))
                if args.rounds > 1:
                    print(f"{name:6} {trainer:9} {r['stepSeconds']:7.3f} {r['tokensPerSecond']:9.0f} "
                          f"{r['completionLength']:6.2f}   (round {i + 1})", flush=True)
        row = {trainer: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for trainer, rs in runs.items()}
        for trainer, r in row.items():
            print(f"{name:6} {trainer:9} {r['stepSeconds']:7.3f} {r['tokensPerSecond']:9.0f} {r['completionLength']:6.2f} "
                  f"{r['generationShare']:10.0%} {r['peakRssMB']:7.0f} MB {r['heldOutReward']:8.3f}", flush=True)
        tokens = [g["tokensPerSecond"] / t["tokensPerSecond"] for g, t in zip(runs["grpo-run"], runs["TRL"])]
        steps = [g["stepSeconds"] / t["stepSeconds"] for g, t in zip(runs["grpo-run"], runs["TRL"])]
        row.update(tokensPerSecondRatio=statistics.median(tokens), stepSecondsRatio=statistics.median(steps),
                   rounds={"tokensPerSecondRatio": tokens, "stepSecondsRatio": steps})
        spread = f" (rounds: {min(tokens):.2f}x-{max(tokens):.2f}x)" if args.rounds > 1 else ""
        print(f"{name:6} grpo-run / TRL: {row['tokensPerSecondRatio']:.2f}x the tokens/s{spread}, "
              f"{row['stepSecondsRatio']:.2f}x the seconds per step", flush=True)
        results[name] = row
    print(json.dumps({"tokens_per_s_ratio": min(r["tokensPerSecondRatio"] for r in results.values()),
                      "step_seconds_ratio": max(r["stepSecondsRatio"] for r in results.values()),
                      "steps": args.steps, "configs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
