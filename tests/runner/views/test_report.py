"""`grpo-run report`: the picture of a run, drawn from storage alone, with every attempt boundary
where the record has it."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter

import yaml

from grpo_run.runner.views.report import boundaries, trailing_mean
from tests.tiny_models import seed_home
from tests.faults.harness import fault_env, wait_until
from tests.runner.jobs.test_resume import REPO, grpo_run, write_job
from tests.runner.supervisor.test_supervisor import start_apply


def test_trailing_mean_averages_each_point_with_the_ones_before_it():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([2.0, 4.0], 5) == [2.0, 3.0]


def test_boundaries_say_why_each_attempt_ended_and_what_the_next_one_redid():
    attempts = [
        {"id": 1, "ended": "t", "reason": "Preempted", "notice": "aws", "from_step": 0, "to_step": 30},
        {"id": 2, "ended": "t", "reason": "Crashed", "notice": None, "from_step": 30, "to_step": 57},
        {"id": 3, "ended": "t", "reason": "Succeeded", "notice": None, "from_step": 50, "to_step": 100}]
    assert boundaries(attempts) == [
        {"attempt": 1, "step": 30, "reason": "Preempted", "label": "preempted (aws)", "redone": 0, "resumedFrom": 30},
        {"attempt": 2, "step": 57, "reason": "Crashed", "label": "crashed", "redone": 7, "resumedFrom": 50}]


def with_tracking(job, tracking, **spec):
    doc = yaml.safe_load(job.read_text())
    doc["spec"].update(tracking=tracking, **spec)
    job.write_text(yaml.safe_dump(doc))
    return job


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_report_of_a_twice_preempted_run_is_drawn_from_storage_alone(tmp_path):
    store = str(tmp_path / "bucket")                       # the job's storage: nothing else is shared
    job = with_tracking(write_job(tmp_path, store), {"tensorboard": True}, pricing={"usdPerHour": 36.0})
    # attempt 1: a notice (SIGTERM) while step 2 is in its backward pass
    held = tmp_path / "held-a"
    proc = start_apply(tmp_path / "node-a", job, GRPO_RUN_NOTICES="none", **fault_env("hold:backward@2", held))
    wait_until("the hold", held.exists, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    # attempt 2: the node is killed without a word while checkpoint 4 is going up (files, not
    # yet its manifest): the next node redoes what came after checkpoint 3
    killed = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", store, fault="upload@4",
                      check=False)
    assert killed.returncode == -signal.SIGKILL
    # attempt 3: another notice, at step 6; attempt 4 finishes the job
    held = tmp_path / "held-c"
    env = {"GRPO_RUN_NOTICES": "none", **fault_env("hold:backward@6", held)}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage", store],
                            cwd=REPO, env={**os.environ, "GRPO_RUN_HOME": str(seed_home(tmp_path / "node-c")), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until("the hold", held.exists, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    grpo_run(tmp_path / "node-d", "resume", "resumable", "--storage", store)

    # a machine that never ran the job: the storage URL is all it has
    viewer = tmp_path / "viewer"
    picture = viewer / "out" / "report.png"
    started = time.monotonic()
    done = grpo_run(viewer, "report", "resumable", "--storage", store, "--out", str(picture))
    print(f"\nreport drawn in {time.monotonic() - started:.1f} s: {done.stdout.strip()}")
    assert png_size(picture) == (1300, 1050)
    summary = picture.with_suffix(".md").read_text()
    attempts = json.loads(grpo_run(viewer, "get", "tj", "resumable", "--storage", store, "-o", "json").stdout
                          )["status"]["attempts"]
    assert [a["reason"] for a in attempts] == ["Preempted", "Crashed", "Preempted", "Succeeded"]
    redone = [attempts[i]["toStep"] - attempts[i + 1]["fromStep"] for i in range(3)]
    assert redone[0] == 0 and redone[2] == 0 and redone[1] >= 0   # notices lose nothing; a kill may
    assert [a["fromStep"] for a in attempts[1:3]] == [3, 3]
    assert f"3 boundaries, {sum(redone)} steps redone" in done.stdout
    for a, r, label in zip(attempts, redone, ["preempted (signal)", "crashed", "preempted (signal)"]):
        shown = f">= {r}" if label == "crashed" else str(r)     # what a lost node did unseen is unknown
        assert f"| {label} | {a['fromStep']} -> {a['toStep']} | {shown} |" in summary
    assert "| succeeded |" in summary
    # every attempt is charged, the node killed without a word too (up to its newest logged step)
    usd = [float(row.rsplit("|", 2)[-2]) for row in summary.splitlines() if row.startswith("| ") and "vm" in row
           or row[:4] in ("| 1 ", "| 2 ", "| 3 ", "| 4 ")]
    assert len(usd) == 4 and all(u > 0 for u in usd), summary

    # the picture's own boundary lines sit at the steps the record gives, on every step panel
    from grpo_run.runner.jobs.find import open_record
    from grpo_run.runner.views.report import gather, render

    os.environ["GRPO_RUN_HOME"] = str(viewer)
    try:
        with open_record("resumable", store) as record:
            drawn = render(gather(record), viewer / "again.png")
    finally:
        del os.environ["GRPO_RUN_HOME"]
    lines = [ln for ax in drawn["figure"].axes for ln in ax.get_lines() if ln.get_gid() == "attempt-boundary"]
    assert sorted({ln.get_xdata()[0] for ln in lines}) == sorted({a["toStep"] for a in attempts[:3]})
    assert len(lines) == 3 * 4                                          # on each of the 4 step panels
    assert drawn["panels"] == ["rewardMean", "solvedGroups", "noSignalGroups", "completionLength", "truncatedFraction",
                               "gradNorm", "tokenEntropy", "costUSD"]
    assert [seg["attempt"] for seg in drawn["segments"]] == [1, 2, 3, 4]

    # TensorBoard: every step exactly once across the four attempts' event files, read back
    # with tensorboard's own loader (raw events: duplicates would show) and its accumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from grpo_run.state.record import Record

    folder = tmp_path / "bucket" / "resumable" / "tensorboard"
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 4, files                          # one per attempt, all in storage
    seen = Counter((v.tag, e.step) for f in files for e in EventFileLoader(str(f)).Load() for v in e.summary.value)
    assert {n for n in seen.values()} == {1}, [k for k, n in seen.items() if n > 1]
    tb = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    rewards = tb.Scalars("train/rewardMean")
    with Record(tmp_path / "node-d" / "runs" / "resumable" / "state.db") as record:
        steps = record.steps()
        baseline, final = record.eval("baseline")["meanReward"], record.eval("final")["meanReward"]
    assert [r.step for r in rewards] == [s["step"] for s in steps] == list(range(1, 9))
    assert [r.value for r in rewards] == [struct.unpack("f", struct.pack("f", s["rewardMean"]))[0] for s in steps]
    assert [(r.step, round(r.value, 4)) for r in tb.Scalars("eval/baseline/meanReward")] == [(0, round(baseline, 4))]
    assert [(r.step, round(r.value, 4)) for r in tb.Scalars("eval/final/meanReward")] == [(8, round(final, 4))]
    assert [r.step for r in tb.Scalars("cost/usd")] == list(range(1, 9))


def tensorboard_points(folder):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return Counter((v.tag, e.step) for f in sorted(folder.glob("events.out.tfevents.*"))
                   for e in EventFileLoader(str(f)).Load() for v in e.summary.value)


def test_tensorboard_holds_each_step_once_after_a_restart_redid_steps(tmp_path):
    """A crashed trainer is restarted on the same node from its last checkpoint: the steps after
    it are trained again, and their points are already in this node's event file."""
    job = with_tracking(write_job(tmp_path), {"tensorboard": str(tmp_path / "tb")})
    done = grpo_run(tmp_path / "node", "apply", "-f", str(job), fault="backward@5/trainer")
    assert "restart 1 of 3 (crashes)" in done.stderr
    attempts = json.loads(grpo_run(tmp_path / "node", "get", "tj", "resumable", "-o", "json").stdout
                          )["status"]["attempts"]
    assert [a["reason"] for a in attempts] == ["Crashed", "Succeeded"]
    assert attempts[1]["fromStep"] < attempts[0]["toStep"] == 5      # steps were redone
    points = tensorboard_points(tmp_path / "tb" / "resumable")
    assert set(points.values()) == {1}, [k for k, n in points.items() if n > 1]
    assert sorted(step for tag, step in points if tag == "train/loss") == list(range(1, 9))


