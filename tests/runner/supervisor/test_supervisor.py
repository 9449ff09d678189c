"""Spot notices end a run with the last completed step durable in S3, fast; resume finishes it.

Each test runs `grpo-run apply` as a real process against a real S3 server (SeaweedFS) and a
local emulator of the cloud's metadata service, triggers the cloud's notice mid-training, and
then resumes on a fresh node.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import seed_home
from tests.campaign import full_campaign_only
from tests.emulators import AwsImdsEmulator, AzureScheduledEventsEmulator, GcpMetadataEmulator
from tests.faults.harness import fault_env, wait_until
from tests.runner.jobs.test_resume import grpo_run, status, write_job

REPO = Path(__file__).resolve().parents[3]
STEPS = 150
CLOUDS = {"aws": ("GRPO_RUN_AWS_METADATA_URL", AwsImdsEmulator),
          "gcp": ("GRPO_RUN_GCP_METADATA_URL", GcpMetadataEmulator),
          "azure": ("GRPO_RUN_AZURE_METADATA_URL", AzureScheduledEventsEmulator)}


def start_apply(home: Path, job: Path, **env_extra) -> subprocess.Popen:
    env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(home)), **env_extra}
    return subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_training(home: Path, proc: subprocess.Popen, min_step: int = 2, timeout: float = 120) -> None:
    """Until the node's record shows `min_step` completed steps (polled, bounded)."""
    from grpo_run.state.record import Record

    db = home / "runs" / "resumable" / "state.db"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if db.exists():
            with Record(db) as record:
                steps = record.steps()
            if steps and steps[-1]["step"] >= min_step:
                return
        time.sleep(0.05)
    raise AssertionError("training did not start in time")


def preempt_then_resume(tmp_path, storage, trigger, **env_extra):
    job = write_job(tmp_path, storage, maxSteps=STEPS, saveSteps=50)
    held = tmp_path / "held"        # the node holds in step 2's backward pass until it hears the notice
    proc = start_apply(tmp_path / "node-a", job, **fault_env("hold:backward@2", held), **env_extra)
    wait_until("the hold", held.exists, proc)
    noticed = time.monotonic()
    trigger(proc)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:          # seen once in a clean-clone run: say what the node was doing
        proc.kill()
        out, err = proc.communicate()
        trainer_log = tmp_path / "node-a" / "runs" / "resumable" / "logs" / "trainer.log"
        pytest.fail(f"the node did not exit within 60 s of the notice; its stderr ends:\n{err[-4000:]}\n"
                    f"the trainer's log ends:\n{trainer_log.read_text()[-2000:] if trainer_log.exists() else '-'}")
    exited = time.monotonic() - noticed
    assert proc.returncode == 3, err[-3000:]
    st = status(tmp_path / "node-x", storage)
    assert st["phase"] == "Preempted", f"storage's record says {st['phase']}; the node's stderr ends:\n{err[-4000:]}"
    durable = st["checkpoints"]["latestDurable"]
    lost = st["step"] - durable
    print(f"\nnotice -> durable: {st['lastNotice']['noticeToDurableSeconds']:.2f} s after the supervisor saw it; "
          f"process exited {exited:.2f} s after the trigger; completed steps lost: {lost}")
    assert lost == 0 and durable == 3          # step 2 (0-based) completes, then the node stops
    assert exited <= 25        # inside the shortest (GCP/Azure, ~30 s) notice window
    done = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", storage)
    final = status(tmp_path / "node-b", storage)
    assert final["phase"] == "Succeeded" and final["step"] == STEPS, done.stdout
    assert final["baseline"]["runs"] == 1                     # not re-run on the new node
    assert [a["reason"] for a in final["attempts"]] == ["Preempted", "Succeeded"]
    return st


# every cloud in every phase is tests/faults/test_notice_phases.py; here one on every edit, the others in CI
ONE_CLOUD_HERE = "CI runs AWS here; the notice matrix (tests/faults/test_notice_phases.py) runs every cloud"


