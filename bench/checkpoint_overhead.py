"""What checkpointing every step costs the training thread, measured side by side.

    .venv/bin/python bench/checkpoint_overhead.py            # ~4 min on 2 quiet cores
    .venv/bin/python bench/checkpoint_overhead.py --rounds 3 --storage both --profile

The demo job (examples/tiny-arithmetic.yaml) runs in-process as a real `trainer.run.Attempt`,
twice per round, in alternating order (A B, B A, A B, ...) so drift on a noisy machine hits
both configurations alike:

    ckpt  saveSteps=1            a checkpoint after every step (the copy into shared memory on
                                 the training thread; writing, fsync, manifest and upload in
                                 the checkpoint writer process)
    none  saveSteps > maxSteps   no checkpoint at all

Each attempt gets a fresh GRPO_RUN_HOME (a temporary folder) and its own storage: local (a
folder under that home) and, with `--storage s3|both`, `s3://` through the standard AWS
variables (AWS_ENDPOINT_URL for SeaweedFS / MinIO; the bucket is created if missing).

What is measured, on the training thread, inside `Attempt._train`: the interval from the start
of one step to the start of the next. That is the step's own work, plus what the thread does
between steps (the record's SQLite write, the copy into the writer's buffer), plus whatever the
checkpoint writer process and the record-sync thread take from it (the cores, the GIL). Model
load, the baseline and final evaluations and the wait for the last upload are outside it. The
median interval per attempt is the figure (robust to bursts of load from other processes); the
mean over the phase is printed too. Also per attempt: the record's own `stepSeconds` (train_step
alone: interference without the checkpoint pause), the pause itself (`Attempt._checkpoint`), and
the CPU time the writer process used per checkpoint.

Overhead = median over rounds of (ckpt ms/step / none ms/step) - 1. Goal: <= 3%. Exit status 1
when above it. `--profile` adds one instrumented attempt per storage: the wall and CPU time of
each piece of checkpoint work, by thread, per checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

JOB = REPO / "examples" / "tiny-arithmetic.yaml"
GOAL = 0.03


@dataclasses.dataclass
class Measurement:
    config: str
    storage: str
    intervals: list[float]         # the training thread, start of step k to start of step k+1
    train_seconds: float           # the training thread, first step to last (Attempt._train)
    step_seconds: list[float]      # the record's stepSeconds (train_step alone)
    snapshot_seconds: list[float]  # each in-thread checkpoint pause (Attempt._checkpoint)
    checkpoints: int               # checkpoints the record lists
    cpu_seconds: float             # this process's CPU time (every thread) during the phase
    writer_cpu_seconds: float      # the checkpoint writer process's CPU time until the phase ended

    @property
    def per_step(self) -> float:
        """The median step interval: robust to bursts of load from other processes, which a
        mean over the phase is not (on a shared 2-core machine one burst can double it)."""
        return statistics.median(self.intervals)

    @property
    def mean_step(self) -> float:
        return self.train_seconds / max(len(self.intervals), 1)



class _Timed:
    """Times the training phase of one Attempt, each step boundary in it and each checkpoint
    pause, without changing what any of them does (wraps bound methods of this attempt only)."""

    def __init__(self, attempt) -> None:
        self.train_seconds = self.cpu_seconds = self.writer_cpu_seconds = 0.0
        self.starts: list[float] = []
        self.snapshots: list[float] = []
        inner_train, inner_checkpoint = attempt._train, attempt._checkpoint

        def checkpoint(step: int):
            t = time.perf_counter()
            try:
                return inner_checkpoint(step)
            finally:
                self.snapshots.append(time.perf_counter() - t)

        def train(start: int) -> int:
            trainer = attempt.trainer
            inner_step = trainer.train_step

            def train_step(step: int):
                self.starts.append(time.perf_counter())
                return inner_step(step)

            trainer.train_step = train_step
            t0, c0, w0 = time.perf_counter(), time.process_time(), _cpu_of(attempt._writer._proc.pid)
            try:
                return inner_train(start)
            finally:
                end = time.perf_counter()
                self.train_seconds, self.cpu_seconds = end - t0, time.process_time() - c0
                self.writer_cpu_seconds = _cpu_of(attempt._writer._proc.pid) - w0
                self.starts.append(end)
                del trainer.train_step

        attempt._train, attempt._checkpoint = train, checkpoint

    @property
    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def _cpu_of(pid: int) -> float:
    """A live process's CPU seconds (user + system) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Profile:
    """--profile: wall and CPU time (time.thread_time: what that thread itself burned) of each
    piece of checkpoint work, by thread. Wraps functions by name where they exist; the
    wrappers cost microseconds, so profiled rounds are reported apart from the timed ones."""

    TARGETS = [  # (module, attribute path): what runs per checkpoint in the trainer's process
        ("trainer.run", "state_files"), ("trainer.run", "pack"),
        ("checkpoint.writer", "CheckpointWriter.buffer"), ("checkpoint.writer", "CheckpointWriter.submit"),
        ("checkpoint.writer", "CheckpointWriter.poll"),
        ("trainer.run", "Attempt._note_writer_events"), ("trainer.run", "Attempt._update_reward_signal"),
        ("trainer.run", "Attempt._write_ledger"), ("state.record", "Record.log_step"),
        ("state.record", "Record.add_checkpoint"), ("state.record", "Record.set_value"),
        ("state.record", "Record.steps"), ("state.record", "Record.snapshot"), ("checkpoint.store", "Store.put_file"),
    ]

    def __init__(self) -> None:
        import collections
        import functools
        import importlib
        import threading

        self.totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        self._undo = []
        for module_name, path in self.TARGETS:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent, None)
            if owner is None or not hasattr(owner, attr):
                continue
            inner = getattr(owner, attr)

            def wrapper(*args, _inner=inner, _label=path, **kwargs):
                w, c = time.perf_counter(), time.thread_time()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    thread = threading.current_thread().name.rsplit("_", 1)[0]
                    row = self.totals[(thread, _label)]
                    row[0] += 1
                    row[1] += time.perf_counter() - w
                    row[2] += time.thread_time() - c

            setattr(owner, attr, functools.wraps(inner)(wrapper))
            self._undo.append((owner, attr, inner))

    def close(self) -> None:
        for owner, attr, inner in reversed(self._undo):
            setattr(owner, attr, inner)

    def report(self, checkpoints: int) -> None:
        print(f"  where the checkpoint work goes, per checkpoint ({checkpoints} checkpoints; nested calls "
              "are counted in their callers too):")
        print(f"    {'thread':22s} {'what':32s} {'calls':>6s} {'wall ms':>8s} {'cpu ms':>7s}")
        for (thread, label), (n, wall, cpu) in sorted(self.totals.items(), key=lambda kv: -kv[1][2]):
            print(f"    {thread:22s} {label:32s} {n / checkpoints:6.2f} {wall / checkpoints * 1e3:8.2f} "
                  f"{cpu / checkpoints * 1e3:7.2f}")


