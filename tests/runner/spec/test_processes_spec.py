"""spec.resources.processes: the job file's field, what a node makes of it, and the GPUs the
estimate and the cost ledger charge for."""

import pytest

from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.spec.hardware import node_processes
from grpo_run.runner.spec.job import JobError, parse_job
from grpo_run.runner.supervisor.runspec import build_run_spec, usd_per_hour
from tests.runner.jobs.test_dryrun import QWEN3_8B, SPEC_RUN, manifest, qwen3_8b  # noqa: F401 (a fixture)
from tests.faults.inject import grpo_run_faults as faults
from grpo_run.trainer.launch import exit_status, rank_environment
from grpo_run.trainer.protocol import CHILD_CODE_ERROR, CHILD_CRASHED, CHILD_STOPPED, SHARE_ENV


def test_processes_default_to_one_and_take_a_count_or_auto(tmp_path):
    assert node_processes(parse_job(manifest("tiny:char")).resources) == 1
    job = parse_job(manifest("tiny:char", resources={"processes": 4}))
    assert job.resources.processes == 4 and job.to_dict()["spec"]["resources"] == {"processes": 4}
    auto = parse_job(manifest("tiny:char", resources={"processes": "auto"}))
    assert node_processes(auto.resources) == 1          # no GPU on this node: one process


@pytest.mark.parametrize("bad", [0, -2, "2", True, 1.5, "all"])
def test_a_bad_process_count_is_named_with_the_fix(bad):
    with pytest.raises(JobError) as e:
        parse_job(manifest("tiny:char", resources={"processes": bad}))
    assert "spec.resources.processes: must be a whole number >= 1 or auto" in str(e.value)


def test_more_processes_than_prompts_per_step_is_refused_before_anything_starts():
    with pytest.raises(JobError) as e:
        parse_job(manifest("tiny:char", resources={"processes": 4}, parameters={"promptsPerStep": 2}))
    assert "spec.resources.processes: 4 processes need promptsPerStep >= 4 (got 2)" in str(e.value)


def test_the_cost_ledger_charges_every_gpu_of_the_node(tmp_path):
    job = parse_job(manifest("tiny:char", gpu="H100-SXM-80GB", resources={"processes": 8},
                             parameters={"promptsPerStep": 8}))
    assert usd_per_hour(job, 8) == pytest.approx(8 * 6.88)           # the H100's on-demand rate, 8 times
    spec = build_run_spec(job, str(tmp_path / "store"))
    assert spec.processes == 8 and spec.usd_per_hour == pytest.approx(8 * 6.88)
    own = parse_job(manifest("tiny:char", gpu="L40S", pricing={"usdPerHour": 1.5}, resources={"processes": 4},
                             parameters={"promptsPerStep": 8}))
    assert build_run_spec(own, str(tmp_path / "store")).usd_per_hour == pytest.approx(6.0)   # a rate per GPU


def test_the_cost_ledger_charges_the_whole_instance_a_job_rents_as_the_estimate_does(qwen3_8b):  # noqa: F811
    # AWS rents A100s in eights and H100s in ones or eights: a 1-GPU A100 job or a 2-GPU H100 job
    # pays for the whole p4d.24xlarge or p5.48xlarge, and maxCostUSD must count what is billed
    a100 = parse_job(manifest(qwen3_8b, gpu="A100", parameters=SPEC_RUN))
    h100 = parse_job(manifest(qwen3_8b, gpu="H100", resources={"processes": 2}, parameters=SPEC_RUN))
    for job, gpus, whole in ((a100, 1, 21.957642), (h100, 2, 55.04)):
        est = estimate(job)
        assert usd_per_hour(job, gpus) == pytest.approx(whole) == est["usdPerHour"]
        assert est["rate"]["wholeInstances"] is True and "the whole" in est["rate"]["source"]
    own = parse_job(manifest(qwen3_8b, gpu="A100", pricing={"usdPerHour": 1.5}, parameters=SPEC_RUN))
    assert usd_per_hour(own, 1) == estimate(own)["usdPerHour"] == 1.5           # a GPU rented alone elsewhere


