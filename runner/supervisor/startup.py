"""The node's path to its first new step (SPEC §10, issue 52): what a replacement node pays at every
preemption between its process starting and its first new training step, in named parts.

The supervisor's parts and the trainer's (sent in its `Started` event: trainer.startup) are merged
on the wall clock, each part with its start (seconds after the node's `grpo-run` process started)
and its length; parts that ran side by side overlap and the total is the first new step's end, not
a sum. Recorded once per supervisor process, for its first attempt (a restart on the same node is
not a fresh node): the record's `startup` value (`grpo-run get tj -o yaml`: status.startup), a log
line, and bench/fresh_node.py reads it.
"""

from __future__ import annotations

import logging
from typing import Any

from grpo_run.trainer.startup import Part, clock

log = logging.getLogger(__name__)

# Every part's name, in the order a resume meets them, and what it is: the names the record, the
# log line and the bench use.
PARTS: dict[str, str] = {
    "imports": "the interpreter and grpo-run's imports, up to the command's first step",
    "job fetch": "the job's spec and record read from storage (resume)",
    "job files": "the job's reward and task files fetched from storage and checked by hash",
    "record check": "storage's record read before the lease: finished, or an engine missing here",
    "model fetch": "the model made available on this node (a tiny demo model built, or waited for while the "
                   "trainer started early builds it; a hub model is fetched by the trainer's load)",
    "model build": "the tiny demo model built by the trainer started early (its imports done)",
    "notice watchers": "the clouds' metadata services probed for the notice watchers (auto)",
    "lease": "the job's lease taken in storage",
    "record fetch": "the record fetched under the lease, and the spec checked against it",
    "checkpoint fetch": "the newest durable checkpoint fetched from storage into the work folder",
    "plan": "the trainer's plan: the engine, the baseline cache's fingerprint and lookup",
    "trainer spawn": "the trainer process started",
    "trainer imports": "the trainer's interpreter and imports (torch, transformers)",
    "model load": "the tokenizer and the policy (with its adapter) loaded",
    "grader start": "the reward functions' sandboxed workers started and their code loaded",
    "engine start": "the sampling engine started (vLLM's engine; the native decoder's is immediate)",
    "waiting for the checkpoint": "the trainer, ready, waiting for the supervisor's checkpoint fetch",
    "checkpoint load": "the checkpoint's adapter, optimizer, RNG and data position loaded into the trainer",
    "first step": "the first new training step (from the trainer's Started to its first Step)",
}


_FIRST = [True]      # this process's first trainer has not said Started yet


def first_attempt() -> bool:
    """True once per process: for its first trainer's Started (a restart on the same node is not
    a fresh node's path)."""
    first, _FIRST[0] = _FIRST[0], False
    return first


def path_to_first_step(trainer_parts: list[dict[str, Any]], first_step: tuple[float, float]) -> dict[str, Any]:
    """The whole path as the record keeps it: {totalSeconds, parts: [{part, startSeconds,
    seconds}]}, from this process's parts, the trainer's and the first step's (start, end)."""
    own = clock()
    parts: list[Part] = [*own.parts(), *[p for p in trainer_parts if _valid(p)]]   # type: ignore[misc]
    first = own.first_start()
    if first is not None:
        parts.append({"part": "imports", "start": own.origin, "end": first})
    parts.append({"part": "first step", "start": first_step[0], "end": first_step[1]})
    parts.sort(key=lambda p: p["start"])
    return {"totalSeconds": round(first_step[1] - own.origin, 3),
            "parts": [{"part": p["part"], "startSeconds": round(p["start"] - own.origin, 3),
                       "seconds": round(p["end"] - p["start"], 3)} for p in parts]}


def _valid(part: dict[str, Any]) -> bool:
    """A part as trainer.startup sends it (the event is the trainer's word, checked as any is)."""
    return (isinstance(part.get("part"), str) and part["part"] in PARTS
            and all(isinstance(part.get(k), (int, float)) for k in ("start", "end")))


def summary(path: dict[str, Any]) -> str:
    """One line: the total and each part, in the order they began."""
    parts = ", ".join(f"{p['part']} {p['seconds']:.2f} s (at {p['startSeconds']:.2f})" for p in path["parts"])
    return f"first new step {path['totalSeconds']:.2f} s after the node's process started: {parts}"
