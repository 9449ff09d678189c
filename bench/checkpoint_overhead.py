"""What checkpointing every step costs training, measured side by side.

    .venv/bin/python bench/checkpoint_overhead.py            # ~4 min on 2 quiet cores
    .venv/bin/python bench/checkpoint_overhead.py --rounds 3 --storage both

The demo job (examples/tiny-arithmetic.yaml) runs as `grpo-run apply` runs it — a supervisor
process (the record, the uploads) and its trainer process (training, the checkpoint writer
process) — twice per round, in alternating order (A B, B A, A B, ...) so drift on a noisy
machine hits both configurations alike:

    ckpt  saveSteps=1            a checkpoint after every step (the copy into shared memory on
                                 the training thread; writing, fsync, hashing and the manifest
                                 in the checkpoint writer process; the upload in the supervisor)
    none  saveSteps > maxSteps   no checkpoint at all

Each attempt gets a fresh GRPO_RUN_HOME (a temporary folder) and its own storage: local (a
folder under that home) and, with `--storage s3|both`, `s3://` through the standard AWS
variables (AWS_ENDPOINT_URL for SeaweedFS / MinIO; the bucket is created if missing).

What is measured: the interval between consecutive steps as the run's record has them (each
step's row is written when the supervisor receives it). That is the step's own work, plus what
the training thread does between steps (the copy into the writer's buffer), plus whatever the
writer process and the supervisor take from it (the cores). Model load and the evaluations are
outside it. The median interval per attempt is the figure (robust to bursts of load from other
processes); the record's own `stepSeconds` (train_step alone) is printed beside it.

Overhead = median over rounds of (ckpt ms/step / none ms/step) - 1. Goal: <= 3%. Exit status 1
when above it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

JOB = REPO / "examples" / "tiny-arithmetic.yaml"
GOAL = 0.03


@dataclass
class Measurement:
    config: str
    storage: str
    intervals: list[float]         # between consecutive steps' rows in the record
    step_seconds: list[float]      # the record's stepSeconds (train_step alone)
    checkpoints: int               # checkpoints the record lists

    @property
    def per_step(self) -> float:
        """The median step interval: robust to bursts of load from other processes, which a
        mean over the phase is not (on a shared 2-core machine one burst can double it)."""
        return statistics.median(self.intervals)

    @property
    def mean_step(self) -> float:
        return sum(self.intervals) / max(len(self.intervals), 1)


def run_once(config: str, storage: str, steps: int, s3_url: str | None, env: dict[str, str]) -> Measurement:
    from grpo_run.state.record import Record

    home = Path(tempfile.mkdtemp(prefix=f"grpo-bench-{config}-"))
    doc = yaml.safe_load(JOB.read_text())
    doc["metadata"]["name"] = f"bench-{config}"
    doc["spec"]["parameters"].update(maxSteps=steps, saveSteps=1 if config == "ckpt" else steps + 1)
    doc["spec"]["storage"] = (f"{s3_url.rstrip('/')}/{uuid.uuid4().hex[:8]}" if storage == "s3"
                              else str(home / "store"))
    job = home / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    try:
        proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job)], cwd=REPO,
                              env={**env, "GRPO_RUN_HOME": str(home)}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{config}/{storage}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        with Record(home / "runs" / doc["metadata"]["name"] / "state.db") as record:
            rows = list(record.db["steps"].rows_where(order_by="step"))
            steps_ = record.steps()
            ckpts = len(record.checkpoints())
    finally:
        shutil.rmtree(home, ignore_errors=True)
    logged = [datetime.fromisoformat(r["logged"]).timestamp() for r in rows]
    return Measurement(config, storage, [b - a for a, b in zip(logged, logged[1:])],
                       [s["stepSeconds"] for s in steps_], ckpts)


def ensure_bucket(url: str) -> None:
    import boto3

    bucket = url.removeprefix("s3://").split("/", 1)[0]
    client = boto3.client("s3")
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:
        client.create_bucket(Bucket=bucket)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n  .venv/bin/python bench/checkpoint_overhead.py --rounds 7 --steps 60")
    ap.add_argument("--rounds", type=int, default=7, help="A/B pairs per storage (default 7)")
    ap.add_argument("--steps", type=int, default=60, help="training steps per attempt (default 60)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every trainer (default: what the supervisor "
                                                "gives it, runner.supervisor.threads.trainer_threads)")
    ap.add_argument("--omp-wait", choices=["passive", "active", "unset"],
                    help="OMP_WAIT_POLICY for torch's threads (default: the supervisor's choice); active / unset: "
                         "threads that spin while they wait, which leaves the checkpoint writer no idle CPU")
    ap.add_argument("--storage", choices=["local", "s3", "both", "auto"], default="auto",
                    help="auto (default): local, plus s3 when AWS_ENDPOINT_URL is set")
    ap.add_argument("--s3-url", default="s3://grpo-run-bench/checkpoint-overhead",
                    help="where s3 attempts write (the bucket is created if missing)")
    args = ap.parse_args(argv)

    env = {**os.environ, "GRPO_RUN_NOTICES": "none",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for var in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(var, None)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_wait not in (None, "unset"):
        env["OMP_WAIT_POLICY"] = args.omp_wait.upper()

    storages = {"local": ["local"], "s3": ["s3"], "both": ["local", "s3"],
                "auto": ["local", "s3"] if os.environ.get("AWS_ENDPOINT_URL") else ["local"]}[args.storage]
    if "s3" in storages:
        ensure_bucket(args.s3_url)
    print(f"checkpoint overhead of saveSteps=1: {JOB.name} under `grpo-run apply`, {args.steps} steps x "
          f"{args.rounds} rounds, OMP_NUM_THREADS {env.get('OMP_NUM_THREADS', 'the supervisor’s')}, "
          f"OMP_WAIT_POLICY {env.get('OMP_WAIT_POLICY', 'the supervisor’s')}, "
          f"{os.cpu_count()} cpus, storage {'+'.join(storages)}")
    print("  ms/step = median interval between consecutive steps in the record; stepSeconds = the record's "
          "median (train_step alone);\n  ratio = ckpt / none of ms/step (and of the mean interval)")
    run_once("none", storages[0], 3, args.s3_url, env)     # warm-up: the tiny model built, caches; not counted
    worst = 0.0
    for storage in storages:
        ratios, mean_ratios = [], []
        for r in range(args.rounds):
            order = ["ckpt", "none"] if r % 2 == 0 else ["none", "ckpt"]
            got = {c: run_once(c, storage, args.steps, args.s3_url, env) for c in order}
            a, b = got["ckpt"], got["none"]
            ratios.append(a.per_step / b.per_step)
            mean_ratios.append(a.mean_step / b.mean_step)
            print(f"  [{storage}] round {r + 1} ({order[0]} first, load {os.getloadavg()[0]:.1f}): "
                  f"ckpt {a.per_step * 1e3:6.2f} ms/step (stepSeconds {statistics.median(a.step_seconds) * 1e3:6.2f}, "
                  f"{a.checkpoints} checkpoints)  none {b.per_step * 1e3:6.2f} ms/step "
                  f"(stepSeconds {statistics.median(b.step_seconds) * 1e3:6.2f})  "
                  f"ratio {ratios[-1]:.3f} (means {mean_ratios[-1]:.3f})", flush=True)
        med = statistics.median(ratios)
        worst = max(worst, med - 1)
        print(f"  [{storage}] ratios {' '.join(f'{x:.3f}' for x in ratios)}\n"
              f"  [{storage}] median ratio {med:.3f} -> overhead {100 * (med - 1):+.1f}% (goal <= {GOAL:.0%}); "
              f"of means {statistics.median(mean_ratios):.3f}", flush=True)
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
