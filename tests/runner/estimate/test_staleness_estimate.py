"""The dry run's step time and memory for an asynchronous run (spec.parameters.staleness): the
slower of sampling and the update plus the adapter's copy, and the producer's policy copies."""

from __future__ import annotations

from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.spec.job import parse_job
from tests.runner.spec.test_job import job


def estimated(staleness: int) -> dict:
    return estimate(parse_job(job(gpu="H100", parameters={"staleness": staleness, "maxSteps": 100})))


def test_an_asynchronous_step_takes_the_slower_of_sampling_and_the_update_plus_the_sync():
    sync, ahead = estimated(0)["stepModel"], estimated(1)["stepModel"]
    assert "syncSeconds" not in sync and ahead["overlapped"] is True
    assert sync["seconds"] == float(f"{sync['sampleSeconds'] + sync['updateSeconds']:.3g}") or \
        abs(sync["seconds"] - (sync["sampleSeconds"] + sync["updateSeconds"])) <= 0.01 * sync["seconds"]
    slower = max(ahead["sampleSeconds"], ahead["updateSeconds"])
    assert slower <= ahead["seconds"] <= slower + ahead["syncSeconds"] + 0.01 * slower
    assert ahead["seconds"] <= sync["seconds"]


def test_the_step_model_overlaps_only_an_asynchronous_run():
    from grpo_run.runner.estimate.steptime import StepTime

    assert StepTime(1.0, 0.5, 2.0).seconds == 3.0
    assert StepTime(1.0, 0.5, 2.0, sync_seconds=0.01).seconds == 2.02
    assert StepTime(0.25, 0.5, 1.0, sync_seconds=0.0).seconds == 0.5


def test_an_asynchronous_run_needs_the_producers_policy_copies_and_both_phases_memory_at_once():
    sync, ahead = estimated(0)["memory"], estimated(2)["memory"]
    assert "staleness" not in sync and ahead["staleness"] == 2 and ahead["policyCopiesGB"] >= 0
    assert ahead["neededGB"] >= sync["neededGB"]
    assert ahead["neededGB"] >= ahead["totalGB"] + ahead["samplingGB"] + ahead["updateGB"] - 0.05
