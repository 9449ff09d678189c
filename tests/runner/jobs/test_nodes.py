"""One job on two "nodes" on 127.0.0.1: two `grpo-run resume` processes with --nnodes 2, ranks 0 and
1, one trainer process each, each with its own home (local disk), sharing the job's storage
folder. Rank 0's node holds the lease, writes the record and the checkpoints; rank 1's writes
nothing. A run completes; a notice on rank 1 stops both at the same step; a SIGKILL of rank 1's
whole process tree makes rank 0's node exit within a bound; each is followed by a resume of both
nodes that ends byte-identical to the uninterrupted two-node run. Bad input is refused before
anything is taken."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.tiny_models import seed_home
from tests.once import once
from tests.runner.supervisor.test_processes import write_job
from tests.runner.jobs.test_resume import REPO, exported_bytes, grpo_run, status

STEPS, SAVE = 120, 4
NODES_SECRET = "the-two-nodes-secret"    # what each node's launcher gives it (trainer.distributed.admit)
LOST_BOUND_S = 60.0      # rank 1's node killed -> rank 0's node exits: the agent's monitor and 30 s shutdown, slack


def two_node_job(folder: Path, storage: Path, nodes: int = 2) -> Path:
    path = write_job(folder, 1, str(storage), maxSteps=STEPS, saveSteps=SAVE)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["nodes"] = nodes
    path.write_text(yaml.safe_dump(doc))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(home: Path, rank: int, storage: Path, port: int, **env) -> subprocess.Popen:
    """`grpo-run resume resumable` as node `rank` of 2, its output in HOME.out."""
    full = {**os.environ, "GRPO_RUN_HOME": str(seed_home(home)), "GRPO_RUN_NOTICES": "none", "OMP_NUM_THREADS": "1",
            "GRPO_RUN_NODES_SECRET": NODES_SECRET, **env}
    full.pop("GRPO_RUN_FAULT", None)
    return subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage",
                             str(storage), "--nnodes", "2", "--node-rank", str(rank), "--master", f"127.0.0.1:{port}"],
                            cwd=REPO, env=full, stdout=open(f"{home}.out", "a"), stderr=subprocess.STDOUT)


def both(folder: Path, storage: Path, tag: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = free_port()
    return node(folder / f"{tag}-0", 0, storage, port), node(folder / f"{tag}-1", 1, storage, port)


def output(folder: Path, name: str) -> str:
    return (folder / f"{name}.out").read_text()


def wait_both(a: subprocess.Popen, b: subprocess.Popen, folder: Path, tag: str) -> tuple[int, int]:
    try:
        return a.wait(timeout=240), b.wait(timeout=240)
    except subprocess.TimeoutExpired:
        a.kill(), b.kill()
        pytest.fail(f"the nodes did not end:\n{output(folder, f'{tag}-0')[-3000:]}\n{output(folder, f'{tag}-1')[-3000:]}")


def submitted(folder: Path) -> Path:
    storage = folder / "store"
    grpo_run(folder / "submit", "apply", "-f", str(two_node_job(folder, storage)), "--detach")
    return storage


def trained_steps(home: Path) -> int:
    import sqlite3

    db = home / "runs" / "resumable" / "state.db"
    if not db.exists():
        return 0
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        con.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The uninterrupted two-node run: its nodes' exit statuses and words, what rank 1's node kept,
    and the exported adapter."""
    def build(folder: Path) -> dict:
        storage = submitted(folder)
        a, b = both(folder, storage, "ref")
        codes = wait_both(a, b, folder, "ref")
        return {"codes": codes, "said": [output(folder, "ref-0"), output(folder, "ref-1")],
                "rank1 files": sorted(p.name for p in (folder / "ref-1" / "runs" / "resumable").iterdir()),
                "status": status(folder / "reader", str(storage)),
                "export": exported_bytes(folder / "reader", str(storage), folder / "export") if codes == (0, 0) else {}}

    return once(tmp_path_factory, "two-nodes-reference", build)


@pytest.fixture(scope="module")
def reference(uninterrupted) -> dict[str, bytes]:
    """The uninterrupted two-node run's exported adapter."""
    assert uninterrupted["codes"] == (0, 0), uninterrupted["said"][0][-3000:] + uninterrupted["said"][1][-3000:]
    return uninterrupted["export"]


def training(folder: Path) -> tuple[Path, subprocess.Popen, subprocess.Popen]:
    """The job submitted, both nodes started ("first-0", "first-1"), once rank 0's record has 10 steps."""
    storage = submitted(folder)
    a, b = both(folder, storage, "first")
    deadline = time.monotonic() + 180
    while trained_steps(folder / "first-0") < 10 and time.monotonic() < deadline and a.poll() is None:
        time.sleep(0.1)
    assert a.poll() is None, output(folder, "first-0")[-3000:]
    return storage, a, b


def resume_and_compare(folder: Path, storage: Path, reference: dict[str, bytes]) -> None:
    a, b = both(folder, storage, "again")
    assert wait_both(a, b, folder, "again") == (0, 0), output(folder, "again-0")[-3000:]
    assert status(folder / "reader", str(storage))["phase"] == "Succeeded"
    assert exported_bytes(folder / "reader", str(storage), folder / "export") == reference


