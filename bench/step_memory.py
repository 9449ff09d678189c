"""Peak memory of one GRPO training step with Qwen3's vocabulary, with and without micro-batching.

    .venv/bin/python bench/step_memory.py                 # ~3 min on 2 cores, ~12 GB of RAM at most
    .venv/bin/python bench/step_memory.py --sizes 8 16 --micro 4 8

A model with Qwen3's 151,936-token vocabulary (random weights, 2 layers x 64 hidden: the
vocabulary, not the body, is what the logits cost) samples B x G completions of 256 tokens
(G = 8; random weights almost never emit EOS, so every completion runs to the limit) and takes
one training step on the CPU. Each configuration runs in a fresh process, so its peak is its
own: `peak` is the process's maximum resident set (getrusage), `step` the part of it the step
added over the resident set just before the step. Each process fixes glibc's mmap threshold as
the trainer process does (trainer.policy.fix_mmap_threshold); `--sliding-mmap` leaves glibc's
default, to see what that costs.

With `microBatchSize: 4` the step holds one micro-batch's logits and their gradient at a time:
its peak should stay flat (within 15%) as B x G grows. `microBatchSize = B x G` is the
single-batch step (what grpo-run did before micro-batching), for comparison. Exit status 1 when
the micro-batched peak grows by more than 15% from the smallest B x G to the largest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_VOCAB = 151_936
GROUP = 8
COMPLETION_TOKENS = 256


def one(model: str, completions: int, micro: int, fixed_mmap: bool = True) -> dict:
    """One training step in this process; its peak memory."""
    import psutil
    import torch

    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import user_environment
    from grpo_run.trainer.trainer import GRPOTrainer
    from grpo_run.trainer.model.policy import fix_mmap_threshold

    if fixed_mmap:
        fix_mmap_threshold()             # as the trainer process of `grpo-run apply` does
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder = Path(tempfile.mkdtemp())
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    tasks = [{"prompt": f"What is {a} plus {b}?"} for a in range(8) for b in range(8)]
    params = GRPOParams(numGenerations=GROUP, promptsPerStep=completions // GROUP, maxCompletionLength=COMPLETION_TOKENS,
                        microBatchSize=micro, learningRate=1e-4, seed=0)
    trainer = GRPOTrainer(model, user_environment(name="length", reward_ref=f"{folder / 'length.py'}:score",
                                                  tasks=tasks, eval_tasks=tasks[:2]), params)
    try:
        before = psutil.Process().memory_info().rss
        metrics = trainer.train_step(0)
    finally:
        trainer.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # KiB on Linux
    return {"completions": completions, "micro": micro, "peakGB": peak / 1e9, "stepGB": (peak - before) / 1e9,
            "completionLength": metrics["completionLength"], "microBatches": metrics["microBatches"],
            "seconds": metrics["stepSeconds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="B x G values (multiples of 8)")
    ap.add_argument("--micro", type=int, nargs="+", default=[4], help="micro-batch sizes to measure")
    ap.add_argument("--no-single", action="store_true", help="skip the single-batch comparison")
    ap.add_argument("--sliding-mmap", action="store_true", help="keep glibc's sliding mmap threshold")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "COMPLETIONS", "MICRO", "MMAP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]), args.one[3] == "fixed")))
        return 0

    from grpo_run.trainer.model.tinymodel import build_chat_model

    model = build_chat_model(Path(tempfile.mkdtemp()) / "qwen3-vocab", config={"vocab_size": QWEN3_VOCAB})
    runs = [(n, m) for m in args.micro for n in args.sizes]
    if not args.no_single:
        runs += [(n, n) for n in args.sizes]
    results = []
    for n, m in runs:
        out = subprocess.run([sys.executable, __file__, "--one", str(model), str(n), str(m),
                              "sliding" if args.sliding_mmap else "fixed"], capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            sys.stderr.write(out.stderr)
            return 2
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"B x G = {n:3d}  microBatchSize = {m:3d}  peak {r['peakGB']:6.2f} GB  step +{r['stepGB']:6.2f} GB  "
              f"({r['microBatches']} micro-batches, {r['completionLength']:.0f} tokens each, {r['seconds']:.1f} s)",
              flush=True)
    status = 0
    for m in args.micro:
        mine = sorted((r for r in results if r["micro"] == m), key=lambda r: r["completions"])
        growth = mine[-1]["peakGB"] / mine[0]["peakGB"]
        print(f"microBatchSize {m}: peak at B x G = {mine[-1]['completions']} / at {mine[0]['completions']} = {growth:.3f}")
        status |= growth > 1.15
    if not args.no_single:
        single = sorted((r for r in results if r["micro"] == r["completions"]), key=lambda r: r["completions"])
        print(f"single batch: peak at B x G = {single[-1]['completions']} / at {single[0]['completions']} = "
              f"{single[-1]['peakGB'] / single[0]['peakGB']:.3f}")
        for m in args.micro:
            big = max((r for r in results if r["micro"] == m), key=lambda r: r["completions"])
            print(f"at B x G = {big['completions']}: single batch / microBatchSize {m} = "
                  f"{single[-1]['peakGB'] / big['peakGB']:.2f}x the peak")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