def synthetic_steps(n: int = 59) -> list[dict]:
    return [{"step": i, "logged": f"2026-12-01T12:00:{i:02d}+00:00", "rewardMean": i / 60, "completionLength": 5.0,
             "identicalGroups": 0.5, "solvedGroups": 0.2, "noSignalGroups": 0.3, "truncatedFraction": 0.1,
             "gradNorm": 0.5, "tokenEntropy": 1.2, "loss": 0.01, "kl": 0.001 * i, "clipRatio": 0.02, "learningRate": 1e-5,
             "costUSD": i / 1000} for i in range(1, n + 1)]


def test_with_beta_the_update_panel_carries_the_kl_and_every_panel_has_its_series(tmp_path):
    from grpo_run.runner.views.report import render

    steps = synthetic_steps()
    run = {"name": "kl-job", "phase": "Training", "spec": {}, "params": {"beta": 0.04, "maxSteps": 100},
           "steps": steps, "attempts": [{"id": 1, "node": "n", "started": "2026-12-01T12:00:00+00:00", "ended": None,
                                         "reason": None, "notice": None, "from_step": 0, "to_step": None}],
           "ledger": {"1": {"seconds": 0.0, "usd": 0.0, "usdPerHour": 3.6}}, "spendUSD": 0.0, "judgeUSD": {}, "baseline": None, "final": None,
           "heldOut": [{"step": 20, "meanReward": 0.4}, {"step": 40, "meanReward": 0.5}]}
    drawn = render(run, tmp_path / "kl.png")
    assert drawn["panels"] == ["rewardMean", "solvedGroups", "noSignalGroups", "completionLength", "truncatedFraction",
                               "gradNorm", "tokenEntropy", "kl", "costUSD"]    # no clip ratio: numIterations 1
    kl_axis = [ax for ax in drawn["figure"].axes if ax.get_ylabel().startswith("KL")]
    assert kl_axis and kl_axis[0].get_lines()[-1].get_ydata()[-1] > 0
    assert drawn["boundaries"] == []                                     # the one attempt is still running
    assert drawn["segments"] == [{"attempt": 1, "t0": 0.0, "t1": 59 / 60, "usd0": 0.0, "usd1": 0.059}]
    assert png_size(tmp_path / "kl.png") == (1300, 1050)
    # the reward panel's legend sits below it, never over the curve
    fig = drawn["figure"]
    reward_ax = fig.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)                                            # the layout the PNG has
    legend, plot = reward_ax.get_legend().get_window_extent(renderer), reward_ax.get_window_extent(renderer)
    assert legend.y1 < plot.y0 and not legend.overlaps(plot)