@pytest.mark.slow
def test_a_two_node_run_trains_on_both_and_rank_0_alone_writes(uninterrupted, reference):
    assert uninterrupted["status"]["phase"] == "Succeeded"
    assert set(reference) >= {"adapter_model.safetensors", "adapter_config.json"}
    assert "the job is done" in uninterrupted["said"][1]
    assert "resumable: Succeeded after" in uninterrupted["said"][0]
    # rank 1's node trained (its rank's log) and kept nothing of the job's: no record, no checkpoint
    assert "logs" in uninterrupted["rank1 files"]
    assert not {"state.db", "checkpoints", "final"} & set(uninterrupted["rank1 files"]), uninterrupted["rank1 files"]


@pytest.mark.slow
def test_a_notice_on_rank_1_stops_both_nodes_at_one_step_and_the_resume_ends_byte_identical(reference, tmp_path):
    storage, a, b = training(tmp_path)
    b.send_signal(signal.SIGTERM)              # the notice reaches rank 1's node only
    codes = wait_both(a, b, tmp_path, "first")
    assert codes == (3, 3), output(tmp_path, "first-0")[-3000:] + output(tmp_path, "first-1")[-3000:]
    st = status(tmp_path / "reader", str(storage))
    assert st["phase"] == "Preempted"
    durable = st["checkpoints"]["latestDurable"]
    assert 10 <= durable < STEPS, st["checkpoints"]
    assert "with the other nodes of the group" in st["message"]
    resume_and_compare(tmp_path, storage, reference)


@pytest.mark.slow
def test_a_killed_rank_1_node_ends_rank_0s_within_a_bound_and_the_resume_ends_byte_identical(reference, tmp_path):
    storage, a, b = training(tmp_path)
    tree = psutil.Process(b.pid).children(recursive=True)
    for proc in [psutil.Process(b.pid), *tree]:     # the whole node: supervisor, launcher, its rank
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    killed = time.monotonic()
    b.wait()
    code = a.wait(timeout=LOST_BOUND_S + 30)
    took = time.monotonic() - killed
    print(f"rank 0's node exited {took:.1f} s after rank 1's node was killed")
    assert code == 3 and took < LOST_BOUND_S, (took, output(tmp_path, "first-0")[-3000:])
    st = status(tmp_path / "reader", str(storage))
    assert st["phase"] == "Preempted" and "lost a rank" in st["message"], st["message"]
    resume_and_compare(tmp_path, storage, reference)


# --- bad input: refused before any lease or download ------------------------------------------------

def _refused(tmp_path: Path, *args: str, nodes: int | None = 2, env: dict | None = None) -> str:
    storage = tmp_path / "store"
    job = two_node_job(tmp_path, storage, nodes) if nodes else write_job(tmp_path, 1, str(storage))
    full = {**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home"), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job), *args], cwd=REPO,
                          env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert not (storage / "resumable" / "lease.json").exists() and not (storage / "resumable" / "state.db").exists()
    return proc.stderr


def test_a_rank_out_of_range_is_refused_naming_the_range(tmp_path):
    err = _refused(tmp_path, "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500")
    assert "--node-rank 2: out of range for 2 nodes; use 0 to 1" in err


def test_a_node_started_for_another_count_than_spec_nodes_is_refused(tmp_path):
    err = _refused(tmp_path, "--nnodes", "3", "--node-rank", "0", "--master", "127.0.0.1:29500")
    assert "started as one of 3 nodes" in err and "spec.nodes is 2" in err


def test_a_multi_node_job_started_without_its_place_says_how(tmp_path):
    assert "start each of its 2 nodes with --nnodes 2 --node-rank R --master HOST:PORT" in _refused(tmp_path)


def test_the_launchers_environment_gives_the_place(tmp_path):
    err = _refused(tmp_path, env={"SKYPILOT_NUM_NODES": "3", "SKYPILOT_NODE_RANK": "1",
                                  "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7"})
    assert "started as one of 3 nodes (SkyPilot)" in err


def test_a_master_that_is_not_host_port_is_refused(tmp_path):
    err = _refused(tmp_path, "--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.5")
    assert "--master '10.0.0.5': expected HOST:PORT" in err


def test_spec_nodes_must_be_a_positive_whole_number(tmp_path):
    job = two_node_job(tmp_path, tmp_path / "store", 0)
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "apply", "-f", str(job), "--dry-run"],
                          cwd=REPO, env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "spec.nodes" in proc.stderr and "1 or more (got 0)" in proc.stderr, proc.stderr


def test_the_estimate_prices_every_node(tmp_path):
    job = two_node_job(tmp_path, tmp_path / "store", 3)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["gpu"] = "H100"
    doc["spec"]["parameters"]["promptsPerStep"] = 6
    job.write_text(yaml.safe_dump(doc))
    one = yaml.safe_load(job.read_text())
    one["spec"].pop("nodes")
    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump(one))
    est = [yaml.safe_load(grpo_run(tmp_path / "home", "apply", "-f", str(f), "--dry-run", "-o", "yaml").stdout)
           ["status"]["estimate"] for f in (job, single)]
    assert est[0]["gpus"] == 3 and est[1]["gpus"] == 1
    assert est[0]["usdPerHour"] == pytest.approx(3 * est[1]["usdPerHour"])