def test_the_dry_run_estimate_counts_every_gpu(qwen3_8b):  # noqa: F811
    one = estimate(parse_job(manifest(qwen3_8b, parameters=SPEC_RUN)))
    four = estimate(parse_job(manifest(qwen3_8b, parameters=SPEC_RUN, resources={"processes": 4})))
    assert (one["gpus"], four["gpus"]) == (1, 4)
    # AWS rents H100s one or eight at a time: four rent the whole p5.48xlarge, 8 x the 1-GPU rate
    assert four["usdPerHour"] == pytest.approx(8 * one["usdPerHour"]) and four["rate"]["wholeInstances"]
    # each GPU samples and updates its 2 of the 8 prompts (the model of a step, issue 25), at 4 x the rate
    assert four["stepSeconds"] < one["stepSeconds"]
    assert four["trainingUSD"] == round(1000 * four["stepSeconds"] * four["usdPerHour"] / 3600, 2)
    assert four["memory"]["samplingGB"] < one["memory"]["samplingGB"]    # each GPU samples 2 of the 8 prompts
    assert "4 processes, one per GPU" in four["note"]


def test_a_run_ends_as_its_ranks_did():
    assert exit_status({1: CHILD_STOPPED}) == CHILD_STOPPED
    assert exit_status({0: CHILD_STOPPED, 1: CHILD_STOPPED}) == CHILD_STOPPED
    assert exit_status({1: CHILD_CODE_ERROR, 0: CHILD_CRASHED}) == CHILD_CODE_ERROR   # the reward function's error
    assert exit_status({1: -9}) == CHILD_CRASHED                                      # a rank killed
    assert exit_status({0: CHILD_STOPPED, 1: -9}) == CHILD_CRASHED
    # the agent's SIGTERM caught rank 0 on its way out, after rank 1 had ended as stopped
    assert exit_status({1: CHILD_STOPPED, 0: -15}) == CHILD_STOPPED
    assert exit_status({0: -15}) == CHILD_CRASHED


def test_the_ranks_split_a_first_attempts_thread_pool_and_keep_a_later_ones_count():
    env = {"GRPO_RUN_EVENTS_FD": "7", SHARE_ENV: "15", "OMP_NUM_THREADS": "15"}
    first = rank_environment(env, 2, launcher_pid=100, supervisor_pid=99)
    assert first["OMP_NUM_THREADS"] == "7" and SHARE_ENV not in first
    assert first["GRPO_RUN_EVENTS_PATH"] == "/proc/100/fd/7" and first["GRPO_RUN_PARENT_PID"] == "100"
    later = rank_environment({"GRPO_RUN_EVENTS_FD": "7", "OMP_NUM_THREADS": "7"}, 2, 100, 99)
    assert later["OMP_NUM_THREADS"] == "7"                 # the count the run's first trainers took


def test_a_fault_can_name_one_rank(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "backward@3/rank1")
    fault = faults.wanted()
    assert (fault.point, fault.step, fault.rank, fault.trainer_only) == ("backward", 3, 1, True)
    monkeypatch.setenv(faults.FAULT_ENV, "backward@3/rankx")
    with pytest.raises(ValueError):
        faults.wanted()


def test_a_node_runs_at_most_one_process_per_gpu(monkeypatch, tmp_path):
    import grpo_run.runner.spec.hardware as hardware

    monkeypatch.setattr(hardware, "node_gpus", lambda: 2)
    auto = parse_job(manifest("tiny:char", resources={"processes": "auto"}))
    assert build_run_spec(auto, str(tmp_path / "store")).processes == 2
    with pytest.raises(JobError) as e:
        build_run_spec(parse_job(manifest("tiny:char", resources={"processes": 4})), str(tmp_path / "store"))
    assert "4 processes, one per GPU, but this node has 2 GPUs" in str(e.value)
