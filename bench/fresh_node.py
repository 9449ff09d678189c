"""The fresh node's path to its first new step (SPEC §10, issue 52), measured on the demo.

    .venv/bin/python bench/fresh_node.py [--repeat 3] [--steps 20] [--compare] [--log]

Once: the demo job (examples/tiny-arithmetic.yaml, its storage a folder here) trains on one node
until --steps steps are done, then a notice (SIGINT) makes its newest step durable: the job is
Preempted in storage. Then, --repeat times: a copy of that storage, an EMPTY GRPO_RUN_HOME (no
model, no work folder) and a fresh `grpo-run resume` process, stopped once its first new step is
in its record. Each run prints the path the node recorded (the record's `startup` value: each part
with when it began and how long it took, parts that overlap shown as they ran; the total is the
first new step's end after the process started, as the kernel recorded its start) and this
script's own wall time from starting the process to seeing that step (a cross-check; it polls).
--compare runs each repetition once more with GRPO_RUN_PREWARM=0 (the trainer process started only
when its plan is ready, no imports overlapped) and prints the totals side by side, as a ratio.
Timings depend on the machine and its load: the script prints the load average with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LOG = [False]           # --log: each node's output (what it logged, the trainer started early or not)
NAME = "tiny-arithmetic"


CHECKOUT = [REPO]      # --checkout: the grpo-run whose fresh node is measured (its .venv)


def grpo_run(home: Path, *args: str, **env: str) -> subprocess.Popen:
    python = CHECKOUT[0] / ".venv" / "bin" / "python" if CHECKOUT[0] != REPO else Path(sys.executable)
    return subprocess.Popen([str(python), "-m", "grpo_run.runner.cli", *args], cwd=CHECKOUT[0],
                            env={**os.environ, "GRPO_RUN_HOME": str(home), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def db_query(home: Path, sql: str):
    db = home / "runs" / NAME / "state.db"
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute(sql).fetchone()
    except sqlite3.Error:
        return None


def stop(proc: subprocess.Popen, limit_s: float = 120) -> str:
    """A notice (SIGINT) to the node, and its output once it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=limit_s)
    return out


def prepare(folder: Path, steps: int) -> Path:
    """The demo job Preempted in a folder store after `steps` steps; the store's path."""
    job = yaml.safe_load((REPO / "examples" / "tiny-arithmetic.yaml").read_text())
    store = folder / "store"
    job["spec"]["storage"] = str(store)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    home = folder / "first-node"
    proc = grpo_run(home, "apply", "-f", str(folder / "job.yaml"))
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        done = db_query(home, "select count(*) from steps")
        if done and done[0] >= steps:
            break
        time.sleep(0.05)
    out = stop(proc)
    if "Preempted" not in out:
        sys.exit(f"the first node did not end Preempted:\n{out[-3000:]}")
    return store


def fresh_node(folder: Path, store: Path, label: str, **env: str) -> dict:
    """A fresh node resuming from a copy of `store`: its recorded path to the first new step."""
    run = folder / label
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(store, run / "store")
    home = run / "home"                                    # empty: no model, no work folder
    with sqlite3.connect(f"file:{run / 'store' / NAME / 'state.db'}?mode=ro", uri=True) as conn:
        before = (conn.execute("select value from kv where key = 'startup'").fetchone() or [None])[0]
        last = conn.execute("select max(step) from steps").fetchone()[0] or 0
    t0 = time.time()
    proc = grpo_run(home, "resume", NAME, "--storage", str(run / "store"), **env)
    path, seen = None, None
    while proc.poll() is None and time.time() - t0 < 600:
        if seen is None and ((db_query(home, "select max(step) from steps") or [0])[0] or 0) > last:
            seen = time.time() - t0          # a new step in this node's record (any grpo-run's)
        row = db_query(home, "select value from kv where key = 'startup'")
        if row and row[0] != before:         # this node's, not the earlier node's that storage's record holds
            path = json.loads(row[0])
            seen = time.time() - t0 if seen is None else seen
            break
        if seen is not None and CHECKOUT[0] != REPO:
            break                            # a grpo-run that records no path: its wall time alone
        time.sleep(0.02)
    out = stop(proc)
    if seen is None:
        sys.exit(f"{label}: no first new step was recorded:\n{out[-3000:]}")
    if path is None:                          # --checkout of a grpo-run before the path was recorded
        path = {"totalSeconds": round(seen, 2), "parts": []}
    if LOG[0]:
        print(out[-3000:])
    return {**path, "seenSeconds": round(seen, 2)}


