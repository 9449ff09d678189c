"""`grpo-run report`: one picture of a run (and a Markdown summary beside it), drawn from its
record alone — the copy in storage is enough, on a machine that never ran the job.

Panels with data only, every one against the training step except the spend: the mean reward,
train (sampled completions on train tasks, raw points faint under a trailing mean) and held-out
(the baseline at step 0, the periodic evaluations, the final one at the last step); the groups
with identical rewards, split into solved (every completion scored 1) and no signal (all failed
alike); completion length with the truncated fraction; the update's gradient norm, with the KL
to the reference when beta > 0 and the clip ratio when numIterations > 1 (not the loss: it is ~0
by construction at numIterations 1); and, when the run has a rate, the spend in dollars over wall
time, one segment per attempt.

Every attempt that did not end the run is a boundary at the last step it completed, labelled with
why it ended (preempted by which cloud's notice, crashed, out of budget), and the steps the next
attempt had to redo (from its checkpoint back up to that step) are shaded.
"""

from __future__ import annotations

import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

from grpo_run.state import values
from grpo_run.state.phases import AttemptEnd
from grpo_run.state.record import Record

SMOOTH_FROM = 50          # steps from which a panel shows a trailing mean over faint raw points
REASONS = {AttemptEnd.PREEMPTED: "preempted", AttemptEnd.CRASHED: "crashed",
           AttemptEnd.BUDGET_EXCEEDED: "budget reached", AttemptEnd.FAILED: "failed",
           AttemptEnd.CANCELLED: "cancelled"}


def gather(record: Record) -> dict[str, Any]:
    """Everything the picture shows, read from the record once."""
    job = record.job()
    spec = job["spec"].get("spec", {})
    return {"name": job["name"], "phase": str(job["phase"]), "spec": spec,
            "params": spec.get("parameters", {}), "steps": record.steps(logged=True),
            "attempts": record.attempts(), "ledger": values.LEDGER.get(record),
            "spendUSD": values.spend_usd(record), "judgeUSD": values.JUDGE_USD.get(record),
            "baseline": record.eval("baseline"), "final": record.eval("final"),
            "heldOut": values.HELD_OUT.get(record), "samples": _samples(record),
            "sampler": values.SAMPLER.get(record) or {},
            "rewardSignal": values.REWARD_SIGNAL.get(record) or {}}


def _samples(record: Record) -> dict[str, list[dict[str, Any]]]:
    """The newest step's kept groups, and the baseline's and final evaluation's kept tasks."""
    out = {}
    for kind in ("step", "baseline", "final"):
        steps = record.sample_steps(kind)
        out[kind] = record.samples(kind, steps[-1:]) if steps else []
    return out


