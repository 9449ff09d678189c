"""The trainer's process reports its phases, and the supervisor records each as the record's own."""

from __future__ import annotations

from grpo_run.runner.supervisor.attempt import RECORD_PHASE
from grpo_run.state.phases import Phase
from grpo_run.trainer.protocol import TrainerPhase


def test_every_phase_the_trainer_reports_is_recorded_as_the_phase_of_the_same_name():
    # The trainer cannot import state (STYLE: arrows point down), so the supervisor maps each of
    # its phases explicitly; a phase missing from the map would fail on the trainer's first report.
    assert {p: RECORD_PHASE[p] for p in TrainerPhase} == {
        TrainerPhase.BASELINE_EVAL: Phase.BASELINE_EVAL, TrainerPhase.TRAINING: Phase.TRAINING,
        TrainerPhase.FINAL_EVAL: Phase.FINAL_EVAL}
    assert all(RECORD_PHASE[p].value == p.value for p in TrainerPhase)


def test_every_event_the_trainer_sends_reads_back_as_the_same_event():
    import io

    from grpo_run.trainer import protocol as p

    sent = [p.Started(step=4, device="cpu", microBatchSize=8, cpuThreads=2),
            p.PhaseStarted(phase=TrainerPhase.TRAINING),
            p.EvalBatch(kind="baseline", batch=1, rewards={"correct": [1.0, 0.0]}),
            p.Evaluated(kind="final", result={"meanReward": 0.5, "tasks": 2, "solved": 1}, noSignal=False),
            p.Step(step=5, metrics={"loss": float("nan"), "rewardMean": 0.25}),
            p.HeldOut(step=5, result={"meanReward": 0.5, "tasks": 2, "solved": 1, "rewards": {"correct": 0.5}}),
            p.Sealed(step=5, path="/w/checkpoints/ckpt-5"), p.Final(step=6, path="/w/final"),
            p.Stopped(step=None, phase=TrainerPhase.BASELINE_EVAL, reason="requested"),
            p.Failed(message="disk", code=False, diskFull=True)]
    stream = io.StringIO()
    events = p.Events(stream)
    for event in sent:
        events.emit(event)
    got = [p.parse_event(line) for line in stream.getvalue().splitlines()]
    assert [type(e) for e in got] == [type(e) for e in sent]
    assert got[:4] + got[5:] == sent[:4] + sent[5:]        # the step's NaN is never equal to itself
    assert got[4].step == 5 and got[4].metrics["rewardMean"] == 0.25 and got[4].metrics["loss"] != 0.0   # NaN
    # ranks other than 0 report their failure only
    quiet = io.StringIO()
    p.Events(quiet, only=(p.Failed,)).emit(sent[0])
    assert quiet.getvalue() == ""


def test_a_plan_reads_back_as_the_plan_written():
    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.envs.catalog import catalog_environment
    from grpo_run.trainer.protocol import Budget, Plan

    env = catalog_environment("arithmetic", seed=0)
    plan = Plan(name="j", model="m", env=env, params=GRPOParams.model_validate({"stopStrings": ["\n"]}),
                eval_done={"baseline": {0: {"correct": [1.0, 0.0]}}}, budget=Budget(usd_left=0.5, usd_per_hour=3.6, since=12.5), run_id="r", judge_usd={"j": 0.25})
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.eval_done["baseline"][0] == {"correct": [1.0, 0.0]}