MODEL_PARTS = ("model build", "model load", "engine start", "first step")


def own_start(path: dict) -> float:
    """grpo-run's own start, as the estimate's restart counts it (runner.estimate.preemption's
    GRPO_RUN_START_SECONDS): the path less the demo model's build (the trainer's, or the
    supervisor's "model fetch" where it built it itself) and load, the engine's start and the
    first step itself, which the estimate counts by size or apart."""
    names = {p["part"] for p in path["parts"]}
    less = MODEL_PARTS if "model build" in names else (*MODEL_PARTS, "model fetch")
    return path["totalSeconds"] - sum(p["seconds"] for p in path["parts"] if p["part"] in less)


def show(label: str, path: dict) -> None:
    print(f"\n{label}: first new step {path['totalSeconds']:.2f} s after the process started "
          f"(seen by this script {path['seenSeconds']:.2f} s after starting it); less "
          f"{' / '.join(MODEL_PARTS)}: {own_start(path):.2f} s")
    print(f"  {'part':<28} {'starts at':>9} {'takes':>8}")
    for p in path["parts"]:
        print(f"  {p['part']:<28} {p['startSeconds']:>8.2f}s {p['seconds']:>7.2f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="fresh nodes to measure (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="steps the first node trains before its notice")
    ap.add_argument("--compare", action="store_true",
                    help="also measure each with GRPO_RUN_PREWARM=0 (no trainer started early)")
    ap.add_argument("--log", action="store_true", help="print each fresh node's output")
    ap.add_argument("--checkout", type=Path, default=REPO,
                    help="measure another checkout's grpo-run (its .venv), e.g. before a change; one that records "
                         "no path gives this script's wall time alone")
    args = ap.parse_args()
    CHECKOUT[0] = args.checkout.resolve()
    LOG[0] = args.log
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory(prefix="grpo-run-fresh-node-") as tmp:
        folder = Path(tmp)
        store = prepare(folder, args.steps)
        totals: dict[str, list[float]] = {"default": [], "GRPO_RUN_PREWARM=0": []}
        starts: list[float] = []
        for i in range(args.repeat):
            path = fresh_node(folder, store, f"node-{i}")
            show(f"fresh node {i + 1}", path)
            totals["default"].append(path["totalSeconds"])
            starts.append(own_start(path))
            if args.compare:
                path = fresh_node(folder, store, f"node-{i}-cold", GRPO_RUN_PREWARM="0")
                show(f"fresh node {i + 1}, GRPO_RUN_PREWARM=0", path)
                totals["GRPO_RUN_PREWARM=0"].append(path["totalSeconds"])
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
        for label, values in totals.items():
            if values:
                print(f"{label}: first new step after {statistics.median(values):.2f} s (median of "
                      f"{len(values)}: {', '.join(f'{v:.2f}' for v in values)})")
        print(f"grpo-run's own start (less {' / '.join(MODEL_PARTS)}): {statistics.median(starts):.2f} s (median)")
        if args.compare:
            print(f"ratio (default / GRPO_RUN_PREWARM=0): "
                  f"{statistics.median(totals['default']) / statistics.median(totals['GRPO_RUN_PREWARM=0']):.2f}")


if __name__ == "__main__":
    main()
