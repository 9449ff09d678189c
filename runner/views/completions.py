"""What the model wrote, from the run's record (runner.books.sample_books keeps it): what `grpo-run
samples` shows, as text for a terminal or as one object per completion."""

from __future__ import annotations

from typing import Any

from grpo_run.runner.text import printable
from grpo_run.state.record import Record

EVALS = {"baseline": "baseline", "final": "final", "heldout": "heldOut"}   # --eval -> the record's kind


class NoSamples(LookupError):
    """What was asked for is not in the record; the message says what is."""


def step_groups(record: Record, *, step: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
    """The kept groups of training step `step`, or of the newest `last` steps with samples
    (default 1). Raises NoSamples."""
    return _pick(record, "step", "training step", step=step, last=last)


def eval_tasks(record: Record, kind: str, *, step: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
    """The kept held-out tasks of evaluation `kind` (baseline | final | heldout: at `step`, or the
    newest `last`), each with the other evaluations' answer to the same task beside it
    ("baseline" on a final or held-out one's, "final" on the baseline's). Raises NoSamples."""
    ours = EVALS[kind]
    if ours == "heldOut":
        picked = _pick(record, ours, "held-out evaluation", step=step, last=last)
    else:
        picked = _pick(record, ours, f"{kind} evaluation")
    other = "final" if ours == "baseline" else "baseline"
    steps = record.sample_steps(other)
    beside = {g["item"]: g for g in record.samples(other, steps[-1:])} if steps else {}
    for g in picked:
        if g["item"] in beside:
            g[other] = beside[g["item"]]
    return picked


def _pick(record: Record, kind: str, what: str, *, step: int | None = None, last: int | None = None) -> list[dict]:
    steps = record.sample_steps(kind)
    if not steps:
        raise NoSamples(f"no {what} samples in job {record.job()['name']!r} yet")
    if step is not None:
        if step not in steps:
            raise NoSamples(f"no samples of {what} {step}: kept are {_ranges(steps)} (the newest 100 steps and, "
                            f"before them, evenly spaced ones)")
        chosen = [step]
    else:
        chosen = steps[-(last or 1):]
    return record.samples(kind, chosen)


def rows(groups: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """One object per completion: prompt, completion, rewards (by name), reward (their weighted
    sum), length (tokens), truncated (an episode's: turns and truncatedBy too), and where it came from (step, group or task, counted from
    1 as the text shows them); a training
    step's with its advantage and best/worst in its group, an evaluation's with the other
    evaluation's answer to the task."""
    out = []
    for g in groups:
        marks = _marks(g["completions"]) if kind == "step" else [None] * len(g["completions"])
        for c, mark in zip(g["completions"], marks):
            row = {"step": g["step"], ("group" if kind == "step" else "task"): g["item"] + 1, "prompt": g["prompt"],
                   "completion": c["text"], "rewards": c["rewards"], "reward": c["reward"], "length": c["length"],
                   "truncated": c["truncated"], "solved": g["solved"]}
            if c.get("turns") is not None:          # an episode: its replies, and the limit that ended it
                row.update(turns=c["turns"], truncatedBy=c.get("truncatedBy"))
            if c.get("toolCalls") is not None:      # with tools: the calls it made, and those answered with an error
                row.update(toolCalls=c["toolCalls"], toolErrors=c.get("toolErrors", 0))
            if c.get("exchange") is not None:       # an episode turn by turn
                row["exchange"] = exchange(c["exchange"])
            if kind == "step":
                row.update(advantage=c["advantage"], mark=mark)
            else:
                row["eval"] = EVALS[kind]
                for other in ("baseline", "final"):
                    if other in g:
                        theirs = g[other]["completions"][0]
                        row[other] = {"completion": theirs["text"], "rewards": theirs["rewards"],
                                      "reward": theirs["reward"], "solved": g[other]["solved"]}
            out.append(row)
    return out


def exchange(parts: list[str]) -> list[dict[str, Any]]:
    """An episode's replies and answers (alternating, as kept) as rows: {"from": "model", "turn": n,
    "text", "toolCall": true when it calls a tool} and {"from": "tools" | "environment", "text"}."""
    out: list[dict[str, Any]] = []
    for k, text in enumerate(parts):
        if k % 2 == 0:
            out.append({"from": "model", "turn": k // 2 + 1, "text": text,
                        **({"toolCall": True} if "<tool_call>" in text else {})})
        elif text:
            out.append({"from": "tools" if "<tool_response>" in text else "environment", "text": text})
    return out


def _completion(head: str, c: dict[str, Any]) -> list[str]:
    """A completion under its `head`: its text, or an episode turn by turn, each reply and answer
    on lines of its own, labelled (a reply that calls a tool, and the tools' results, marked)."""
    if c.get("exchange") is None:
        return _text(head, c["text"])
    lines = [head.rstrip()]
    for row in exchange(c["exchange"]):
        label = (f"reply {row['turn']}{' (tool call)' if row.get('toolCall') else ''}: " if row["from"] == "model"
                 else "tool results: " if row["from"] == "tools" else "environment: ")
        lines += _text(f"      {label:22}", row["text"])
    return lines


def render(groups: list[dict[str, Any]], kind: str) -> str:
    """Text for a terminal: each prompt, then its completions with their rewards."""
    lines: list[str] = []
    if kind == "step":
        by_step: dict[int, int] = {}
        for g in groups:
            by_step[g["step"]] = by_step.get(g["step"], 0) + 1
        for g in groups:
            rewards = [c["reward"] for c in g["completions"]]
            note = ""
            if len(set(rewards)) == 1:
                note = ("  (all equal: solved, nothing left to learn)" if g["solved"] else
                        "  (all equal: no signal, nothing to learn from)")
            lines.append(f"step {g['step']}, group {g['item'] + 1} of {by_step[g['step']]}{note}")
            lines += _text("prompt: ", g["prompt"])
            for c, mark in zip(g["completions"], _marks(g["completions"])):
                head = f"  {mark or '':5} {c['reward']:7.3f}  {_by_name(c)}  adv {c['advantage']:+.2f}  {_length(c)}  "
                lines += _completion(head, c)
            lines.append("")
    else:
        for g in groups:
            where = f" after step {g['step']}" if EVALS[kind] in ("heldOut", "final") else ""
            lines.append(f"task {g['item'] + 1}{where}")
            lines += _text("prompt: ", g["prompt"])
            ours = EVALS[kind]
            order = [("baseline", g if ours == "baseline" else g.get("baseline")),
                     ("held-out", g) if ours == "heldOut" else ("final", g if ours == "final" else g.get("final"))]
            for label, theirs in order:
                if theirs is None:
                    continue
                c = theirs["completions"][0]
                head = f"  {label:9} {c['reward']:7.3f}  {_by_name(c)}  {'solved' if theirs['solved'] else 'unsolved'}  "
                lines += _completion(head, c)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _marks(completions: list[dict]) -> list[str | None]:
    """best / worst of a group (every completion that ties for it); none when all are equal."""
    rewards = [c["reward"] for c in completions]
    hi, lo = max(rewards), min(rewards)
    if hi == lo:
        return [None] * len(rewards)
    return ["best" if r == hi else "worst" if r == lo else None for r in rewards]


def _by_name(c: dict) -> str:
    return " ".join(f"{printable(k)}={v:.3f}" for k, v in c["rewards"].items())


def _length(c: dict) -> str:
    n = c["length"]
    if c.get("turns") is not None:          # an episode: the tokens the model wrote over its turns
        turns, ended = c["turns"], c.get("truncatedBy")
        calls, errors = c.get("toolCalls"), c.get("toolErrors") or 0
        tools = "" if calls is None else f", {calls} tool call{'' if calls == 1 else 's'}" + \
            (f" ({errors} answered with an error)" if errors else "")
        return (f"{turns} turn{'' if turns == 1 else 's'}, {n} token{'' if n == 1 else 's'} written{tools}"
                f"{f' (ended at {ended})' if ended else ''}")
    return f"{n} token{'' if n == 1 else 's'}{' (truncated)' if c['truncated'] else ''}"


def _text(head: str, text: str) -> list[str]:
    """`head` then the text: quoted on one line, or each of its lines after a `|`, under each
    other; made safe for a terminal (printable)."""
    parts = text.split("\n")
    if len(parts) == 1:
        return [f'{head}"{printable(text)}"']
    pad = " " * len(head)
    return [f"{head}| {printable(parts[0])}"] + [f"{pad}| {printable(p)}" for p in parts[1:]]


def _ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] as "3-5, 9"."""
    out: list[list[int]] = []
    for s in steps:
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