def test_without_a_rate_there_is_no_spend_box_and_the_clip_ratio_comes_with_several_iterations(tmp_path):
    from grpo_run.runner.views.report import render

    run = {"name": "no-rate", "phase": "Succeeded", "spec": {}, "params": {"numIterations": 2, "maxSteps": 59},
           "steps": synthetic_steps(), "attempts": [{"id": 1, "node": "n", "started": "2026-12-01T12:00:00+00:00",
                                                     "ended": "2026-12-01T12:01:00+00:00", "reason": "Succeeded",
                                                     "notice": None, "from_step": 0, "to_step": 59}],
           "ledger": {"1": {"seconds": 60.0, "usd": 0.0, "usdPerHour": None}}, "spendUSD": 0.0, "judgeUSD": {}, "baseline": None, "final": None,
           "heldOut": []}
    drawn = render(run, tmp_path / "no-rate.png")
    assert drawn["panels"] == ["rewardMean", "solvedGroups", "noSignalGroups", "completionLength", "truncatedFraction",
                               "gradNorm", "tokenEntropy", "clipRatio"]
    assert png_size(tmp_path / "no-rate.png") == (1300, 1050)           # 2 + 2 + the clip ratio across: no empty box
    assert all(ax.has_data() for ax in drawn["figure"].axes)
    assert drawn["figure"].texts[0].get_text() == "no-rate: Succeeded at step 59 of 59; 1 attempt"


def test_a_run_with_tools_gets_a_panel_of_its_turns_per_episode_and_tool_errors(tmp_path):
    from grpo_run.runner.views.report import render

    steps = [{**s, "episodeTurns": 1.5 + s["step"] / 60, "toolCalls": 1.0, "toolErrorRate": 0.5 - s["step"] / 200}
             for s in synthetic_steps()]
    run = {"name": "tools", "phase": "Succeeded", "spec": {}, "params": {"maxSteps": 59}, "steps": steps,
           "attempts": [{"id": 1, "node": "n", "started": "2026-12-01T12:00:00+00:00",
                         "ended": "2026-12-01T12:01:00+00:00", "reason": "Succeeded", "notice": None, "from_step": 0,
                         "to_step": 59}],
           "ledger": {"1": {"seconds": 60.0, "usd": 0.0, "usdPerHour": None}}, "spendUSD": 0.0, "judgeUSD": {},
           "baseline": None, "final": None, "heldOut": []}
    drawn = render(run, tmp_path / "tools.png")
    assert drawn["panels"][-2:] == ["episodeTurns", "toolErrorRate"]
    panel = [ax for ax in drawn["figure"].axes if ax.get_title() == "turns per episode and tool errors"]
    assert panel and panel[0].get_ylabel() == "replies per episode"
    assert png_size(tmp_path / "tools.png") == (1300, 1050)


def test_the_summary_puts_the_baseline_and_final_answers_side_by_side_and_the_newest_step_s_groups(tmp_path):
    from grpo_run.runner.views.report import summary

    def group(step, item, text, reward, advantage=None):
        return {"step": step, "item": item, "prompt": f"{item}+1=", "solved": reward == 1.0, "completions": [
            {"text": text, "rewards": {"correct": reward}, "reward": reward, "advantage": advantage, "length": 2,
             "truncated": False}]}

    run = {"name": "job", "phase": "Succeeded", "params": {"maxSteps": 9}, "steps": [], "attempts": [],
           "ledger": {}, "spendUSD": 0.0, "judgeUSD": {}, "baseline": None, "final": None,
           "samples": {"baseline": [group(0, 0, "7", 0.0), group(0, 1, "", 0.0)],
                       "final": [group(9, 0, "1", 1.0), group(9, 1, "2|", 1.0)],
                       "step": [group(9, 0, "5", 1.0, 0.5)]}}
    md = summary(run)
    assert "| task 1 | `0+1=` | `7` | 0.000 | `1` | 1.000 |" in md
    assert "| task 2 | `1+1=` | (empty) | 0.000 | `2\\|` | 1.000 |" in md
    assert "## What the model wrote at step 9" in md and "| `5` | 1.000 | +0.50 |" in md
