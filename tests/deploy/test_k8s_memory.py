"""`deploy k8s` requests and limits the pod's memory (from the job's estimate, or --memory), so a
pod whose node gives the reward sandbox no cgroup still bounds a reward's processes: the pod's
cgroup does, and the kernel's OOM killer takes the reward's worker, not the kubelet the whole job."""

from __future__ import annotations

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.host import pod_memory
from grpo_run.runner.spec.job import load_job


def job_file(tmp_path, **parameters) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "k8s-job"},
                                    "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                             "storage": "s3://bucket/grpo", "parameters": parameters}}))
    return str(path)


def deployed(capsys, *argv: str) -> tuple[str, dict]:
    capsys.readouterr()
    assert main(["deploy", "k8s", "--image", "r/g:1", *argv]) == EXIT_OK
    text = capsys.readouterr().out
    return text, yaml.safe_load(text)["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_the_pods_memory_is_requested_and_limited_from_the_jobs_estimate(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    small, large = job_file(tmp_path / "a", rewardMemoryMB=1024), job_file(tmp_path / "b", rewardMemoryMB=8192)
    text, resources = deployed(capsys, "-f", small)
    expected = pod_memory(load_job(small), estimate(load_job(small))["memory"]).quantity
    assert resources == {"requests": {"memory": expected}, "limits": {"nvidia.com/gpu": 1, "memory": expected}}
    assert f"# memory: {expected} requested and limited, from the job's estimate" in text
    _, bigger = deployed(capsys, "-f", large)             # a reward allowed more memory: a larger pod
    assert int(bigger["limits"]["memory"].removesuffix("Gi")) > int(expected.removesuffix("Gi"))


def test_memory_given_replaces_the_estimate_and_a_malformed_one_is_refused(tmp_path, capsys):
    text, resources = deployed(capsys, "-f", job_file(tmp_path), "--memory", "48Gi")
    assert resources["requests"] == {"memory": "48Gi"} and resources["limits"]["memory"] == "48Gi"
    _, without_file = deployed(capsys, "--storage", "s3://b/p", "--job", "j", "--memory", "64Gi")
    assert without_file["limits"] == {"nvidia.com/gpu": 1, "memory": "64Gi"}
    for bad in ("48GB", "0Gi", "512Mi", "lots"):
        capsys.readouterr()
        assert main(["deploy", "k8s", "--image", "r/g:1", "-f", job_file(tmp_path), "--memory", bad]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"--memory {bad!r}: expected the pod's memory as a whole number of Mi, Gi or Ti" in err


def test_without_a_job_file_or_memory_the_manifest_says_the_pod_is_unbounded(capsys):
    text, resources = deployed(capsys, "--storage", "s3://b/p", "--job", "j")
    assert "memory" not in resources.get("limits", {})
    assert "# memory: not set (no job file to estimate it from, no --memory): the pod is BestEffort" in text
