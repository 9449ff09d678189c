"""One check of the estimate on a real GPU: a step measured against the model of a step.

    .venv/bin/python bench/gpu_check.py --out gpu-check.json          # a GPU node: under 8 min on one H200
    .venv/bin/python bench/gpu_check.py --tiny --out /tmp/check.json  # any CPU, a tiny config: what the test runs

A model shaped like Qwen3-0.6B (its config.json values, random weights; bf16 on a GPU, as the
trainer loads it) trains GRPO-LoRA r=8 steps of 8 prompts x G=8 completions of 256 tokens
(random weights almost never draw EOS, so every completion runs to the limit, as the estimate
assumes). Nothing is downloaded. It writes one JSON file with:

- lora: seconds per step (median of the steps after the first, which warms up), the sampling
  share, completion tokens/s; the peak memory against the dry run's neededGB; the measured step
  time against the estimate's (`grpo-run apply --dry-run` for the same job on this card);
- decoders: completion tokens/s of one step's sampling with the default decoder, with
  compileDecode (its first call compiles and is not timed) and with transformers' generate;
- vllm: the same LoRA job sampled by vLLM (colocated, in the trainer's process): seconds per
  step and completion tokens/s beside the native decoder's (`vllmOverNative`), the engine's
  start-up and per-step adapter sync, and the figures against the anchors (ANCHORS: the reference
  job's 0.45 s/step on an H100, vLLM's 8,588 tokens/s for Qwen3-0.6B);
- qlora: two steps with a 4-bit base (where bitsandbytes has a kernel; skipped on a CPU);
- async: the LoRA job at spec.parameters.staleness 1 (trainer.ahead: the native decoder's
  producer thread samples the next step while this one updates, on the same card): seconds per
  step beside the synchronous run's (`asyncOverSync`), the estimate's overlapped step
  (max(sampling, update) + sync) against the measured one, and the step's importance ratios.
  vLLM as a server on another card is not sampled asynchronously yet (trainer.config refuses it),
  so the split a two-GPU node would give is not measured.
Each part runs only while the time budget (--budget-s, default 420 s) lasts; a skipped part
says why. The card is found from torch's device name; --gpu names it when that fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen/Qwen3-0.6B's config.json: the values that shape the network (as bench/qwen3_shape.py).
QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                  rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02)
# head_dim 64: the smallest shape vLLM's CPU attention serves, so --tiny runs the vllm part too
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64)
# What the GPU figures are compared with: SPEC §3's reference job on an H100 SXM (seconds per step),
# and vLLM's published throughput for Qwen3-0.6B on one H100 (completion tokens per second).
ANCHORS = {"referenceStepSecondsH100": 0.45, "vllmTokensPerSecondQwen3_0_6B_H100": 8588}
FULL_RUN = {"numGenerations": 8, "promptsPerStep": 8, "maxCompletionLength": 256, "steps": 4}
TINY_RUN = {"numGenerations": 2, "promptsPerStep": 2, "maxCompletionLength": 8, "steps": 2}


class Budget:
    """Seconds left for the check; parts that would start after it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def detect_gpu(name: str, memory_bytes: int) -> str | None:
    """The GPU table's name for torch's device name (`NVIDIA H200`, `NVIDIA A100-SXM4-80GB`,
    `Tesla T4`, `NVIDIA GeForce RTX 4090`), or None."""
    from grpo_run.runner.spec.gpus import GPUS

    squashed = "".join(ch for ch in name.lower() if ch.isalnum())
    if "a100" in squashed:
        return "A100-80GB" if memory_bytes > 60e9 else "A100"
    for table_name in sorted(GPUS, key=len, reverse=True):          # L40S before L4
        if "".join(ch for ch in table_name.lower() if ch.isalnum()) in squashed:
            return table_name
    return None


