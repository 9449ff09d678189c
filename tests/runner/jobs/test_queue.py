"""A node that serves a queue (`grpo-run resume --storage URI --all`): every unfinished job under
the prefix, one after another, each one no other node holds; the node goes on past a job that
fails, stops at a notice, and ends when nothing is left, having made sure a held job's holder is
alive. The policy is tested with a stand-in for training (jobs submitted for real, their records
set by hand); the slow test at the end trains three real jobs on two nodes over S3."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from grpo_run.checkpoint.storage.lease import Lease
from grpo_run.checkpoint.storage.store import StorageUnavailable, Store
from grpo_run.runner.cli.commands import main
from grpo_run.runner.exits import EXIT_BUDGET, EXIT_CANCELLED, EXIT_FAILED, EXIT_HELD, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from grpo_run.runner.jobs.queue import Queue
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE, Record
from tests.tiny_models import seed_home
from tests.runner.jobs.test_resume import REPO, write_job


def submit(storage: Path, name: str) -> None:
    """`apply --detach` of a catalog job named `name` (nothing to upload but its record)."""
    from grpo_run.runner.spec.job import parse_job
    from grpo_run.runner.jobs.submit import submit as submit_job

    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"}, "storage": str(storage)}}
    submit_job(parse_job(doc, source=name), f"{storage}/{name}", holder="test-laptop")


def move(storage: Path, name: str, *phases: Phase, attempt: bool = False) -> None:
    """Storage's record of `name` moved through `phases` (with an attempt when `attempt`), as
    nodes would have moved it."""
    store = Store(f"{storage}/{name}")
    local = storage.parent / f"{name}.db"
    store.get_file(RECORD_FILE, local)
    with Record(local) as record:
        if attempt:
            record.start_attempt("test-node")
        for phase in phases:
            record.set_phase(phase)
    store.put_file(local, RECORD_FILE)


class Served:
    """A queue served in a thread by a stand-in that trains nothing: `codes` says what each job's
    run returns (EXIT_OK unless named), `during` what happens while it runs."""

    def __init__(self, storage: Path, codes: dict | None = None, during=None, *, wait: bool = False,
                 poll_s: float = 0.05) -> None:
        self.runs: list[str] = []
        self.done_elsewhere: set[str] = set()      # jobs another node finished before this run got their lease
        self.lines: list[str] = []
        self.codes, self.during = codes or {}, during or {}
        self.stop = threading.Event()
        self.queue = Queue(str(storage), run=self.run, stop=self.stop, wait=wait, poll_s=poll_s,
                           say=self.lines.append, warn=lambda line: self.lines.append(f"warn: {line}"))

    def run(self, job, store) -> int:
        self.runs.append(job.name)
        if job.name in self.during:
            self.during[job.name]()
        code = self.codes.get(job.name, EXIT_OK)
        code = code.pop(0) if isinstance(code, list) else code
        if code != EXIT_HELD and job.name not in self.done_elsewhere:    # it trained here: an attempt in storage
            move(Path(self.queue.storage), job.name, attempt=True)
        return code

    def serve(self, timeout_s: float = 60.0) -> int:
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(self.queue.serve()), daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self.stop.set()                  # end it, then fail: the queue would have gone on forever
            thread.join(10)
            pytest.fail(f"the queue did not end within {timeout_s} s; it ran {self.runs}; said {self.lines}")
        return result[0]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def test_every_unfinished_job_runs_once_and_finished_ones_are_skipped(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a-pending", "b-failed", "c-budget", "d-preempted", "e-succeeded", "f-cancelled"):
        submit(storage, name)
    move(storage, "b-failed", Phase.FAILED)
    move(storage, "c-budget", Phase.BUDGET_EXCEEDED)
    move(storage, "d-preempted", Phase.TRAINING, Phase.PREEMPTED)
    move(storage, "e-succeeded", Phase.TRAINING, Phase.FINAL_EVAL, Phase.SUCCEEDED)
    move(storage, "f-cancelled", Phase.CANCELLED)

    node = Served(storage)
    assert node.serve() == EXIT_OK
    assert node.runs == ["a-pending", "d-preempted"]        # each once, though the stand-in changes no phase
    assert "b-failed: Failed; skipped" in node.text and "grpo-run resume b-failed --storage" in node.text
    # a reward's fault is mended by the fixed job file, not by replaying the stored one (issue 38, 3)
    assert "applying the fixed job file again (`grpo-run apply -f JOB --detach`" in node.text
    assert "c-budget: BudgetExceeded; skipped" in node.text and "e-succeeded: Succeeded; skipped" in node.text
    assert "f-cancelled: Cancelled; skipped: it was cancelled" in node.text
    assert node.lines[-1].endswith("nothing left for this node: 2 succeeded here (a-pending, d-preempted)")


def test_a_job_that_does_not_succeed_is_reported_and_the_next_one_runs(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a", "b", "c"):
        submit(storage, name)
    node = Served(storage, codes={"a": EXIT_FAILED, "b": EXIT_BUDGET})
    assert node.serve() == EXIT_FAILED                      # the exit status says one did not succeed
    assert node.runs == ["a", "b", "c"]                     # not again: its record may not say Failed
    assert "a failed; going on with the next job" in node.text
    assert node.lines[-1].endswith("1 succeeded here (c); 2 did not succeed (a: failed, b: stopped at its maxCostUSD)")


def test_a_job_cancelled_while_it_runs_here_is_no_failure_of_the_node(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a", "b"):
        submit(storage, name)
    node = Served(storage, codes={"a": EXIT_CANCELLED})
    assert node.serve() == EXIT_OK
    assert node.runs == ["a", "b"] and "a was cancelled; going on with the next job" in node.text
    assert node.lines[-1].endswith("nothing left for this node: 1 succeeded here (b)")


def test_a_preempted_job_stops_the_node_before_the_next_starts(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a", "b"):
        submit(storage, name)
    node = Served(storage, codes={"a": EXIT_PREEMPTED})
    assert node.serve() == EXIT_PREEMPTED
    assert node.runs == ["a"]
    assert "stopped by a notice; no other job is started here" in node.lines[-1]


def test_a_job_another_node_took_first_is_looked_at_again_not_counted(tmp_path):
    storage = tmp_path / "bucket"
    submit(storage, "a")
    node = Served(storage, codes={"a": [EXIT_HELD, EXIT_OK]})    # the lease went to another node, which then let go
    assert node.serve() == EXIT_OK
    assert node.runs == ["a", "a"]
    assert node.lines[-1].endswith("1 succeeded here (a)")


def test_a_job_another_node_finished_before_its_run_here_is_not_counted_as_succeeded_here(tmp_path):
    """Seen with two real nodes: one looked at a job in FinalEval while the other finished it; its
    run then found it succeeded ('nothing to do', exit 0) and the node claimed it in its tally."""
    storage = tmp_path / "bucket"
    for name in ("a-here", "b-elsewhere"):
        submit(storage, name)
    node = Served(storage)
    node.done_elsewhere.add("b-elsewhere")
    assert node.serve() == EXIT_OK
    assert "b-elsewhere succeeded on another node meanwhile" in node.text
    assert "1 succeeded here (a-here)" in node.text, node.text


def test_a_job_submitted_while_the_node_trains_is_served_too(tmp_path):
    storage = tmp_path / "bucket"
    submit(storage, "b")
    node = Served(storage, during={"b": lambda: submit(storage, "a-late")})
    assert node.serve() == EXIT_OK
    assert node.runs == ["b", "a-late"]


def test_a_job_deleted_and_submitted_again_under_its_name_is_a_new_job(tmp_path):
    storage = tmp_path / "bucket"
    submit(storage, "a")

    def start_over():
        if node.runs.count("a") == 1:
            shutil.rmtree(storage / "a")
            time.sleep(0.01)                                # a new record: created a moment later
            submit(storage, "a")

    node = Served(storage, codes={"a": EXIT_FAILED}, during={"a": start_over})
    assert node.serve() == EXIT_FAILED
    assert node.runs == ["a", "a"]


def test_a_job_another_node_holds_is_skipped_and_the_node_ends_once_it_sees_that_node_renew(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a-held", "b"):
        submit(storage, name)
    lease = Lease(f"{storage}/a-held", holder="node-b", ttl_s=3.0, renew_every_s=0.3)
    lease.acquire()
    lease.start_renewing(on_lost=lambda lost: None)
    try:
        node = Served(storage)
        assert node.serve(timeout_s=30) == EXIT_OK
    finally:
        lease.release()
    assert node.runs == ["b"]
    assert "a-held: held by node-b" in node.text and "skipped (that node trains it)" in node.text
    assert node.lines[-1].endswith("1 succeeded here (b); held by other nodes: a-held")


def test_a_job_whose_holder_died_is_taken_over_before_the_node_ends(tmp_path):
    storage = tmp_path / "bucket"
    for name in ("a-orphan", "b"):
        submit(storage, name)
    dead = Lease(f"{storage}/a-orphan", holder="node-b", ttl_s=1.5, renew_every_s=0.5)
    dead.acquire()                                          # and never renewed nor released: the node died
    node = Served(storage)
    started = time.monotonic()
    assert node.serve(timeout_s=30) == EXIT_OK
    assert node.runs == ["b", "a-orphan"]                   # after its lease ran out, not before
    assert time.monotonic() - started >= 1.0


def test_a_stored_job_that_cannot_be_read_is_reported_and_the_others_run(tmp_path):
    storage = tmp_path / "bucket"
    submit(storage, "a")
    shutil.copytree(storage / "a", storage / "b-copy")      # a record copied under another job's name
    node = Served(storage)
    assert node.serve() == EXIT_FAILED
    assert node.runs == ["a"]
    assert "says its name is 'a', not 'b-copy'" in node.text
    assert node.lines[-1].endswith("1 did not succeed (b-copy: could not be read from storage)")


def test_storage_that_does_not_answer_ends_a_node_or_is_waited_out(tmp_path, monkeypatch):
    import grpo_run.runner.jobs.find as jobs

    storage = tmp_path / "bucket"
    submit(storage, "a")
    listed = jobs.jobs_in
    calls = []

    def down_at_first(url):
        calls.append(url)
        if len(calls) == 1:
            raise StorageUnavailable("storage at bucket did not answer (3 attempts)")
        return listed(url)

    monkeypatch.setattr(jobs, "jobs_in", down_at_first)
    once = Served(storage)
    assert once.serve() == EXIT_FAILED and once.runs == []
    assert once.lines == ["warn: storage at bucket did not answer (3 attempts)"]

    calls.clear()
    waiting = Served(storage, wait=True, during={"a": lambda: waiting.stop.set()})   # a notice while it trains
    assert waiting.serve() == EXIT_PREEMPTED
    assert waiting.runs == ["a"]
    assert "did not answer (3 attempts); asking again every 0.05 s" in waiting.lines[0]


def test_a_waiting_node_keeps_polling_until_a_job_comes(tmp_path):
    storage = tmp_path / "bucket"
    node = Served(storage, wait=True, during={"late": lambda: node.stop.set()})
    threading.Timer(0.5, submit, (storage, "late")).start()
    assert node.serve() == EXIT_PREEMPTED
    assert node.runs == ["late"]
    assert "waiting for jobs" in node.lines[0]


@pytest.mark.parametrize("extra, says", [(["resumable"], "give NAME or --all, not both"),
                                         (["-o", "yaml"], "-o prints one job")])
def test_all_with_a_name_or_an_output_format_is_a_usage_error(tmp_path, capsys, extra, says):
    storage = tmp_path / "bucket"
    submit(storage, "resumable")
    assert main(["resume", "--storage", str(storage), "--all", *extra]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert says in err and len(err.strip().splitlines()) == 1 and out == ""
    assert not (Path(os.environ["GRPO_RUN_HOME"]) / "runs").exists()         # nothing started


def test_a_bucket_the_node_cannot_use_is_one_line_and_exit_1(s3_env, capsys):
    assert main(["resume", "--storage", f"s3://no-such-bucket-{s3_env.bucket}/grpo", "--all"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "no-such-bucket" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_several_jobs_without_a_name_points_at_all(tmp_path, capsys):
    storage = tmp_path / "bucket"
    for name in ("a", "b"):
        submit(storage, name)
    assert main(["resume", "--storage", str(storage)]) == EXIT_USAGE
    assert f"grpo-run resume --storage {storage} --all" in capsys.readouterr().err


def test_sigterm_stops_a_waiting_node_with_exit_3(tmp_path):
    env = {**os.environ, "GRPO_RUN_HOME": str(tmp_path / "node"), "GRPO_RUN_WAIT_POLL_S": "0.2"}
    node = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "resume", "--storage",
                             str(tmp_path / "bucket"), "--all", "--wait"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "waiting for jobs" in node.stdout.readline()
        node.send_signal(signal.SIGTERM)                   # the node's shutdown, between jobs
        out, err = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
    assert node.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "stopped by a notice; no other job is started here" in out


# --- two nodes, three real jobs ------------------------------------------------------------------

@pytest.mark.slow
def test_two_nodes_drain_three_jobs_each_trained_by_exactly_one(tmp_path, s3_env, capsys, monkeypatch):
    names = ["sweep-a", "sweep-b", "sweep-c"]
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "laptop"))
    for name in names:                                      # a laptop submits a sweep of three tiny jobs
        folder = tmp_path / name
        folder.mkdir()
        job = write_job(folder, s3_env.url, maxSteps=2, saveSteps=2)
        doc = yaml.safe_load(job.read_text())
        doc["metadata"]["name"] = name
        job.write_text(yaml.safe_dump(doc))
        assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK

    started = time.monotonic()
    nodes = {}
    for node in ("node-1", "node-2"):                       # two nodes, each with its own disk
        env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(tmp_path / node)), "GRPO_RUN_WAIT_POLL_S": "0.5"}
        nodes[node] = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "resume", "--storage", s3_env.url,
                                        "--all"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    ended = {node: proc.communicate(timeout=600) for node, proc in nodes.items()}
    print(f"both nodes ended {time.monotonic() - started:.1f} s after they started")
    for node, proc in nodes.items():
        assert proc.returncode == 0, f"{node}:\n{ended[node][0][-2000:]}\n{ended[node][1][-3000:]}"

    trained_by = {}
    for name in names:
        capsys.readouterr()
        assert main(["get", "tj", name, "--storage", s3_env.url, "-o", "json"]) == EXIT_OK
        status = json.loads(capsys.readouterr().out)["status"]
        assert status["phase"] == "Succeeded" and status["step"] == 2, (name, status)
        assert [a["reason"] for a in status["attempts"]] == ["Succeeded"], (name, status["attempts"])   # one attempt
        # the node that trained it is the one whose disk holds its record (a node that lost the
        # race for a job never got as far as its books)
        trained_by[name] = [node for node in nodes if (tmp_path / node / "runs" / name / RECORD_FILE).exists()]
    print("trained by:", trained_by)
    assert all(len(by) == 1 for by in trained_by.values()), trained_by
    assert {by[0] for by in trained_by.values()} == set(nodes)          # both nodes took a share
    for node in nodes:                                      # and each says so in its closing line
        mine = sorted(name for name, by in trained_by.items() if by == [node])
        assert f"{len(mine)} succeeded here ({', '.join(mine)})" in ended[node][0], ended[node][0][-2000:]


def test_a_judge_job_on_a_node_that_does_not_allow_judges_is_left_for_one_that_does(tmp_path, monkeypatch):
    """Not this node's to train, not a failure: it stays Pending, said once, and the node's exit
    status is its other jobs'; a node that allows judges serves it."""
    from grpo_run.runner.spec.job import parse_job
    from grpo_run.runner.jobs.submit import submit as submit_job

    storage = tmp_path / "bucket"
    submit(storage, "a-plain")
    judge = {"url": "http://127.0.0.1:9/v1", "model": "m", "prompt": "Rate {completion}"}
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "b-judged"},
           "spec": {"model": "tiny:char", "storage": str(storage), "environment": {
               "name": "arithmetic", "rewards": [{"judge": judge, "name": "quality"}]}}}
    monkeypatch.delenv("GRPO_RUN_ALLOW_JUDGES", raising=False)
    submit_job(parse_job(doc, source="b-judged"), f"{storage}/b-judged", holder="test-laptop")

    node = Served(storage)
    assert node.serve() == EXIT_OK
    assert node.runs == ["a-plain"]
    assert node.text.count("b-judged: Pending; skipped: spec.environment.rewards.0.judge: this node does not allow "
                           "LLM judges") == 1
    assert node.lines[-1].endswith("1 succeeded here (a-plain); left for nodes that allow LLM judges: b-judged")
    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    other = Served(storage)
    assert other.serve() == EXIT_OK and "b-judged" in other.runs


