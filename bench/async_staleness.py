"""Asynchronous GRPO on this CPU: staleness 0 (sample, then train) against 1 and 2 (trainer.ahead:
a producer process samples step k+N with the policy of step k while step k updates), side by side.

    .venv/bin/python bench/async_staleness.py                     # the measured figures (a quiet machine)
    .venv/bin/python bench/async_staleness.py --steps 4 --eval-tasks 8   # a tiny check that it runs

Two configurations of the tiny local model (tiny:char, nothing downloaded), on the arithmetic
environment: the demo's (examples/tiny-arithmetic.yaml: 8 prompts x 8 completions of 8 tokens) and
one with longer completions (8 x 4 of 48 tokens), where sampling takes a larger share of a step.
For each staleness: steps/s over the run (the steps after the first, which warms up), the
synchronous run's sampling share, the held-out mean reward after training (greedy, the same
tasks), and the importance ratios' mean and the share truncated; then the ratio to staleness 0.
Each run is its own process, with the threads `grpo-run apply` gives its trainer
(runner.supervisor.threads: every core on up to 3, short OpenMP spins); an asynchronous run splits
them between the update and the producer (trainer.ahead.split_threads). A control row, staleness 0
on one thread (`0/1t`), separates what the overlap buys from what one thread per phase does: on a
loaded machine the synchronous run's two threads wait for each other at every operation (measure
on a quiet one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    "demo": {"numGenerations": 8, "promptsPerStep": 8, "maxCompletionLength": 8, "learningRate": 0.002},
    "long": {"numGenerations": 4, "promptsPerStep": 8, "maxCompletionLength": 48, "learningRate": 0.002},
    # bench/vs_trl.py's config C: 4 layers x 256 hidden, whose operations are long enough to run
    # outside Python's interpreter lock, so a producer thread and the update can share the cores
    "bigger": {"numGenerations": 8, "promptsPerStep": 8, "maxCompletionLength": 12, "learningRate": 0.0005},
}


def one_run(config: str, staleness: int, steps: int, eval_tasks: int) -> dict[str, Any]:
    """In this process: `steps` steps of `config` at `staleness`, then the held-out evaluation."""
    from grpo_run.runner.home import ensure_model
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import catalog_environment
    from grpo_run.trainer.trainer import GRPOTrainer

    params = GRPOParams(**CONFIGS[config], maxSteps=steps, staleness=staleness, seed=0, evalTasks=eval_tasks)
    env = catalog_environment("arithmetic", seed=0, n_eval=eval_tasks)
    if config == "bigger":
        from bench.vs_trl import build_bigger

        model = build_bigger(Path(os.environ.get("GRPO_RUN_HOME", Path.home() / ".grpo-run")) / "bench-models")
    else:
        model = ensure_model("tiny:char")
    trainer = GRPOTrainer(model, env, params)
    try:
        metrics = [trainer.train_step(0)]                 # warms up (the decoders, the kernels): not timed
        t0 = time.perf_counter()
        metrics += [trainer.train_step(step) for step in range(1, steps)]
        seconds = time.perf_counter() - t0
        held = trainer.evaluate(env.eval_tasks)
    finally:
        trainer.close()
    out = {"config": config, "staleness": staleness, "steps": steps, "seconds": round(seconds, 3),
           "stepsPerSecond": round((steps - 1) / seconds, 2), "heldOutReward": round(held.meanReward, 4),
           "threads": trainer.cpu_threads}
    if staleness == 0:
        out["samplingShare"] = round(statistics.mean(m["sampleSeconds"] / m["stepSeconds"] for m in metrics), 3)
    else:
        out["isRatioMean"] = round(statistics.mean(m["isRatioMean"] for m in metrics), 4)
        out["isTruncated"] = round(statistics.mean(m["isTruncated"] for m in metrics), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    ap.add_argument("--eval-tasks", type=int, default=30, help="held-out tasks evaluated after training")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="the lags compared (0 first)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "STALENESS"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write every run's figures to this file")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first warms up and is not timed)")
    if args.one:                                     # a child: one run, its figures on stdout
        print(json.dumps(one_run(args.one[0], int(args.one[1]), args.steps, args.eval_tasks)))
        return 0
    from grpo_run.runner.supervisor.threads import trainer_threads

    env = {**os.environ, **trainer_threads(os.cpu_count() or 1, os.environ)}     # as `grpo-run apply` starts it
    runs: list[dict[str, Any]] = []
    for config in args.configs:
        for staleness, threads in [(args.staleness[0], None), (args.staleness[0], 1),
                                   *[(s, None) for s in args.staleness[1:]]]:
            one = {**env, "OMP_NUM_THREADS": "1"} if threads else env
            done = subprocess.run([sys.executable, __file__, "--one", config, str(staleness), "--steps",
                                   str(args.steps), "--eval-tasks", str(args.eval_tasks)],
                                  capture_output=True, text=True, check=True, cwd=REPO, env=one)
            runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "control": bool(threads)})
    print(f"{'config':<6} {'staleness':>9} {'steps/s':>8} {'x sync':>7} {'held-out':>9} {'sampling':>9} "
          f"{'IS mean':>8} {'truncated':>9}")
    for config in args.configs:
        base = next(r for r in runs if r["config"] == config and not r["control"])
        for r in (r for r in runs if r["config"] == config):
            lag = f"{r['staleness']}/1t" if r["control"] else str(r["staleness"])
            share = f"{r['samplingShare']:.2f}" if "samplingShare" in r else ""
            ratio = f"{r['isRatioMean']:.4f}" if "isRatioMean" in r else ""
            cut = f"{r['isTruncated']:.4f}" if "isTruncated" in r else ""
            print(f"{config:<6} {lag:>9} {r['stepsPerSecond']:>8.2f} "
                  f"{r['stepsPerSecond'] / base['stepsPerSecond']:>6.2f}x {r['heldOutReward']:>9.3f} {share:>9} "
                  f"{ratio:>8} {cut:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