@pytest.mark.parametrize("cloud", ["aws", pytest.param("gcp", marks=full_campaign_only(ONE_CLOUD_HERE)),
                                   pytest.param("azure", marks=full_campaign_only(ONE_CLOUD_HERE))])
def test_a_cloud_notice_checkpoints_durably_and_exits_preempted(tmp_path, s3_env, cloud):
    var, emulator_class = CLOUDS[cloud]
    with emulator_class() as emulator:
        st = preempt_then_resume(tmp_path, s3_env.url, lambda proc: emulator.trigger_preempt(),
                                 GRPO_RUN_NOTICES=cloud, **{var: emulator.url})
    assert st["lastNotice"]["source"] == cloud


def test_sigterm_to_the_supervisor_is_a_notice_too(tmp_path, s3_env):
    st = preempt_then_resume(tmp_path, s3_env.url, lambda proc: proc.send_signal(signal.SIGTERM),
                             GRPO_RUN_NOTICES="none")
    assert st["lastNotice"]["source"] == "signal"


def test_a_crashed_trainer_is_restarted_and_the_run_still_ends_byte_identical(tmp_path):
    from tests.runner.jobs.test_resume import exported_bytes

    reference = tmp_path / "reference"
    reference.mkdir()
    grpo_run(reference / "home", "apply", "-f", str(write_job(reference)))
    expected = exported_bytes(reference / "home", None, reference / "export")

    crashing = tmp_path / "crashing"
    crashing.mkdir()
    proc = grpo_run(crashing / "home", "apply", "-f", str(write_job(crashing)), fault="backward@5/trainer",
                    check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1 of 3 (crashes)" in proc.stderr
    assert exported_bytes(crashing / "home", None, crashing / "export") == expected


def test_two_nodes_resuming_one_job_at_once_never_both_train(tmp_path, s3_env):
    # long enough that node A is still training when node B's CLI has started (steps take ~30 ms)
    job = write_job(tmp_path, s3_env.url, maxSteps=1000, saveSteps=250)
    first = start_apply(tmp_path / "node-a", job, GRPO_RUN_NOTICES="none")
    wait_for_training(tmp_path / "node-a", first)
    second = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", s3_env.url, check=False)
    assert second.returncode == 5, second.stderr[-2000:]
    assert "held by" in second.stderr
    assert not (tmp_path / "node-b" / "runs" / "resumable" / "checkpoints").exists()   # trained nothing
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]


def with_spec(job: Path, **fields) -> Path:
    import yaml

    doc = yaml.safe_load(job.read_text())
    doc["spec"].update(fields)
    job.write_text(yaml.safe_dump(doc))
    return job


def test_an_aws_rebalance_recommendation_checkpoints_early_and_training_goes_on(tmp_path, s3_env):
    # Issued before the node boots (AWS often has one pending on a fresh spot node): the
    # supervisor sees it within its first poll, while the trainer is still importing torch, and
    # holds the SIGUSR1 until the trainer can take it (the signal's default action kills).
    with AwsImdsEmulator() as imds:
        imds.trigger_rebalance()
        job = with_spec(write_job(tmp_path, s3_env.url, maxSteps=STEPS, saveSteps=1000),
                        notices={"clouds": ["aws"], "awsMetadataURL": imds.url})   # a job field, not env
        proc = start_apply(tmp_path / "node-a", job)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restart" not in err
    st = status(tmp_path / "node-a", s3_env.url)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert [a["reason"] for a in st["attempts"]] == ["Succeeded"]
    # saveSteps 1000 would never checkpoint: the one checkpoint is the rebalance's, at the
    # first step boundary after the trainer started listening
    assert st["checkpoints"]["latest"] == 1


