"""Goodput under a spot market's notices: grpo-run against TRL's GRPOTrainer, one seeded schedule.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"       # TRL, for the benchmarks only
    .venv/bin/python bench/goodput.py --rates 2 6 20 --seeds 3    # the figures in docs/reliability.md
    .venv/bin/python bench/goodput.py --rates 20 --steps 100 --save-steps 10 --time-scale 6   # a short check

One job (bench/vs_trl.py's config A, the demo's settings, with a checkpoint every `--save-steps`
steps for both trainers) runs on a chain of "nodes". Each node is a fresh process tree in a fresh
work folder; the only thing a node inherits is storage (a folder, as a mounted bucket is). A seeded
preemption process gives each node its lifetime: exponential, a mean of 3600/R seconds of the
market's clock for R notices per hour. At the end of it:

  grpo-run  the node's metadata service (bench/emulators.py, a real HTTP server on 127.0.0.1, the
            address through GRPO_RUN_{AWS,GCP,AZURE}_METADATA_URL) says the instance is preempted;
            grpo-run checkpoints, uploads and exits. The next node runs `grpo-run resume NAME
            --storage URL` on an empty home.
  TRL       as a user runs it: GRPOTrainer with save_steps, output_dir on the storage folder,
            SIGTERM to the node's processes at the notice, and a restart loop that starts the next
            node with resume_from_checkpoint=<the newest checkpoint there>. The user's script
            evaluates the held-out tasks before training (only when no checkpoint exists) and after.

Whatever is still running when the notice window ends (`--notice-window`, default 30 s: GCP's and
Azure's notices) is SIGKILLed, as the cloud does. Both trainers get the same lifetimes, node by node.

Time. Hours of training are not available here, so the market's clock runs `--time-scale` times
faster than this machine's: the mean interval between notices is 3600 / (R * time_scale) seconds
here, and so is the boot delay (`--boot-delay`, the market's seconds from a replacement's request
to its process start; paid, not slept: nothing on a node depends on it). What a node does (imports,
the model's load, the restore, steps) takes this machine's real seconds, unscaled. So the figures
are those of a job whose steps and restarts take as long as here and whose notices come
`time_scale` times as often as R says: at the default 10, R = 20 per hour is a notice every 18 s of
this machine on average, against a restart of about 10-20 s on 2 cores. Read them as a stress test
that compares the two trainers under one schedule, not as the goodput of an hour on a GPU.

Printed per trainer and rate (the mean over the seeds), then grpo-run / TRL:
  goodput         the uninterrupted run's paid time (its node, boot included, start to exit: the
                  median of the reference and every run that met no notice) over the paid time of
                  all the nodes of the preempted run (boots included)
  steps twice     steps a node completed past the checkpoint the next node resumed from
  evals re-run    held-out evaluations started beyond the two the run needs (baseline, final)
  first step      a replacement's seconds from its process start to the end of its first new step,
                  in parts (grpo-run: the node's own clock in its record, some parts side by side;
                  TRL: the script's own clock, one part after another); see PARTS
  identical       whether the final adapter equals the uninterrupted run's (grpo-run: the exported
                  files' bytes; TRL: every tensor of adapter_model.safetensors)
Last line: a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.vs_trl import CONFIGS, grpo_job  # noqa: E402

NAME = "goodput"
TRAINERS = ("grpo-run", "TRL")
# What a replacement spends before its first new step, as each trainer can tell it apart.
PARTS = {
    "grpo-run": ("imports", "storage fetch", "model fetch", "model load", "grader start", "engine start", "restore",
                 "first step", "other"),
    # the node's own clock of its path (the record's `startup`, runner/supervisor/startup.py), its
    #   parts grouped: imports (the supervisor's and the trainer's interpreters), storage fetch (the
    #   job, its files, the record, the lease, the checkpoint), model fetch (a hub model's download;
    #   on a resume with the early trainer, the supervisor's wait while that trainer imports and
    #   builds the demo model), model load (the build and the load), grader start, engine start,
    #   restore (the checkpoint into the trainer),
    #   first step, other (the notice watchers' probe, the plan, the trainer's spawn). The trainer
    #   starts beside the supervisor, so parts overlap: their sum exceeds the path's seconds
    "TRL": ("imports", "model", "baseline", "restore", "first step"),
    # imports: torch, transformers, TRL; model: the model's files, its load and the GRPOTrainer
    #   (LoRA applied); baseline: the baseline evaluation again (0 unless no checkpoint was saved
    #   yet); restore: train() to on_train_begin (adapter, optimizer, scheduler read from the
    #   checkpoint on storage); first step: to the first new step's on_step_end
}
WINDOWS = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
GROUPS = {"imports": "imports", "trainer imports": "imports", "job fetch": "storage fetch",
          "job files": "storage fetch", "record check": "storage fetch", "lease": "storage fetch",
          "record fetch": "storage fetch", "checkpoint fetch": "storage fetch", "model fetch": "model fetch",
          "model build": "model load", "model load": "model load", "grader start": "grader start",
          "engine start": "engine start", "checkpoint load": "restore", "first step": "first step"}


# --- the preemption process --------------------------------------------------------------------

def lifetimes(seed: int, per_hour: float, time_scale: float) -> Iterator[float]:
    """Each node's seconds on this machine from its request to its notice: exponential draws with
    a mean of 3600 / (per_hour * time_scale), seeded (the same sequence for both trainers)."""
    draw = random.Random(seed)
    while True:
        yield draw.expovariate(per_hour * time_scale / 3600.0)


# --- one node ------------------------------------------------------------------------------------

@dataclass
class Node:
    """What one node did: its paid seconds (boot included) and what it trained."""

    paid: float
    exit: str                      # finished, noticed (exited inside the window), killed, lost in boot
    resumed_from: int | None = None
    last_step: int = 0             # the last step it completed (0: none)
    evals_started: int = 0
    parts: dict[str, float] = field(default_factory=dict)   # seconds, replacement nodes only
    first_step: float | None = None  # seconds from its process start to its first new step's end (replacements)


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def grpo_facts(home: Path, spawned: float) -> tuple[int | None, int, dict[str, float], float | None]:
    """(the step this node resumed from, its last completed step, the parts of its path to the
    first new step, that path's seconds) from the node's own copy of the record (runs/NAME/state.db):
    the path from `spawned` to the first new step's row, its parts from the node's own clock (the
    record's `startup`, grouped as PARTS says)."""
    path = home / "runs" / NAME / "state.db"
    if not path.exists():
        return None, 0, {}, None
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        attempt = db.execute("SELECT started, from_step FROM attempts ORDER BY id DESC LIMIT 1").fetchone()
        if attempt is None:
            return None, 0, {}, None
        started, from_step = _epoch(attempt[0]), attempt[1] or 0
        if started < spawned:      # the newest attempt is an earlier node's: this one was noticed before its own
            return None, 0, {}, None   # (while restoring, say) and trained nothing
        rows = db.execute("SELECT step, logged FROM steps WHERE step > ? ORDER BY step", (from_step,)).fetchall()
        clock = db.execute("SELECT value, updated FROM kv WHERE key = 'startup'").fetchone()
    finally:
        db.close()
    last = rows[-1][0] if rows else from_step
    if not rows:
        return from_step, last, {}, None
    parts: dict[str, float] = {}
    if clock and _epoch(clock[1]) >= started:     # this node's own path, recorded at its first new step
        for part in json.loads(clock[0]).get("parts", []):
            group = GROUPS.get(part["part"], "other")
            parts[group] = parts.get(group, 0.0) + part["seconds"]
    return from_step, last, parts, _epoch(rows[0][1]) - spawned


def parse_trl_lines(lines: list[str], spawned: float) -> tuple[int | None, int, int, dict[str, float]]:
    """(resumed from, last completed step, evaluations started, parts) from a TRL node's stdout:
    one JSON object a line, each with the epoch time `t` (non-JSON lines are TRL's own output)."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    at = {e["event"]: e["t"] for e in reversed(events)}                 # each event's first time
    begun = next((e for e in events if e["event"] == "train_begin"), None)
    resumed = begun["step"] if begun else None
    steps = [e["step"] for e in events if e["event"] == "step"]
    evals = sum(1 for e in events if e["event"] == "eval")
    parts: dict[str, float] = {}
    if begun and steps and {"imported", "model", "training"} <= at.keys():
        parts = {"imports": at["imported"] - spawned, "model": at["model"] - at["imported"],
                 "baseline": at["training"] - at["model"], "restore": at["train_begin"] - at["training"],
                 "first step": at["step"] - at["train_begin"]}
    return resumed, (steps[-1] if steps else (resumed or 0)), evals, parts


def _stop(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)                # the node's whole process tree, as the cloud does
    except ProcessLookupError:
        pass


def run_node(trainer: str, k: int, first: bool, folder: Path, store: Path, job: Path, spec: dict,
             notice_in: float, window: float, cloud: str, boot: float) -> Node:
    """Node k: boot (paid, not slept), then its process until it finishes or its notice comes at
    `notice_in` seconds after its request (then the window, then SIGKILL). `first`: no node has
    started a process before it (grpo-run's applies the job; the others resume it)."""
    if notice_in <= boot:
        return Node(paid=notice_in, exit="lost in boot")
    home = folder / f"node-{k}"
    home.mkdir(parents=True)
    env = {**os.environ, "GRPO_RUN_HOME": str(home)}
    env.pop("GRPO_RUN_FAULT", None)
    emulator = None
    if trainer == "grpo-run":
        from bench.emulators import AwsImdsEmulator, AzureScheduledEventsEmulator, GcpMetadataEmulator
        from grpo_run.runner.notices.clouds import (AWS_METADATA_URL_ENV, AZURE_METADATA_URL_ENV,
                                                    GCP_METADATA_URL_ENV)

        var, kind = {"aws": (AWS_METADATA_URL_ENV, AwsImdsEmulator), "gcp": (GCP_METADATA_URL_ENV, GcpMetadataEmulator),
                     "azure": (AZURE_METADATA_URL_ENV, AzureScheduledEventsEmulator)}[cloud]
        emulator = kind().start()
        env.update({"GRPO_RUN_NOTICES": cloud, var: emulator.url})
        args = (["apply", "-f", str(job)] if first else ["resume", NAME, "--storage", store.as_uri()])
        command = [sys.executable, "-m", "grpo_run.runner.cli", *args]
    else:
        command = [sys.executable, __file__, "--trl-node", json.dumps({**spec, "storage": str(store)})]
    out = open(home / "node.out", "w")
    spawned = time.time()
    proc = subprocess.Popen(command, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            proc.wait(timeout=None if notice_in == float("inf") else notice_in - boot)
            how = "finished" if proc.returncode == 0 else f"failed ({proc.returncode})"
        except subprocess.TimeoutExpired:
            if emulator is not None:
                emulator.trigger_preempt()
            else:
                _stop(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=window)
                how = "noticed"
            except subprocess.TimeoutExpired:
                _stop(proc, signal.SIGKILL)
                proc.wait()
                how = "killed"
        ended = time.time()
        _stop(proc, signal.SIGKILL)             # anything the node left behind goes with it
    finally:
        out.close()
        if emulator is not None:
            emulator.close()
    node = Node(paid=boot + ended - spawned, exit=how)
    if how.startswith("failed"):          # its chain ends unfinished (run_chain); the other runs go on
        print(f"  {trainer} node {k} {how}; its output ends:\n{(home / 'node.out').read_text()[-3000:]}",
              file=sys.stderr, flush=True)
    if trainer == "grpo-run":
        node.resumed_from, node.last_step, parts, first_step = grpo_facts(home, spawned)
        log = (home / "node.out").read_text()
        node.evals_started = log.count("baseline evaluation on") + log.count("final evaluation on")
    else:
        lines = (home / "node.out").read_text().splitlines()
        node.resumed_from, node.last_step, node.evals_started, parts = parse_trl_lines(lines, spawned)
        first_step = sum(parts.values()) if parts else None      # its parts follow one another
    node.parts = {} if first else parts
    node.first_step = None if first else first_step
    return node


# --- one run: a chain of nodes -------------------------------------------------------------------

@dataclass
class Run:
    nodes: list[Node]
    adapter: Path | None           # the final adapter's folder; None: not finished within --max-nodes

    @property
    def furthest(self) -> int:
        return max(n.last_step for n in self.nodes)

    @property
    def paid(self) -> float:
        return sum(n.paid for n in self.nodes)

    @property
    def steps_twice(self) -> int:
        """Steps completed on all the nodes beyond the run's own (a node that never got to train,
        stopped before its restore, counts none)."""
        done = sum(n.last_step - n.resumed_from for n in self.nodes if n.resumed_from is not None)
        return done - self.furthest

    @property
    def evals_rerun(self) -> int:
        """Evaluations started beyond those the run needed (a run not finished needed its baseline)."""
        return max(0, sum(n.evals_started for n in self.nodes) - (2 if self.adapter is not None else 1))


def run_chain(trainer: str, spec: dict, schedule: Iterator[float], folder: Path, args: argparse.Namespace) -> Run:
    folder.mkdir(parents=True)
    store = folder / "storage"
    store.mkdir()
    job = folder / "job.yaml"
    doc = grpo_job(CONFIGS["A"], spec["model"], spec["steps"], spec["saveSteps"], name=NAME)
    doc["spec"]["storage"] = store.as_uri()
    job.write_text(yaml.safe_dump(doc))
    boot = args.boot_delay / args.time_scale
    nodes: list[Node] = []
    while not nodes or nodes[-1].exit != "finished":
        if len(nodes) >= args.max_nodes:
            # no progress to speak of: the notices come faster than a node gets past its checkpoint
            print(f"  {trainer:8} not finished after {args.max_nodes} nodes", flush=True)
            return Run(nodes, None)
        first = all(n.exit == "lost in boot" for n in nodes)
        nodes.append(run_node(trainer, len(nodes), first, folder, store, job, spec, next(schedule),
                              args.notice_window, args.cloud, boot))
        print(f"  {trainer:8} node {len(nodes) - 1}: {nodes[-1].exit:12} {nodes[-1].paid:7.1f} s, "
              f"from step {nodes[-1].resumed_from} to {nodes[-1].last_step}", flush=True)
        if nodes[-1].exit.startswith("failed"):      # a restart loop would fail the same way again
            return Run(nodes, None)
    if trainer == "grpo-run":
        out = folder / "export"
        subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "export", NAME, "--storage", store.as_uri(),
                        "--out", str(out)], check=True, capture_output=True,
                       env={**os.environ, "GRPO_RUN_HOME": str(folder / "exporter")})
        return Run(nodes, out)
    return Run(nodes, store / "final")


def same_adapter(trainer: str, a: Path, b: Path) -> bool:
    if trainer == "grpo-run":
        files = sorted(p.name for p in a.iterdir())
        return files == sorted(p.name for p in b.iterdir()) and all(
            (a / f).read_bytes() == (b / f).read_bytes() for f in files)
    import torch
    from safetensors.torch import load_file

    x, y = (load_file(p / "adapter_model.safetensors") for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# --- TRL's node, as a user's script runs it ---------------------------------------------------------

def trl_node(spec: dict) -> None:
    """One node of a user's TRL restart loop: resume from the newest checkpoint in output_dir (on
    storage) if there is one, else evaluate first; train with save_steps; evaluate; save."""
    def say(event: str, **fields) -> None:
        print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)

    import torch  # noqa: F401 (the imports a TRL script pays, counted here)
    import transformers  # noqa: F401
    from transformers import TrainerCallback

    import trl  # noqa: F401

    from bench.vs_trl import held_out_reward, trl_trainer

    say("imported")

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            say("train_begin", step=state.global_step)

        def on_step_end(self, args, state, control, **kw):
            say("step", step=state.global_step)

    storage = Path(spec["storage"])
    out = storage / "trl"
    trainer, tok, held_out = trl_trainer({**CONFIGS["A"], **spec}, str(out), [Clock()], save_strategy="steps",
                                         save_steps=spec["saveSteps"])
    say("model")
    last = _newest_whole_checkpoint(out)
    if last is None:
        say("eval", kind="baseline")
        say("evaluated", kind="baseline", reward=held_out_reward(trainer.model, tok, held_out, spec["tokens"]))
    say("training")
    trainer.train(resume_from_checkpoint=last)
    say("eval", kind="final")
    say("evaluated", kind="final", reward=held_out_reward(trainer.model, tok, held_out, spec["tokens"]))
    trainer.save_model(str(storage / "final"))


def _newest_whole_checkpoint(out: Path) -> str | None:
    """The newest checkpoint-N in `out` that has its trainer_state.json (transformers writes it
    after the weights, optimizer and RNG state). transformers' get_last_checkpoint takes the
    highest N even when a notice's SIGTERM cut its writing short, and train() then fails on every
    node after (FileNotFoundError: trainer_state.json; found by this bench on 2026-12-07): a user
    whose restart loop met that once would skip such a folder, and so does this one."""
    import re

    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
             and (p / "trainer_state.json").is_file()] if out.exists() else []
    return str(max(found)[1]) if found else None


# --- the table -------------------------------------------------------------------------------------

def untouched(run: Run) -> bool:
    """A run that met no notice: one node, finished (an uninterrupted run's time, measured again)."""
    return len(run.nodes) == 1 and run.nodes[0].exit == "finished"


def summarize(runs: list[Run], reference: Run, trainer: str, reference_seconds: float | None = None) -> dict:
    """The figures of one trainer's `runs` at one rate. Goodput is `reference_seconds` (the median
    paid time of the runs that met no notice, the reference among them; default: the reference's
    own) over each finished run's paid time: an uninterrupted run's time varies by several percent
    from run to run on 2 cores, and one such run alone would put that into every goodput."""
    reference_seconds = reference.paid if reference_seconds is None else reference_seconds
    parts: dict[str, list[float]] = {}
    for run in runs:
        for node in run.nodes:
            for name, seconds in node.parts.items():
                parts.setdefault(name, []).append(seconds)
    means = {name: statistics.mean(v) for name, v in parts.items()}
    firsts = [n.first_step for run in runs for n in run.nodes if n.first_step is not None]
    done = [r for r in runs if r.adapter is not None]
    return {"goodput": statistics.mean(reference_seconds / r.paid for r in done) if done else None,
            "unfinished": [f"{len(r.nodes)} nodes, step {r.furthest}" for r in runs if r.adapter is None],
            "notices": statistics.mean(sum(n.exit != "finished" for n in r.nodes) for r in runs),
            "stepsTwice": statistics.mean(r.steps_twice for r in runs),
            "evalsRerun": statistics.mean(r.evals_rerun for r in runs),
            "firstStepSeconds": statistics.mean(firsts) if firsts else None, "firstStepParts": means,
            "identical": all(same_adapter(trainer, r.adapter, reference.adapter) for r in done) if done else None,
            "paidSeconds": statistics.mean(r.paid for r in runs), "referenceSeconds": reference_seconds}


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a / b:.2f}x" if b else ("1.00x" if a == 0 else "inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", nargs="+", type=float, default=[2, 6, 20], help="notices per hour of the market's clock")
    ap.add_argument("--seeds", type=int, default=1, help="schedules per rate (seeds 0..N-1); the figures are their mean")
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="the market's seconds per second of this machine (default 10: R=20/h is a notice every 18 s)")
    ap.add_argument("--boot-delay", type=float, default=0.0,
                    help="the market's seconds from a replacement's request to its process start (paid; default 0)")
    ap.add_argument("--cloud", choices=list(WINDOWS), default="gcp", help="whose metadata service gives notice")
    ap.add_argument("--notice-window", type=float, default=None,
                    help="seconds from a notice to the SIGKILL (default: the cloud's, 120 AWS, 30 GCP and Azure)")
    ap.add_argument("--steps", type=int, default=1500, help="training steps (default 1500, the demo's)")
    ap.add_argument("--save-steps", type=int, default=50, help="checkpoint interval of both trainers (default 50)")
    ap.add_argument("--max-nodes", type=int, default=200, help="give up a run after this many nodes")
    ap.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    ap.add_argument("--trl-node", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_node:
        trl_node(json.loads(args.trl_node))
        return 0
    for name in ("rates", "time_scale", "steps", "save_steps", "seeds", "max_nodes"):
        values = getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]
        if any(v <= 0 for v in values):
            ap.error(f"--{name.replace('_', '-')} must be above 0")
    if args.boot_delay < 0:
        ap.error("--boot-delay must be 0 or more")
    args.notice_window = WINDOWS[args.cloud] if args.notice_window is None else args.notice_window
    if "TRL" in args.trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL is not installed: .venv/bin/pip install -c constraints.txt -e \".[bench]\"", file=sys.stderr)
            return 2
    spec = {"model": "tiny:char", "steps": args.steps, "saveSteps": args.save_steps, "tokens": CONFIGS["A"]["tokens"]}
    root = Path(tempfile.mkdtemp(prefix="grpo-goodput-"))
    print(f"work folder {root}; the market's clock at {args.time_scale:g}x; boot {args.boot_delay:g} s of it; "
          f"notices from {args.cloud}, {args.notice_window:g} s to exit", flush=True)
    never = iter(lambda: float("inf"), None)
    references = {t: run_chain(t, spec, never, root / f"{t}-uninterrupted", args) for t in args.trainers}
    chains = {(rate, trainer): [run_chain(trainer, spec, lifetimes(seed, rate, args.time_scale),
                                          root / f"{trainer}-{rate:g}-{seed}", args) for seed in range(args.seeds)]
              for rate in args.rates for trainer in args.trainers}
    clean = {t: [references[t].paid] + [r.paid for (_, tr), runs in chains.items() if tr == t for r in runs if untouched(r)]
             for t in args.trainers}
    results = {f"{rate:g}": {t: summarize(chains[(rate, t)], references[t], t, statistics.median(clean[t]))
                             for t in args.trainers} for rate in args.rates}
    print("\nuninterrupted (the runs that met no notice, the reference first; goodput's numerator is their median):")
    for t, seconds in clean.items():
        print(f"  {t:9} {statistics.median(seconds):6.1f} s  ({', '.join(f'{x:.1f}' for x in seconds)})")
    print(f"\n{'R/h':>5} {'trainer':9} {'notices':>7} {'goodput':>7} {'twice':>6} {'evals':>5} {'1st step':>8}  "
          f"{'identical':9} parts (s)")
    for rate, row in results.items():
        for trainer, r in row.items():
            first = f"{r['firstStepSeconds']:8.1f}" if r["firstStepSeconds"] is not None else f"{'-':>8}"
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["firstStepParts"].items())
            goodput = f"{r['goodput']:7.2f}" if r["goodput"] is not None else f"{'-':>7}"
            unfinished = f" (not finished: {'; '.join(r['unfinished'])})" if r["unfinished"] else ""
            print(f"{rate:>5} {trainer:9} {r['notices']:7.1f} {goodput} {r['stepsTwice']:6.1f} "
                  f"{r['evalsRerun']:5.1f} {first}  {str(r['identical']):9} {parts}{unfinished}")
        if len(row) == 2:
            g, t = row["grpo-run"], row["TRL"]
            print(f"{rate:>5} grpo-run / TRL: goodput {_ratio(g['goodput'], t['goodput'])}, steps twice "
                  f"{_ratio(g['stepsTwice'], t['stepsTwice'])}, evals re-run {_ratio(g['evalsRerun'], t['evalsRerun'])}, "
                  f"first step {_ratio(g['firstStepSeconds'], t['firstStepSeconds'])}")
    print(json.dumps({"timeScale": args.time_scale, "bootDelay": args.boot_delay, "cloud": args.cloud,
                      "noticeWindow": args.notice_window, "steps": args.steps, "saveSteps": args.save_steps,
                      "seeds": args.seeds, "rates": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
