"""vLLM as a server (`grpo-run vllm-server`, spec.parameters.vllm.mode: server), for real on
127.0.0.1: a job samples on it and ends byte for byte where the same job colocated ends; a server
that dies mid-run is an infrastructure failure the supervisor restarts, never a score; an
unreachable server is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from grpo_run.state.record import Record
from tests.faults.harness import start_node, wait_until
from tests.runner.test_resume import exported_bytes, grpo_run
from tests.runner.test_vllm_jobs import tiny64, write_job  # noqa: F401 (the session's model fixture)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 16


def start_server(model: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "vllm-server", "--model", str(model),
                             "--port", str(port), "--gpu-memory-utilization", "0.1", "--max-lora-rank", "8"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:                         # vLLM's log, then our line once it answers
        seen.append(line)
        if line.startswith("vLLM ") and " serving " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()    # drained: never blocks the server
            return proc, line.rsplit(" at ", 1)[1].strip()
    proc.wait()
    raise AssertionError(f"the server ended (status {proc.returncode}):\n{''.join(seen)[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def server_job(folder: Path, model: Path, url: str, **params) -> Path:
    path = write_job(folder, model, **params)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["parameters"]["vllm"] = {"mode": "server", "server": url}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tiny64):
    """The same job, sampled by the colocated engine."""
    folder = tmp_path_factory.mktemp("colocated")
    grpo_run(folder / "home", "apply", "-f", str(write_job(folder, tiny64, maxSteps=STEPS, saveSteps=4)))
    return exported_bytes(folder / "home", None, folder / "export")


def test_a_job_sampling_on_a_vllm_server_ends_where_the_colocated_one_ends(tmp_path, tiny64, colocated):
    server, url = start_server(tiny64)
    try:
        job = server_job(tmp_path, tiny64, url, maxSteps=STEPS, saveSteps=4)
        grpo_run(tmp_path / "home", "apply", "-f", str(job))
        status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "resumable", "-o", "json").stdout)["status"]
        assert status["phase"] == "Succeeded"
        assert status["sampler"]["engine"] == "vllm" and status["sampler"]["mode"] == "server"
        assert status["sampler"]["server"] == url and status["lastStep"]["logprobMismatch"] < 1e-3
        assert exported_bytes(tmp_path / "home", None, tmp_path / "export") == colocated
    finally:
        stop(server)


def test_a_server_that_dies_mid_run_is_an_infrastructure_failure_restarted_never_a_score(tmp_path, tiny64,
                                                                                         colocated):
    server, url = start_server(tiny64)
    port = int(url.rsplit(":", 1)[1])
    node = tmp_path / "home"
    try:
        job = server_job(tmp_path, tiny64, url, maxSteps=STEPS, saveSteps=4)
        proc = start_node(node, "apply", "-f", str(job), GRPO_RUN_NOTICES="none")
        db = node / "runs" / "resumable" / "state.db"

        def steps() -> int:
            if not db.exists():
                return 0
            with Record(db) as record:
                last = record.steps(last=1)
            return last[-1]["step"] if last else 0

        wait_until("step 3 trained on the server", lambda: steps() >= 3, proc)
        stop(server)                                   # the sampling GPU's node is gone

        def attempts() -> list[dict]:
            with Record(db) as record:
                return record.attempts()

        wait_until("the attempt ended by the lost server", lambda: any(
            "vLLM server" in (a.get("message") or "") for a in attempts()), proc)
        server, _ = start_server(tiny64, port)         # the operator brings it back; the restarts go on
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        ended = [a for a in attempts() if "vLLM server" in (a.get("message") or "")]
        assert ended and all("did not answer" in a["message"] for a in ended)
        with Record(db) as record:
            rewards = [s["rewardMean"] for s in record.steps()]
        assert len(rewards) == STEPS and all(r > 0 for r in rewards)    # no step scored as a failure
        assert exported_bytes(node, None, tmp_path / "export") == colocated
    finally:
        stop(server)


def test_an_unreachable_server_is_refused_before_anything_starts(tmp_path, tiny64):
    job = server_job(tmp_path, tiny64, "http://127.0.0.1:9", maxSteps=2)
    done = grpo_run(tmp_path / "home", "apply", "-f", str(job), check=False)
    assert done.returncode == 2
    assert "spec.parameters.vllm.server: no vLLM server answers at http://127.0.0.1:9" in done.stderr
    assert "grpo-run vllm-server --model" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "runs" / "resumable").exists()