@pytest.mark.slow
def test_a_master_that_never_answers_ends_the_node_within_its_timeout_and_writes_nothing(tmp_path):
    storage = submitted(tmp_path)
    before = sorted(p.relative_to(storage) for p in storage.rglob("*"))
    start = time.monotonic()
    proc = node(tmp_path / "lonely", 1, storage, free_port(), GRPO_RUN_RENDEZVOUS_TIMEOUT_S="3")
    code = proc.wait(timeout=120)
    took = time.monotonic() - start
    out = output(tmp_path, "lonely")
    assert code == 1 and "no group formed at 127.0.0.1:" in out, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]      # neither Python's nor torch's C++ frames
    assert took < 60, took
    assert sorted(p.relative_to(storage) for p in storage.rglob("*")) == before     # nothing written


@pytest.mark.slow
def test_a_reward_that_fails_on_rank_1s_node_fails_the_job_on_rank_0s_record(tmp_path):
    """Rank 1 evaluates the second held-out batch ("9+9=", evalBatchSize 1, batches dealt
    round-robin): a reward that fails there fails on rank 1's node alone. Rank 0's node must
    record the reward's failure (the job Failed, the reward's words), never a lost rank."""
    storage = tmp_path / "store"
    job = two_node_job(tmp_path, storage)
    (tmp_path / "length.py").write_text("def score(completion, task):\n"
                                        "    if '9+9' in str(task):\n"
                                        "        raise ValueError('no nines here')\n"
                                        "    return float(len(completion))\n")
    grpo_run(tmp_path / "submit", "apply", "-f", str(job), "--detach")
    a, b = both(tmp_path, storage, "first")
    codes = wait_both(a, b, tmp_path, "first")
    assert codes == (1, 1), output(tmp_path, "first-0")[-3000:] + output(tmp_path, "first-1")[-3000:]
    st = status(tmp_path / "reader", str(storage))
    assert st["phase"] == "Failed", st
    assert "reward function failed on node 1" in st["message"] and "no nines here" in st["message"], st["message"]


@pytest.mark.slow
def test_a_failure_a_stranger_plants_in_the_store_leaves_a_lost_node_a_lost_node(reference, tmp_path):
    """The review's R1: a process that reaches rank 0's rendezvous port writes grpo-run/failed, then
    rank 1's node is lost (a routine spot loss). Rank 0's node must record a lost rank (Preempted,
    resumed to the same bytes), never Failed with the stranger's text."""
    import datetime as dt

    import torch.distributed as dist

    storage, a, b = training(tmp_path)
    port = int(a.args[a.args.index("--master") + 1].rpartition(":")[2])
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=10))
    stranger.set("grpo-run/failed", "reward function failed on node 1: planted by a stranger")
    for proc in [psutil.Process(b.pid), *psutil.Process(b.pid).children(recursive=True)]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    b.wait()
    assert a.wait(timeout=LOST_BOUND_S + 30) == 3, output(tmp_path, "first-0")[-3000:]
    st = status(tmp_path / "reader", str(storage))
    assert st["phase"] == "Preempted" and "lost a rank" in st["message"], st["message"]
    assert "planted" not in st["message"]
    resume_and_compare(tmp_path, storage, reference)


def test_apply_detach_of_a_multi_node_job_says_how_each_node_starts_it(tmp_path):
    """A plain `grpo-run resume NAME` is refused for a job of several nodes (exit 2): the advice
    after the submit gives the form each node takes instead."""
    storage = tmp_path / "store"
    said = grpo_run(tmp_path / "submit", "apply", "-f", str(two_node_job(tmp_path, storage)), "--detach").stdout
    assert (f"its nodes train it with: grpo-run resume resumable --storage {storage} --nnodes 2 --node-rank R "
            f"--master HOST:PORT on each of its 2 nodes (R = 0 on the node at HOST, 1 to 1 on the others)") in said
    assert "a node trains it with: grpo-run resume resumable --storage" not in said


def test_a_rendezvous_that_times_out_says_how_to_start_both_nodes_again(tmp_path):
    """Rank 0's node alone: the rendezvous times out (3 s), the job stops Preempted (exit 3), and
    the summary's next step is the multi-node form, not the plain resume the job refuses."""
    storage = submitted(tmp_path)
    proc = node(tmp_path / "alone", 0, storage, free_port(), GRPO_RUN_RENDEZVOUS_TIMEOUT_S="3")
    code = proc.wait(timeout=240)
    out = output(tmp_path, "alone")
    assert code == 3, out[-3000:]
    assert (f"continue with: grpo-run resume resumable --storage {storage} --nnodes 2 --node-rank R --master "
            f"HOST:PORT on each of its 2 nodes") in out, out[-3000:]
    assert "continue with: grpo-run resume resumable\n" not in out