def boundaries(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per attempt that ended without finishing the run: {"attempt", "step" (its last
    completed step), "reason", "label", "redone" (steps the next attempt did again, 0 when none
    came yet), "resumedFrom" (the next attempt's checkpoint, None when none came yet)}."""
    out = []
    for i, a in enumerate(attempts):
        if a["ended"] is None or AttemptEnd(a["reason"]) is AttemptEnd.SUCCEEDED:
            continue                      # the attempt running now, or the run's end
        reason = AttemptEnd(a["reason"])
        step = a["to_step"] if a["to_step"] is not None else (a["from_step"] or 0)
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        resumed = None if nxt is None else (nxt["from_step"] or 0)
        if resumed is not None and resumed > step:   # a node lost before its record was stored:
            step = resumed                          # it got at least as far as the checkpoint
        label = REASONS[reason]
        if reason is AttemptEnd.PREEMPTED and a.get("notice"):
            label += f" ({a['notice']})"
        out.append({"attempt": a["id"], "step": step, "reason": reason, "label": label,
                    "redone": max(0, step - resumed) if resumed is not None else 0, "resumedFrom": resumed})
    return out


def spend_segments(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The spend over wall time: per attempt {"attempt", "t0", "t1" (minutes since the first
    attempt began), "usd0", "usd1" (dollars spent by then)}; a gap between attempts (no node)
    costs nothing. An attempt still running is drawn up to its newest step."""
    attempts = run["attempts"]
    if not attempts:
        return []
    origin = _time(attempts[0]["started"])
    spent, out = 0.0, []
    for a in attempts:
        entry = run["ledger"].get(str(a["id"]), {})
        seconds, usd = float(entry.get("seconds", 0.0)), float(entry.get("usd", 0.0))
        if a["ended"] is None:            # live: its newest step says how far it got
            mine = [s for s in run["steps"] if s["logged"] >= a["started"] and "costUSD" in s]
            if mine:
                seconds = max(seconds, (_time(mine[-1]["logged"]) - _time(a["started"])))
                usd = max(usd, mine[-1]["costUSD"] - spent)
        t0 = (_time(a["started"]) - origin) / 60
        out.append({"attempt": a["id"], "t0": t0, "t1": t0 + seconds / 60, "usd0": spent, "usd1": spent + usd})
        spent += usd
    return out


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each point the mean of itself and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def render(run: dict[str, Any], out: Path) -> dict[str, Any]:
    """Draw `run` (from `gather`) into the PNG `out`; what was drawn: {"boundaries", "panels" (the
    series drawn, by metric), "segments", "figure"} (the tests compare the figure's boundary
    lines with the record). Only panels with data: the spend needs a rate, KL needs beta > 0,
    the clip ratio numIterations > 1, the group outcomes steps that recorded them, turns per
    episode episodes, the tool error rate tools."""
    from matplotlib.figure import Figure      # no pyplot: no GUI backend, nothing global

    steps = run["steps"]
    xs = [s["step"] for s in steps]
    cuts = boundaries(run["attempts"])
    params = run["params"]
    beta = float(params.get("beta") or 0.0)
    rate = next((v.get("usdPerHour") for v in run["ledger"].values() if v.get("usdPerHour")), None)
    extra = [(key, name, label) for key, name, label, on in (
        ("kl", "KL", f"KL to the reference (beta {beta:g})", beta > 0),
        ("clipRatio", "clip ratio", "fraction of tokens clipped", int(params.get("numIterations", 1)) > 1)) if on]
    # episodes: how many replies they ran to, and with tools how often a call was answered with an error
    talked = [(key, name, label) for key, name, label in (
        ("episodeTurns", "turns per episode", "replies per episode"),
        ("toolErrorRate", "tool errors", "share of tool calls answered with an error"))
        if any(isinstance(s.get(key), (int, float)) for s in steps)]
    # four panels, one for KL and the clip ratio when they apply, one for episodes, one more for the
    # spend with a rate; an odd one out takes a whole row: no empty box
    count = 4 + bool(extra) + bool(talked) + bool(rate)
    rows = -(-count // 2)
    fig = Figure(figsize=(13, 3.5 * rows), dpi=100, layout="constrained")
    grid = fig.add_gridspec(rows, 2)
    cells = [grid[i // 2, i % 2] if i < count - 1 or count % 2 == 0 else grid[i // 2, :] for i in range(count)]
    reward_ax, groups_ax, length_ax, update_ax = (fig.add_subplot(c) for c in cells[:4])
    step_axes = [reward_ax, groups_ax, length_ax, update_ax]
    twins: dict[Any, Any] = {}                # a panel's axes -> its right-hand axes, if it has one
    panels: list[str] = []

    def series(ax, key: str, label: str, *, smooth: bool = False, color: str = "C0") -> bool:
        pts = [(s["step"], s[key]) for s in steps if isinstance(s.get(key), (int, float))]
        if not pts:
            return False
        x, y = zip(*pts)
        window = max(1, len(y) // 40)
        if smooth and len(y) >= SMOOTH_FROM and window > 1:
            ax.plot(x, y, ".", color=color, alpha=0.18, markersize=3, label=f"{label}, each step")
            ax.plot(x, trailing_mean(list(y), window), color=color, linewidth=1.8,
                    label=f"{label}, trailing mean over {window} steps")
        else:
            ax.plot(x, y, color=color, linewidth=1.2, label=label)
        panels.append(key)
        return True

    def empty(ax, text: str) -> None:
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")

    # the reward: the train reward is of sampled completions on train tasks, the held-out one of
    # greedy (or evalTemperature) answers to tasks never trained on: the gap between them is expected
    temperature, eval_t = params.get("temperature", 1.0), params.get("evalTemperature", 0.0)
    if not series(reward_ax, "rewardMean", f"train reward (sampled at temperature {temperature:g})", smooth=True):
        empty(reward_ax, "no steps yet")
    last = max(xs) if xs else int(params.get("maxSteps") or 0)
    how = "greedy" if not eval_t else f"temperature {eval_t:g}"
    if run["baseline"]:
        reward_ax.plot([0], [run["baseline"]["meanReward"]], "s", color="C3", markersize=8,
                       label=f"held-out baseline ({how}) {run['baseline']['meanReward']:.3f}")
    if run["heldOut"]:
        reward_ax.plot([e["step"] for e in run["heldOut"]], [e["meanReward"] for e in run["heldOut"]], "o-",
                       color="C2", markersize=4, label=f"held-out every evalSteps ({how})")
    if run["final"]:
        reward_ax.plot([last], [run["final"]["meanReward"]], "*", color="C3", markersize=14,
                       label=f"held-out final ({how}) {run['final']['meanReward']:.3f}")
    reward_ax.set_title("mean reward: train (sampled), held-out (never trained on)")

    # what the groups taught: identical groups are solved (fine) or without signal (the waste)
    drawn = series(groups_ax, "solvedGroups", "solved: every completion scored 1", color="C2", smooth=True)
    drawn = series(groups_ax, "noSignalGroups", "no signal: all failed alike", color="C3", smooth=True) or drawn
    if not drawn:               # steps recorded before the split
        series(groups_ax, "identicalGroups", "identical rewards", color="C4", smooth=True)
    groups_ax.set_ylim(-0.03, 1.03)
    warned = (run.get("rewardSignal") or {}).get("warning")
    groups_ax.set_title("groups with identical rewards (nothing to learn from)" +
                        ("\n" + "\n".join(textwrap.wrap(f"warning: {warned}", 66)) if warned else ""),
                        **({"color": "C3"} if warned else {}))

    if not series(length_ax, "completionLength", "completion tokens", color="C1", smooth=True):
        empty(length_ax, "no steps yet")
    length_ax.set_title("completion length (tokens), fraction truncated")
    if any(isinstance(s.get("truncatedFraction"), (int, float)) for s in steps):
        cut_ax = length_ax.twinx()
        series(cut_ax, "truncatedFraction", "truncated fraction", color="C5", smooth=True)
        cut_ax.set_ylim(-0.03, 1.03)
        cut_ax.set_ylabel("truncated fraction")
        twins[length_ax] = cut_ax

    # the update: the gradient norm before clipping (the loss is ~0 by construction at
    # numIterations 1 and is left out) and the entropy of sampling
    if not series(update_ax, "gradNorm", "gradient norm (before clipping)", color="C0", smooth=True):
        empty(update_ax, "no steps yet")
    title = "gradient norm"
    if any(isinstance(s.get("tokenEntropy"), (int, float)) for s in steps):
        twin = update_ax.twinx()
        series(twin, "tokenEntropy", "token entropy (nats)", color="C8", smooth=True)
        twin.set_ylabel("token entropy (nats)")
        twins[update_ax] = twin
        title += ", entropy of sampling (per token)"
    update_ax.set_title(title)
    # the KL to the reference when beta > 0, the clip ratio when numIterations > 1; episodes' turns
    # and tool errors: one or two series a panel, the second on its own scale at the right
    for cell, shown in zip(cells[4:], [items for items in (extra, talked) if items]):
        panel_ax = fig.add_subplot(cell)
        step_axes.append(panel_ax)
        for i, (key, _, label) in enumerate(shown):
            ax = panel_ax if i == 0 else panel_ax.twinx()
            series(ax, key, label, color=f"C{5 + i}", smooth=True)
            ax.set_ylabel(label)
            if i:
                twins[panel_ax] = ax
        panel_ax.set_title(" and ".join(name for _, name, _ in shown))

    for ax in step_axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.25)
        for cut in cuts:
            ax.axvline(cut["step"], color="C3", linestyle="--", linewidth=1, alpha=0.8, gid="attempt-boundary")
            if cut["redone"]:
                ax.axvspan(cut["resumedFrom"], cut["step"], color="C3", alpha=0.12, linewidth=0)
        # one legend per panel, on its topmost axes (a twin's would hide the other's)
        handles, labels = ax.get_legend_handles_labels()
        if ax in twins:
            more = twins[ax].get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        if ax is not reward_ax and handles:
            twins.get(ax, ax).legend(handles, labels, loc="upper right", fontsize=8)
    for i, cut in enumerate(cuts):          # labels staggered down, so close boundaries stay readable
        reward_ax.annotate(f"{cut['label']}\n{_redone(cut)} redone" if cut["redone"] else cut["label"],
                           (cut["step"], 1.0 - 0.11 * (i % 3)), xycoords=("data", "axes fraction"), xytext=(3, -3),
                           textcoords="offset points", va="top", fontsize=8, color="C3")
    if reward_ax.get_legend_handles_labels()[0]:     # below the panel: inside, it hid the curve's late steps
        reward_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)

    # the spend over wall time, when there is a rate to spend at
    segments = spend_segments(run)
    if rate:
        cost_ax = fig.add_subplot(cells[-1])
        for i, seg in enumerate(segments):
            cost_ax.plot([seg["t0"], seg["t1"]], [seg["usd0"], seg["usd1"]], color="C0", linewidth=2)
            if i + 1 < len(segments):
                cost_ax.plot([seg["t1"], segments[i + 1]["t0"]], [seg["usd1"]] * 2, color="0.6", linestyle=":")
            cost_ax.annotate(f"attempt {seg['attempt']}", (seg["t0"], seg["usd0"]), xytext=(2, 4),
                             textcoords="offset points", fontsize=8)
        panels.append("costUSD")
        cost_ax.set_title(f"spend (USD) over wall time at ${rate:g}/h")
        cost_ax.set_xlabel("minutes since the first attempt began")
        cost_ax.grid(alpha=0.25)

    fig.suptitle(_title(run, cuts), fontsize=12)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return {"boundaries": cuts, "panels": panels, "segments": segments, "figure": fig}


def _redone(cut: dict[str, Any]) -> str:
    """Steps redone after a boundary; after a node lost without a word it is a lower bound: the
    steps it did after the record last reached storage are not known."""
    return f">= {cut['redone']}" if cut["reason"] is AttemptEnd.CRASHED else str(cut["redone"])


def _title(run: dict[str, Any], cuts: list[dict[str, Any]]) -> str:
    steps = run["steps"]
    parts = [f"{run['name']}: {run['phase']} at step {steps[-1]['step'] if steps else 0} of "
             f"{run['params'].get('maxSteps', '?')}"]
    if run["baseline"] and run["final"]:
        parts.append(f"held-out reward {run['baseline']['meanReward']:.3f} before, "
                     f"{run['final']['meanReward']:.3f} after")
    usd = run["spendUSD"]
    if usd:
        parts.append(f"${usd:.4f}")
    n = len(run["attempts"])
    parts.append(f"{n} attempt{'s' if n != 1 else ''}")
    if cuts:
        lower = any(c["reason"] is AttemptEnd.CRASHED for c in cuts)     # a lost node's unseen steps are not counted
        redone = sum(c["redone"] for c in cuts)
        parts[-1] += f", {'at least ' if lower else ''}{redone} step{'' if redone == 1 else 's'} redone"
    return "; ".join(parts)


def summary(run: dict[str, Any], picture: str | None = None) -> str:
    """The run in Markdown: the outcome, the held-out evaluations and one row per attempt."""
    cuts = {c["attempt"]: c for c in boundaries(run["attempts"])}
    lines = [f"# {run['name']}", ""]
    if picture:
        lines += [f"![{run['name']}]({picture})", ""]
    steps = run["steps"]
    usd = run["spendUSD"]
    lines.append(f"- phase: **{run['phase']}**, step {steps[-1]['step'] if steps else 0} of "
                 f"{run['params'].get('maxSteps', '?')}")
    for kind in ("baseline", "final"):
        ev = run[kind]
        if ev:
            lines.append(f"- held-out {kind}: mean reward {ev['meanReward']:.3f} on {ev.get('tasks', '?')} tasks "
                         f"(solved {ev.get('solved', '?')}; computed {ev.get('runs', '?')} time(s))")
    if warned := (run.get("rewardSignal") or {}).get("warning"):
        lines.append(f"- **warning**: {warned}")
    if steps:
        lines.append(f"- train reward: first step {steps[0]['rewardMean']:.3f}, last step {steps[-1]['rewardMean']:.3f}")
    engine = run.get("sampler") or {}
    if engine.get("engine"):
        lines.append(f"- sampled with: {_engine(engine, steps)}")
    judges = ", ".join(f"{name} ${v:.4f}" for name, v in run["judgeUSD"].items())
    lines.append(f"- spend: ${usd:.4f}" + (f" (judge calls: {judges})" if judges else "")
                 + ("" if usd else " (no rate: set spec.gpu or spec.pricing.usdPerHour)"))
    lines += ["", "| attempt | node | started | ended | why | steps | redone after | USD |",
              "|---|---|---|---|---|---|---|---|"]
    notes = [] if run["attempts"] else ["No attempt yet: no node has run the job."]
    for a in run["attempts"]:
        cut = cuts.get(a["id"])
        why = cut["label"] if cut else (a["reason"] or "running").lower()
        span = f"{a['from_step'] or 0} -> {a['to_step'] if a['to_step'] is not None else '…'}"
        usd_a = run["ledger"].get(str(a["id"]), {}).get("usd", 0.0)
        lines.append(f"| {a['id']} | {a['node']} | {a['started'][:19]} | {(a['ended'] or '')[:19]} | {why} | "
                     f"{span} | {_redone(cut) if cut else 0} | {usd_a:.4f} |")
        if cut and cut["reason"] is AttemptEnd.CRASHED:
            notes.append(f"Attempt {a['id']}'s node was lost without a word: its steps and spend are those its "
                         "record had in storage (uploaded after a durable checkpoint, at most every 2 s, "
                         "and every 10 s); what it did after that is not known, so its redone steps are a lower bound.")
    if notes:
        lines += [""] + notes
    lines += _samples_md(run.get("samples") or {})
    return "\n".join(lines) + "\n"


def _engine(engine: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    """The engine line: which, its version and mode, its start-up, and the newest step's sync and mismatch."""
    last = steps[-1] if steps else {}
    if engine["engine"] == "native":
        if not engine.get("staleness"):
            return "native decoder"
        text = f"native decoder, asynchronous (staleness {engine['staleness']:g})"   # trainer.ahead
        if "isRatioMean" in last:
            text += (f"; newest step: importance ratio mean {last['isRatioMean']:.3f} (min {last['isRatioMin']:.3f}, "
                     f"max {last['isRatioMax']:.3f}), {last['isTruncated']:.1%} truncated")
        return text
    text = f"vLLM {engine.get('version', '')} ({engine.get('mode', 'colocate')})".replace("  ", " ")
    if engine.get("startSeconds") is not None:
        text += f", started in {engine['startSeconds']:.1f} s"
    if "syncSeconds" in last:
        text += f"; newest step: adapter sync {last['syncSeconds'] * 1000:.0f} ms, log-prob mismatch " \
                f"{last.get('logprobMismatch', 0.0):.1e}"
    return text


def _samples_md(samples: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The held-out tasks the run kept, the baseline's answer beside the final one, and the
    newest step's groups (`grpo-run samples` shows every kept one)."""
    def cell(text: Any) -> str:
        text = str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ")
        return f"`{text}`" if text.strip() else "(empty)" if not text else f"`{text}` (spaces)"

    lines: list[str] = []
    final = {g["item"]: g for g in samples.get("final", [])}
    if samples.get("baseline") and final:
        lines += ["", "## Held-out tasks before and after training", "",
                  "| held-out | prompt | baseline | reward | final | reward |", "|---|---|---|---|---|---|"]
        for g in samples["baseline"]:
            if g["item"] in final:
                b, f = g["completions"][0], final[g["item"]]["completions"][0]
                lines.append(f"| task {g['item'] + 1} | {cell(g['prompt'])} | {cell(b['text'])} | {b['reward']:.3f} | "
                             f"{cell(f['text'])} | {f['reward']:.3f} |")
    if samples.get("step"):
        step = samples["step"][0]["step"]
        lines += ["", f"## What the model wrote at step {step}", ""]
        for g in samples["step"]:
            lines += [f"Group {g['item'] + 1}: {cell(g['prompt'])}", "", "| completion | reward | advantage |",
                      "|---|---|---|"]
            lines += [f"| {cell(c['text'])} | {c['reward']:.3f} | {c['advantage']:+.2f} |" for c in g["completions"]]
            lines.append("")
        lines.pop()
    return lines


def _time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
