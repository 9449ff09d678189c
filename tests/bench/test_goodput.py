"""bench/goodput.py's pieces that decide its figures, without running a trainer: the seeded
preemption process (reproducible, exponential with the mean the rate says) and the readers of what
a node leaves behind (grpo-run's record, the TRL script's event lines)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from bench.goodput import NAME, PARTS, Node, Run, grpo_facts, lifetimes, parse_trl_lines


def _draws(seed: int, per_hour: float, scale: float, n: int) -> list[float]:
    schedule = lifetimes(seed, per_hour, scale)
    return [next(schedule) for _ in range(n)]


def test_a_seeded_schedule_is_the_same_every_time_and_another_seed_gives_another():
    assert _draws(3, 6, 10, 50) == _draws(3, 6, 10, 50)
    assert _draws(3, 6, 10, 50) != _draws(4, 6, 10, 50)


@pytest.mark.parametrize("per_hour, scale", [(2, 1), (6, 10), (20, 10)])
def test_the_intervals_are_exponential_with_a_mean_of_an_hour_over_the_rate_on_the_scaled_clock(per_hour, scale):
    draws = _draws(0, per_hour, scale, 20_000)
    mean = 3600 / (per_hour * scale)
    # 20 000 draws: the sample mean's standard error is 0.7% of the mean; an exponential's
    # median is its mean times ln 2, and its standard deviation equals its mean
    assert statistics.mean(draws) == pytest.approx(mean, rel=0.03)
    assert statistics.median(draws) == pytest.approx(mean * 0.6931, rel=0.04)
    assert statistics.stdev(draws) == pytest.approx(mean, rel=0.05)
    assert min(draws) > 0


def test_a_trl_nodes_lines_give_where_it_resumed_its_last_step_its_evaluations_and_its_parts():
    t0 = 1000.0
    lines = ["{'loss': 0.0, 'grad_norm': 0.1}",                # TRL's own log lines are not events
             json.dumps({"event": "imported", "t": t0 + 4.0}),
             json.dumps({"event": "model", "t": t0 + 5.5}),
             json.dumps({"event": "training", "t": t0 + 5.5}),
             "Could not estimate the number of tokens of the input",
             json.dumps({"event": "train_begin", "t": t0 + 6.0, "step": 20}),
             json.dumps({"event": "step", "t": t0 + 6.25, "step": 21}),
             json.dumps({"event": "step", "t": t0 + 6.5, "step": 22}),
             '{"event": "step", "t": 10']                         # cut off by the SIGKILL mid-line
    resumed, last, evals, parts = parse_trl_lines(lines, t0)
    assert (resumed, last, evals) == (20, 22, 0)
    assert tuple(parts) == PARTS["TRL"]
    assert parts == pytest.approx({"imports": 4.0, "model": 1.5, "baseline": 0.0, "restore": 0.5,
                                     "first step": 0.25})


def test_a_trl_node_stopped_before_its_first_step_has_no_parts_and_counts_its_evaluation():
    lines = [json.dumps({"event": "imported", "t": 1.0}), json.dumps({"event": "model", "t": 2.0}),
             json.dumps({"event": "eval", "t": 2.5, "kind": "baseline"})]
    assert parse_trl_lines(lines, 0.0) == (None, 0, 1, {})


def test_a_grpo_run_nodes_record_gives_where_it_resumed_its_last_step_and_its_parts(tmp_path):
    from grpo_run.state.record import Record

    spawned = time.time()
    path = tmp_path / "runs" / NAME / "state.db"
    path.parent.mkdir(parents=True)
    with Record(path) as record:
        record.start_attempt("node-a", from_step=0)
        for step in (1, 2, 3):
            record.log_step(step, {"stepSeconds": 0.1})
        record.start_attempt("node-b", from_step=2)          # this node's attempt: the newest
        for step in (3, 4):
            record.log_step(step, {"stepSeconds": 0.1})
        # the node's own clock (runner/supervisor/startup.py), as the supervisor records it
        clock = [("imports", 0.0, 0.8), ("job fetch", 0.8, 0.05), ("trainer imports", 0.9, 3.9), ("model fetch", 0.9, 3.9),
                 ("lease", 0.9, 0.02), ("checkpoint fetch", 0.95, 0.1), ("notice watchers", 0.9, 0.01),
                 ("model load", 4.8, 0.05), ("grader start", 4.85, 0.07), ("engine start", 4.92, 0.0),
                 ("waiting for the checkpoint", 4.92, 0.01), ("checkpoint load", 4.93, 0.01),
                 ("first step", 4.94, 0.03)]
        record.set_value("startup", {"attempt": 2, "totalSeconds": 4.97,
                                     "parts": [{"part": p, "startSeconds": at, "seconds": s} for p, at, s in clock]})
    resumed, last, parts, first_step = grpo_facts(tmp_path, spawned)
    assert (resumed, last) == (2, 4) and first_step >= 0
    assert set(parts) <= set(PARTS["grpo-run"])
    assert parts == pytest.approx({"imports": 4.7, "storage fetch": 0.17, "model fetch": 3.9, "model load": 0.05,
                                   "grader start": 0.07,
                                   "engine start": 0.0, "restore": 0.01, "first step": 0.03, "other": 0.02})


def test_a_grpo_run_node_noticed_while_restoring_did_not_train_its_predecessors_steps_again(tmp_path):
    # its copy of the record is storage's: the newest attempt and its steps are the node before's
    # (the 2026-12-07 run counted 82 steps twice this way)
    from grpo_run.state.record import Record

    path = tmp_path / "runs" / NAME / "state.db"
    path.parent.mkdir(parents=True)
    with Record(path) as record:
        record.start_attempt("node-a", from_step=10)
        for step in range(11, 93):
            record.log_step(step, {"stepSeconds": 0.1})
    assert grpo_facts(tmp_path, time.time() + 1.0) == (None, 0, {}, None)     # this node started after that attempt


def test_a_grpo_run_node_stopped_before_its_record_existed_reads_as_nothing_done(tmp_path):
    assert grpo_facts(tmp_path, time.time()) == (None, 0, {}, None)


def test_steps_twice_are_the_steps_all_nodes_completed_beyond_the_runs_own():
    # node 0 trains 0..23; node 1 is lost in its boot; node 2 is stopped before its restore; node 3
    # resumes from 20 (21..23 again) and is killed after 31; node 4 resumes from 30 (31 again)
    run = Run([Node(10, "noticed", 0, 23, 1), Node(1, "lost in boot"), Node(5, "noticed", None, 0, 0),
               Node(10, "killed", 20, 31, 0), Node(10, "finished", 30, 60, 1)], Path("."))
    assert run.steps_twice == (23 - 20) + (31 - 30)
    assert run.evals_rerun == 0 and run.paid == 36


def test_a_run_not_finished_within_its_nodes_counts_what_its_nodes_did():
    # each node resumes from 25 and is stopped before its next checkpoint: the livelock a restart
    # loop falls into when the notices come faster than save_steps steps
    run = Run([Node(20, "noticed", 0, 30, 1), Node(20, "noticed", 25, 32, 0), Node(20, "noticed", 25, 29, 0)], None)
    assert run.furthest == 32
    assert run.steps_twice == (30 + 7 + 4) - 32
    assert run.evals_rerun == 0


def test_a_trl_node_resumes_from_the_newest_checkpoint_whose_writing_finished(tmp_path):
    from bench.goodput import _newest_whole_checkpoint

    assert _newest_whole_checkpoint(tmp_path / "trl") is None                 # the first node
    for n, whole in ((870, True), (880, True), (1280, False), (99, True)):   # 1280: cut short by the notice
        folder = tmp_path / "trl" / f"checkpoint-{n}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"")
        if whole:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "trl" / "checkpoint-final-copy").mkdir()
    assert _newest_whole_checkpoint(tmp_path / "trl") == str(tmp_path / "trl" / "checkpoint-880")


def test_goodput_is_the_median_uninterrupted_time_over_each_finished_run_s_paid_time(monkeypatch):
    import bench.goodput as goodput

    reference = Run([Node(50, "finished", None, 100, 2)], Path("."))
    calm = Run([Node(46, "finished", None, 100, 2)], Path("."))         # met no notice: a second measure
    hit = Run([Node(30, "noticed", 0, 60, 1), Node(30, "finished", 60, 100, 1)], Path("."))
    assert goodput.untouched(reference) and goodput.untouched(calm) and not goodput.untouched(hit)
    monkeypatch.setattr(goodput, "same_adapter", lambda *a: True)
    figures = goodput.summarize([calm, hit], reference, "grpo-run", reference_seconds=48.0)
    assert figures["goodput"] == pytest.approx((48 / 46 + 48 / 60) / 2) and figures["referenceSeconds"] == 48.0