def run_once(config: str, storage: str, steps: int, s3_url: str | None) -> Measurement:
    from runner.job import build_run_spec, load_job
    from state.record import Phase
    from trainer.run import Attempt

    home = Path(tempfile.mkdtemp(prefix=f"grpo-bench-{config}-"))
    os.environ["GRPO_RUN_HOME"] = str(home)
    job = load_job(JOB)
    save = 1 if config == "ckpt" else steps + 1
    job = dataclasses.replace(job, name=f"bench-{config}",
                              parameters=dataclasses.replace(job.parameters, maxSteps=steps, saveSteps=save))
    url = (f"{s3_url.rstrip('/')}/{uuid.uuid4().hex[:8]}" if storage == "s3" else str(home / "store")) + f"/{job.name}"
    try:
        attempt = Attempt(build_run_spec(job, url), home / "runs" / job.name, progress=False)
        timed = _Timed(attempt)
        outcome = attempt.run()
        if outcome.phase != Phase.SUCCEEDED:
            raise RuntimeError(f"{config}/{storage}: ended {outcome.phase} ({outcome.message})")
        with attempt.record as record:
            step_s = [s["stepSeconds"] for s in record.steps()]
            ckpts = len(record.checkpoints())
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return Measurement(config, storage, timed.intervals, timed.train_seconds, step_s, timed.snapshots, ckpts,
                       timed.cpu_seconds, timed.writer_cpu_seconds)


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
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every attempt (default 2)")
    ap.add_argument("--omp-wait", choices=["passive", "active", "unset"], default="passive",
                    help="OMP_WAIT_POLICY for torch's threads. passive (default): what the supervisor gives the "
                         "trainer unless the user set it, so what `grpo-run apply` runs with; active / unset: "
                         "threads that spin while they wait, which leaves the checkpoint writer no idle CPU")
    ap.add_argument("--storage", choices=["local", "s3", "both", "auto"], default="auto",
                    help="auto (default): local, plus s3 when AWS_ENDPOINT_URL is set")
    ap.add_argument("--s3-url", default="s3://grpo-run-bench/checkpoint-overhead",
                    help="where s3 attempts write (the bucket is created if missing)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, one instrumented ckpt attempt per storage: where the time goes")
    args = ap.parse_args(argv)

    import warnings

    if args.omp_wait == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait.upper()    # read once, when torch's OpenMP starts
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Could not find a config file")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    storages = {"local": ["local"], "s3": ["s3"], "both": ["local", "s3"],
                "auto": ["local", "s3"] if os.environ.get("AWS_ENDPOINT_URL") else ["local"]}[args.storage]
    if "s3" in storages:
        ensure_bucket(args.s3_url)
    print(f"checkpoint overhead of saveSteps=1: {JOB.name}, {args.steps} steps x {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"{os.cpu_count()} cpus, "
          f"storage {'+'.join(storages)}")
    print("  ms/step = median interval between step starts on the training thread (the step, the record "
          "write, the checkpoint pause);\n  stepSeconds = the record's median (train_step alone); pause = "
          "median in-thread checkpoint pause;\n  writer = the writer process's CPU ms per checkpoint;\n"
          "  ratio = ckpt / none of ms/step (of mean ms/step, of CPU seconds per step of the trainer and its writer)")
    run_once("none", storages[0], 3, args.s3_url)     # warm-up: imports, first kernels; not counted
    worst = 0.0
    for storage in storages:
        ratios, mean_ratios, cpu_ratios = [], [], []
        for r in range(args.rounds):
            order = ["ckpt", "none"] if r % 2 == 0 else ["none", "ckpt"]
            got = {c: run_once(c, storage, args.steps, args.s3_url) for c in order}
            a, b = got["ckpt"], got["none"]
            ratios.append(a.per_step / b.per_step)
            mean_ratios.append(a.mean_step / b.mean_step)
            cpu_ratios.append((a.cpu_seconds + a.writer_cpu_seconds) / (b.cpu_seconds + b.writer_cpu_seconds)
                              * len(b.intervals) / len(a.intervals))
            snap = statistics.median(a.snapshot_seconds) if a.snapshot_seconds else 0.0
            print(f"  [{storage}] round {r + 1} ({order[0]} first, load {os.getloadavg()[0]:.1f}): "
                  f"ckpt {a.per_step * 1e3:6.2f} ms/step (stepSeconds {statistics.median(a.step_seconds) * 1e3:6.2f}, "
                  f"pause {snap * 1e3:5.2f}, writer {a.writer_cpu_seconds / max(a.checkpoints, 1) * 1e3:5.2f})  "
                  f"none {b.per_step * 1e3:6.2f} ms/step (stepSeconds {statistics.median(b.step_seconds) * 1e3:6.2f})  "
                  f"ratio {ratios[-1]:.3f} (means {mean_ratios[-1]:.3f}, cpu {cpu_ratios[-1]:.3f})", flush=True)
        med = statistics.median(ratios)
        worst = max(worst, med - 1)
        print(f"  [{storage}] ratios {' '.join(f'{x:.3f}' for x in ratios)}\n"
              f"  [{storage}] median ratio {med:.3f} -> overhead {100 * (med - 1):+.1f}% (goal <= {GOAL:.0%}); "
              f"of means {statistics.median(mean_ratios):.3f}; of process CPU per step "
              f"{statistics.median(cpu_ratios):.3f} (less sensitive to other processes' load)", flush=True)
        if args.profile:
            profile = Profile()
            try:
                m = run_once("ckpt", storage, args.steps, args.s3_url)
            finally:
                profile.close()
            print(f"  [{storage}] profiled ckpt attempt: {m.per_step * 1e3:.2f} ms/step")
            profile.report(max(m.checkpoints, 1))
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