def write_job(folder: Path, model: Path, gpu: str, memory_gb: float | None, run: dict[str, int]) -> Path:
    """A job file for the check: word problems (the arithmetic tasks in words), a cheap reward."""
    from grpo_run.trainer.envs.catalog import arithmetic_tasks

    train, held = arithmetic_tasks(0, None, None)
    words = [{"prompt": f"What is {t['prompt'][0]} plus {t['prompt'][2]}? Put the answer in \\boxed{{}}.",
              "answer": t["answer"]} for t in train]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in words))
    (folder / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in words[:8]))
    (folder / "rewards.py").write_text("def score(completion, task):\n    return float(task['answer'] in completion)\n")
    spec: dict[str, Any] = {
        "model": str(model), "gpu": gpu,
        "environment": {"name": "words", "reward": str(folder / "rewards.py") + ":score",
                        "tasks": str(folder / "tasks.jsonl"), "evalTasks": str(folder / "eval.jsonl")},
        "parameters": {"numGenerations": run["numGenerations"], "promptsPerStep": run["promptsPerStep"],
                       "maxCompletionLength": run["maxCompletionLength"], "maxSteps": 1000, "lora": {"r": 8},
                       "method": "LoRA", "beta": 0.0, "learningRate": 1e-4, "seed": 0, "sampler": "native",
                       "chatTemplateKwargs": {"enable_thinking": False}}}
    if memory_gb is not None:                       # a card the table does not list: time, not money
        spec["pricing"] = {"usdPerHour": 1.0, "memoryGB": memory_gb}
    path = folder / "job.yaml"
    path.write_text(json.dumps({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                "metadata": {"name": "gpu-check"}, "spec": spec}))
    return path


def peak_gb(cuda: bool) -> float:
    import torch

    if cuda:
        return round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)


def train_steps(job, steps: int, cuda: bool) -> tuple[dict[str, Any], Any]:
    """`steps` GRPO steps of `job` (the first warms up; the rest are timed), and the trainer,
    left open for the decoders."""
    import torch

    from grpo_run.runner.environments import build_environment
    from grpo_run.trainer.trainer import GRPOTrainer

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(job.model, build_environment(job), job.parameters)
    try:
        metrics = [trainer.train_step(step) for step in range(steps)]
        timed = metrics[1:] or metrics
        step = statistics.median(m["stepSeconds"] for m in timed)
        sample = statistics.median(m["sampleSeconds"] for m in timed)
        tokens = statistics.median(m["completionLength"] for m in timed) * job.parameters.promptsPerStep \
            * job.parameters.numGenerations
        return {"steps": len(metrics), "stepSeconds": round(step, 4), "sampleSeconds": round(sample, 4),
                "samplingShare": round(sample / step, 3), "completionTokensPerStep": tokens,
                "completionTokensPerSecond": round(tokens / sample, 1), "peakGB": peak_gb(cuda),
                "perStep": [{k: round(m[k], 4) for k in ("stepSeconds", "sampleSeconds", "syncSeconds", "staleness",
                                                          "isRatioMean", "isRatioMax", "isTruncated") if k in m}
                            for m in metrics]}, trainer
    except BaseException:
        trainer.close()
        raise


def decoder_rates(trainer, compiled: bool, budget: Budget) -> dict[str, Any]:
    """Completion tokens/s of one step's sampling through each decoder (the same prompts)."""
    import torch

    from grpo_run.trainer.sampling import sampler

    p = trainer.params
    tasks = [t for t in trainer.env.train_tasks[:p.promptsPerStep] for _ in range(p.numGenerations)]
    ids, mask = trainer.rollout.text.encoder.encode([t["prompt"] for t in tasks])
    ids, mask = ids.to(trainer.device), mask.to(trainer.device)
    n, new = ids.size(0), p.maxCompletionLength
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)

    def ours(compile_: bool) -> Callable[[], None]:
        def run() -> None:
            sampler.sample(trainer.model, ids, mask, max_new_tokens=new, temperature=1.0, eos_ids=(),
                           pad_id=trainer.tokenizer.pad_token_id, generator=torch.Generator(device=ids.device)
                           .manual_seed(0), compiled=compile_)
        return run

    def hf_generate() -> None:
        with torch.no_grad():
            trainer.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=True, pad_token_id=trainer.tokenizer.pad_token_id)

    runs = {"default": ours(False), "compileDecode": ours(True), "hfGenerate": hf_generate}
    out: dict[str, Any] = {"completions": n, "tokens": new}
    for label, run in runs.items():
        if label == "compileDecode" and not compiled:
            out[label] = {"skipped": "--no-compile (a CPU's compile takes minutes)"}
            continue
        if budget.left() < (180 if label == "compileDecode" else 30):    # compiling takes minutes
            out[label] = {"skipped": "time budget spent"}
            continue
        run()                                        # warm-up: kernels chosen, graphs compiled
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        seconds = time.perf_counter() - t0
        out[label] = {"seconds": round(seconds, 3), "tokensPerSecond": round(n * new / seconds, 1)}
    return out


