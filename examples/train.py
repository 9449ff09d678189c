"""Train from Python: the custom-reward example (examples/custom-reward/) as a script, with its
rewards as plain functions and its tasks as a list of dicts. Nothing is downloaded: the tiny
model (tiny:char) is built locally; on 2 CPU cores it runs in a few minutes.

    python examples/train.py                            # train here, in the foreground
    python examples/train.py --max-steps 20             # a short run
    python examples/train.py --storage s3://bucket/runs --detach
                                                        # submit; a node trains it with
                                                        # grpo-run resume larger-digit --storage s3://bucket/runs

The rewards travel with the job (their source, packaged by grpo_run.train), so a node that has
nothing of this file scores with them. Interrupt it (Ctrl-C) and run it again: it continues from
its last checkpoint.
"""

from __future__ import annotations

import argparse
import random

import grpo_run


def correct(completion: str, task: dict) -> float:
    """Per completion: 1.0 when the completion starts with the larger digit."""
    return 1.0 if completion.strip()[:1] == task["answer"] else 0.0


def close(prompts, completions, answer, **columns):
    """TRL's batched signature, called once per batch: partial credit, less the further off a
    digit is (a group of wrong answers is ranked, so there is something to learn early on)."""
    scores = []
    for completion, want in zip(completions, answer):
        guess = completion.strip()[:1]
        scores.append(1.0 - abs(int(guess) - int(want)) / 9 if guess.isdigit() else 0.0)
    return scores


def tasks() -> list[dict]:
    """Every pair of different digits as "a,b=" with the larger as the answer, shuffled."""
    rows = [{"prompt": f"{a},{b}=", "answer": str(max(a, b))} for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(rows)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--storage", help="where the job lives (default: $GRPO_RUN_HOME/store)")
    parser.add_argument("--detach", action="store_true", help="submit to --storage for a node to train")
    args = parser.parse_args()

    rows = tasks()
    job = grpo_run.train(
        model="tiny:char", name="larger-digit",
        tasks=rows[:70], eval_tasks=rows[70:],
        rewards=[correct, (close, 0.5)],
        num_generations=8, prompts_per_step=8, max_completion_length=4, learning_rate=0.002,
        max_steps=args.max_steps, save_steps=max(1, min(50, args.max_steps // 2)), seed=0,
        storage=args.storage, detach=args.detach,
    )
    status = job.status()
    print(f"{job.name}: {status['phase']} at step {status['step']}")
    if status["phase"] == "Succeeded":
        print(f"  held-out reward by function: {status['final']['rewards']}")
        job.report("larger-digit.png")
        job.export("larger-digit-adapter")
        print("  wrote larger-digit.png and larger-digit-adapter/")
