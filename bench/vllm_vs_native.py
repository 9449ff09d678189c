"""The same GRPO job sampled by the native decoder and by vLLM, side by side in one run.

    .venv/bin/python bench/vllm_vs_native.py                 # ~2 min on 2 cores
    .venv/bin/python bench/vllm_vs_native.py --tokens 128 --generations 8 --steps 6

The model is the demo's tiny model in the shape vLLM's CPU attention serves (head_dim 64, built
here); each engine trains the same LoRA job (the arithmetic tasks, a reward on length so every
completion runs long) for `--steps` steps through GRPOTrainer, the way `apply` runs it. Prints,
per engine, the median over the steps after the first of: sampling seconds, completion tokens
per second of sampling, step seconds; then vLLM over native for each, and the engine's start-up
and its per-step adapter sync. EOS is never drawn early here (the reward favours length), so
both engines sample the full maxCompletionLength in most rows.

On a GPU, bench/gpu_check.py does the same comparison on Qwen3-0.6B's shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(engine: str, model: Path, reward: str, args) -> dict:
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
    from grpo_run.trainer.trainer import GRPOTrainer

    params = GRPOParams(numGenerations=args.generations, promptsPerStep=args.prompts,
                        maxCompletionLength=args.tokens, maxSteps=args.steps, learningRate=1e-3, seed=0,
                        sampler=engine, vllm={"gpuMemoryUtilization": 0.1})
    arith = catalog_environment("arithmetic", seed=0, n_eval=8)
    env = user_environment(name="length", reward_ref=reward, tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))
    t0 = time.perf_counter()
    trainer = GRPOTrainer(str(model), env, params, work=Path(tempfile.mkdtemp()))
    started = time.perf_counter() - t0
    rows = []
    try:
        for step in range(args.steps):
            m = trainer.train_step(step)
            tokens = m["completionLength"] * args.prompts * args.generations
            rows.append({"sample": m["sampleSeconds"], "step": m["stepSeconds"], "tokens": tokens,
                         "sync": m.get("syncSeconds", 0.0)})
    finally:
        trainer.close()
    later = rows[1:] or rows
    med = lambda key: statistics.median(r[key] for r in later)       # noqa: E731
    return {"engine": engine, "start": started, "sample": med("sample"), "step": med("step"),
            "tokensPerSecond": statistics.median(r["tokens"] / r["sample"] for r in later), "sync": med("sync")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    from grpo_run.trainer.model.tinymodel import build_tiny_model

    folder = Path(tempfile.mkdtemp())
    model = build_tiny_model(folder / "tiny64", head_dim=64)
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    reward = f"{folder / 'length.py'}:score"
    results = [run(engine, model, reward, args) for engine in ("native", "vllm")]
    print(f"\n{args.prompts} prompts x G={args.generations}, up to {args.tokens} tokens, {args.steps} steps "
          f"(medians after the first)")
    print(f"{'engine':8} {'sampling s':>11} {'tokens/s':>10} {'step s':>8} {'start s':>8} {'sync s':>8}")
    for r in results:
        print(f"{r['engine']:8} {r['sample']:11.3f} {r['tokensPerSecond']:10.0f} {r['step']:8.3f} {r['start']:8.1f} "
              f"{r['sync']:8.3f}")
    native, vllm = results
    print(f"vLLM / native: tokens/s {vllm['tokensPerSecond'] / native['tokensPerSecond']:.2f}x, "
          f"step time {vllm['step'] / native['step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