def vllm_steps(job, run: dict[str, int], cuda: bool, budget: Budget, native: dict[str, Any]) -> dict[str, Any]:
    """The LoRA job again, sampled by vLLM colocated; beside the native decoder's figures and the anchors."""
    from grpo_run.trainer.sampling.choice import vllm_version

    if vllm_version() is None:
        return {"skipped": "vLLM is not installed (pip install 'grpo-run[vllm]')"}
    if budget.left() < 120:
        return {"skipped": "time budget spent"}
    settings = {"gpuMemoryUtilization": 0.5 if cuda else 0.1}
    vjob = job.model_copy(update={"parameters": job.parameters.model_copy(
        update={"sampler": "vllm", "vllm": job.parameters.vllm.model_copy(update=settings)})})
    t0 = time.perf_counter()
    out, trainer = train_steps(vjob, run["steps"], cuda)
    try:
        out["engine"] = trainer.sampler.status()
        out["startSeconds"] = out["engine"]["startSeconds"]
        out["setupSeconds"] = round(time.perf_counter() - t0 - sum(s["stepSeconds"] for s in out["perStep"]), 2)
        out["syncSeconds"] = round(out["perStep"][-1]["syncSeconds"], 4)
    finally:
        trainer.close()
    out["vllmOverNative"] = {"stepSeconds": round(out["stepSeconds"] / native["stepSeconds"], 3),
                             "completionTokensPerSecond": round(out["completionTokensPerSecond"]
                                                                / native["completionTokensPerSecond"], 3)}
    out["anchors"] = {**ANCHORS,
                      "stepOverReference": round(out["stepSeconds"] / ANCHORS["referenceStepSecondsH100"], 3),
                      "tokensPerSecondOverPublished": round(out["completionTokensPerSecond"]
                                                            / ANCHORS["vllmTokensPerSecondQwen3_0_6B_H100"], 3)}
    return out


def async_steps(job, run: dict[str, int], cuda: bool, budget: Budget, native: dict[str, Any]) -> dict[str, Any]:
    """The LoRA job at staleness 1 (trainer.ahead), beside the synchronous run and the estimate."""
    from grpo_run.runner.estimate.estimate import estimate

    if budget.left() < 60:
        return {"skipped": "time budget spent"}
    ajob = job.model_copy(update={"parameters": job.parameters.model_copy(update={"staleness": 1})})
    est = estimate(ajob)
    out, trainer = train_steps(ajob, run["steps"], cuda)
    try:
        out["engine"] = trainer.sampler_status()
    finally:
        trainer.close()
    out["estimatedStepSeconds"] = est["stepSeconds"]
    out["estimatedSyncSeconds"] = est["stepModel"].get("syncSeconds")
    out["measuredOverEstimated"] = round(out["stepSeconds"] / est["stepSeconds"], 3)
    out["neededGB"] = est["memory"]["neededGB"]
    out["asyncOverSync"] = {"stepSeconds": round(out["stepSeconds"] / native["stepSeconds"], 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="a tiny config and 2 short steps (a CPU, a test)")
    ap.add_argument("--gpu", help="the card's table name when torch's device name does not say (default: found)")
    ap.add_argument("--steps", type=int, help="LoRA steps, the first untimed (default 4; --tiny 2)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the parts that would start after this")
    ap.add_argument("--no-compile", action="store_true", help="leave compileDecode out (default with --tiny)")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    started = time.perf_counter()

    import torch

    from grpo_run.trainer.model.policy import fix_mmap_threshold, pick_device

    fix_mmap_threshold()                 # as the trainer process of `grpo-run apply` does
    run = dict(TINY_RUN if args.tiny else FULL_RUN)
    run["steps"] = args.steps or run["steps"]
    device = pick_device()
    cuda = device.type == "cuda"
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                              "torch": torch.__version__, "tiny": args.tiny, "run": run}
    memory_gb = None
    gpu = args.gpu
    if gpu is None and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        gpu = detect_gpu(report["device"], total)
        if gpu is None:                              # not in the table: described by its memory
            gpu, memory_gb = report["device"].replace(" ", "-"), round(total / 1e9, 1)
    gpu = gpu or "H200"                              # a CPU run: the estimate of the card this check is for
    report["estimateGpu"] = gpu
    if not cuda:
        report["note"] = f"ran on a CPU: the estimate is {gpu}'s, so measured/estimated says nothing here"

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        report.update(check(work, gpu, memory_gb, run, args, budget, cuda, device))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("device", "estimateGpu", "seconds")}
                     | {"lora": {k: report["lora"][k] for k in ("stepSeconds", "estimatedStepSeconds",
                                                                  "measuredOverEstimated", "peakGB", "neededGB")}}))
    return 0