@pytest.mark.slow
def test_a_job_that_keeps_killing_its_node_is_failed_with_the_reason_and_the_jobs_behind_it_run(tmp_path, capsys,
                                                                                                monkeypatch):
    """A poison job: every node that picks it dies without a word (here SIGKILL of the whole node
    during its baseline, as the OOM killer or a hang's kill would), before any checkpoint. Queue
    nodes serve jobs in name order, so each replacement would pick it again and the job behind it
    would never run. After LOST_WITHOUT_PROGRESS such attempts without a completed step the next
    node fails it, naming why, and trains the next job."""
    from grpo_run.runner.supervisor.supervisor import LOST_WITHOUT_PROGRESS
    from tests.faults.harness import fault_env

    storage = tmp_path / "bucket"
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "laptop"))
    for name in ("a-poison", "b-behind"):
        folder = tmp_path / name
        folder.mkdir()
        job = write_job(folder, str(storage), maxSteps=2, saveSteps=2)
        doc = yaml.safe_load(job.read_text())
        doc["metadata"]["name"] = name
        job.write_text(yaml.safe_dump(doc))
        assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK

    def node(name: str, fault: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(tmp_path / name))}
        env.pop("GRPO_RUN_FAULT", None)
        if fault:
            env.update(fault_env(fault, tmp_path / f"{name}.fault-fired", env))
        return subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "resume", "--storage", str(storage), "--all"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    for i in range(LOST_WITHOUT_PROGRESS):
        died = node(f"node-{i}", fault="baseline@0")      # the job takes its node down, before any checkpoint
        assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
        (storage / "a-poison" / "lease.json").unlink()     # the dead node's lease, run out (60 s) at once
    assert not (storage / "b-behind" / "checkpoints").exists()   # nothing behind it ran so far

    served = node("node-next")
    assert served.returncode == EXIT_FAILED, served.stderr[-3000:]        # one job did not succeed: the poison
    statuses = {}
    for name in ("a-poison", "b-behind"):
        capsys.readouterr()
        assert main(["get", "tj", name, "--storage", str(storage), "-o", "json"]) == EXIT_OK
        statuses[name] = json.loads(capsys.readouterr().out)["status"]
    poison, behind = statuses["a-poison"], statuses["b-behind"]
    assert behind["phase"] == "Succeeded" and behind["step"] == 2
    assert poison["phase"] == "Failed" and poison["step"] == 0
    assert [a["reason"] for a in poison["attempts"]] == ["Crashed"] * LOST_WITHOUT_PROGRESS + ["Failed"]
    assert (f"the last {LOST_WITHOUT_PROGRESS} attempts each lost their node without a word (killed, out of memory, "
            f"or hung until stopped), all from step 0 before completing a step") in poison["attempts"][-1]["message"]
    assert "Traceback" not in served.stderr