def test_max_cost_stops_the_run_with_a_durable_checkpoint(tmp_path, s3_env):
    job = with_spec(write_job(tmp_path, s3_env.url, maxSteps=100000, saveSteps=100000),
                    maxCostUSD=2.0, pricing={"usdPerHour": 360.0})      # $0.10 a second
    proc = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), check=False)
    assert proc.returncode == 4, proc.stderr[-3000:]
    st = status(tmp_path / "node-a", s3_env.url)
    assert st["phase"] == "BudgetExceeded" and "maxCostUSD" in st["message"]
    assert 0 < st["step"] < 100000
    assert st["checkpoints"]["latestDurable"] == st["step"]          # nothing completed is lost
    assert st["costUSD"] <= 2.0
    assert st["attempts"][-1]["reason"] == "BudgetExceeded"


@pytest.mark.trust
def test_a_step_whose_numbers_are_not_finite_fails_the_job_once_and_keeps_the_good_checkpoints(tmp_path, figures):
    """A reward whose weight carries the step's reward past float32 from the 4th step on: the
    step fails before anything is applied or sealed, the job ends Failed at once (restarting
    would replay the same step: no crash restarts, never a preemption), the record says which
    step and which number, and the checkpoints sealed before stay."""
    from grpo_run.state.record import Record

    job = write_job(tmp_path)
    # 3 baseline completions, then 8 per step: from the 28th call on, 1e6 (the bound) x 1e37 overflows float32
    (tmp_path / "late.py").write_text("calls = 0\n\ndef score(completion, task):\n    global calls\n"
                                      "    calls += 1\n    return 1e6 if calls > 27 else float(len(completion))\n")
    env = {"name": "late", "rewards": [{"function": "late.py:score", "weight": 1e37}],
           "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}
    with_spec(job, environment=env)
    proc = grpo_run(tmp_path / "home", "apply", "-f", str(job), check=False)

    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "restart" not in proc.stderr
    with Record(tmp_path / "home" / "runs" / "resumable" / "state.db") as record:
        job_row, attempts, ckpts, steps = record.job(), record.attempts(), record.checkpoints(), record.steps()
    assert job_row["phase"] == "Failed" and len(attempts) == 1
    assert "step 4: the weighted sum of a completion's rewards (in float32) is inf" in job_row["message"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [c["step"] for c in ckpts] == [2]
    figures.add("trust", actor='reward author', tried='a reward that a weight carries past float32 (inf) at step 4',
                protection='rewards, loss and gradient norm checked before the optimizer steps', outcome='job Failed once; steps 1-3 and checkpoint 2 kept', held=True)


def test_a_sigterm_the_kernel_hands_to_another_thread_still_stops_the_node(tmp_path, s3_env):
    """The kernel may deliver a process's SIGTERM to any of its threads; CPython then runs the
    handler only once the main thread runs Python again. A main thread asleep on an Event without
    a timeout would sleep through the notice until the trainer ended (seen: a clean-clone run whose
    node kept training 60 s after its SIGTERM). Here the signal goes to one of the supervisor's
    other threads on purpose (tgkill)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = 234 if os.uname().machine == "x86_64" else 131          # aarch64's number otherwise

    def takes_sigterm(pid: int, tid: int) -> bool:     # as the kernel chooses: a thread that does not block it
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # a short-lived thread ended since it was listed
            return False
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        return not blocked & (1 << (signal.SIGTERM - 1))

    def to_another_thread(proc: subprocess.Popen) -> None:
        others = [t for t in sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
                  if takes_sigterm(proc.pid, t)]
        assert others, "the supervisor runs threads beside its main one that take SIGTERM"
        name = Path(f"/proc/{proc.pid}/task/{others[-1]}/comm").read_text().strip()
        print(f"\nSIGTERM to thread {others[-1]} ({name}) of {len(others) + 1}")
        assert libc.syscall(tgkill, proc.pid, others[-1], signal.SIGTERM) == 0, ctypes.get_errno()

    st = preempt_then_resume(tmp_path, s3_env.url, to_another_thread, GRPO_RUN_NOTICES="none")
    assert st["lastNotice"]["source"] == "signal"