def check(work: Path, gpu: str, memory_gb: float | None, run: dict[str, int], args, budget: Budget, cuda: bool,
          device) -> dict[str, Any]:
    """The measurements, into a dict (main writes it)."""
    import torch

    from grpo_run.runner.estimate.estimate import estimate
    from grpo_run.runner.spec.job import load_job
    from grpo_run.trainer.model.policy import QLoRAUnavailable, check_qlora
    from grpo_run.trainer.model.tinymodel import build_chat_model

    report: dict[str, Any] = {}
    t0 = time.perf_counter()
    model = build_chat_model(work / "model", config=TINY if args.tiny else QWEN3_0_6B)
    report["buildSeconds"] = round(time.perf_counter() - t0, 1)
    job = load_job(write_job(work, model, gpu, memory_gb, run))
    est = estimate(job)
    report["estimate"] = {k: est[k] for k in ("gpu", "stepSeconds", "stepSecondsSource", "stepModel", "tokens")}
    report["estimate"]["neededGB"] = est["memory"]["neededGB"]

    lora, trainer = train_steps(job, run["steps"], cuda)
    lora["estimatedStepSeconds"] = est["stepSeconds"]
    lora["measuredOverEstimated"] = round(lora["stepSeconds"] / est["stepSeconds"], 3)
    lora["estimatedSamplingShare"] = est["stepModel"]["samplingShare"]
    lora["neededGB"] = est["memory"]["neededGB"]
    report["lora"] = lora
    try:
        report["decoders"] = decoder_rates(trainer, compiled=not (args.no_compile or args.tiny), budget=budget)
    finally:
        trainer.close()
        del trainer
        gc.collect()                                 # the LoRA model's memory, before QLoRA's peak
        if cuda:
            torch.cuda.empty_cache()

    report["vllm"] = vllm_steps(job, run, cuda, budget, lora)
    report["async"] = async_steps(job, run, cuda, budget, lora)

    try:
        check_qlora(device)
        if budget.left() < 60:
            raise QLoRAUnavailable("time budget spent")
        qjob = job.model_copy(update={"parameters": job.parameters.model_copy(update={"method": "QLoRA"})})
        qlora, qtrainer = train_steps(qjob, 2, cuda)
        qtrainer.close()
        qest = estimate(qjob)
        qlora.update(estimatedStepSeconds=qest["stepSeconds"], neededGB=qest["memory"]["neededGB"],
                     measuredOverEstimated=round(qlora["stepSeconds"] / qest["stepSeconds"], 3))
        report["qlora"] = qlora
    except QLoRAUnavailable as e:
        report["qlora"] = {"skipped": str(e)}
    return report


if __name__ == "__main__":
    sys.exit(main())
