"""Launch files for a job on several nodes (`deploy k8s --nodes N`, `deploy skypilot --nodes N`):
checked by the engines' own tools, and the place each node reads from them is the one
runner.jobs.nodes resolves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_USAGE, main
from grpo_run.runner.jobs.nodes import resolve
from tests.deploy.test_generate import load_with_skypilot, printed, sky_job_file, skypilot_python  # noqa: F401


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
def test_the_kubernetes_files_for_two_nodes_are_an_indexed_job_and_its_headless_service(capsys, version):
    import kubernetes_validate

    text = printed(capsys, "k8s", "--storage", "s3://bucket/grpo", "--job", "big", "--image", "registry/grpo-run:1",
                   "--nodes", "2")
    service, policy, job = list(yaml.safe_load_all(text))
    for doc in (service, policy, job):
        kubernetes_validate.validate(doc, version, strict=True)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    assert pod["subdomain"] == service["metadata"]["name"] == "grpo-run-big"
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    # what each pod resolves: its rank from the indexed Job, pod 0 (rank 0) at NAME-0.NAME
    for index in (0, 1):
        place = resolve(SimpleNamespace(name="big", nodes=2), None, None, None,
                        {**env, "JOB_COMPLETION_INDEX": str(index)})
        assert (place.count, place.rank, place.master) == (2, index, "grpo-run-big-0.grpo-run-big:29500")
    # exit 3 (a notice anywhere, a lost pod) replaces the pod without counting: the group starts again
    assert {"action": "Ignore", "onExitCodes": {"containerName": "grpo-run", "operator": "In", "values": [3]}} \
        in spec["podFailurePolicy"]["rules"]


def test_only_the_jobs_own_pods_may_reach_its_pods_and_each_pod_gets_the_jobs_node_secret(capsys):
    import kubernetes_validate

    text = printed(capsys, "k8s", "--storage", "s3://bucket/grpo", "--job", "big", "--image", "registry/grpo-run:1",
                   "--nodes", "2")
    docs = list(yaml.safe_load_all(text))
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    job = next(d for d in docs if d["kind"] == "Job")
    kubernetes_validate.validate(policy, "1.31.0", strict=True)
    pods = job["spec"]["template"]["metadata"]["labels"]
    # it selects the job's pods, and admits (on any port: the rendezvous', gloo's and NCCL's) their own alone
    assert policy["spec"]["podSelector"] == {"matchLabels": pods} and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": pods}}]}]
    assert "only the job's own pods may reach its pods" in text.lower()
    secret = next(e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
                  if e["name"] == "GRPO_RUN_NODES_SECRET")
    assert secret["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    one = list(yaml.safe_load_all(printed(capsys, "k8s", "--storage", "s3://bucket/grpo", "--job", "big", "--image",
                                          "registry/grpo-run:1")))
    assert [d["kind"] for d in one] == ["Job"]           # one node: no port to reach, no policy


def test_the_skypilot_task_for_two_nodes_loads_with_skypilots_own_loader(tmp_path, capsys, skypilot_python):
    task = tmp_path / "task.yaml"
    task.write_text(printed(capsys, "skypilot", "-f", sky_job_file(tmp_path, gpu="H100", nodes=2,
                                                                   parameters={"promptsPerStep": 2})))
    loaded = load_with_skypilot(skypilot_python, task)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert yaml.safe_load(task.read_text())["num_nodes"] == 2
    said = task.read_text()                 # who may reach rank 0's port, and the node secret to give
    assert "Only the cluster's own nodes may reach it" in said and "GRPO_RUN_NODES_SECRET" in said
    script = ("import sys, sky\nprint(sky.Task.from_yaml(sys.argv[1]).num_nodes)\n")
    import subprocess

    counted = subprocess.run([str(skypilot_python), "-c", script, str(task)], capture_output=True, text=True)
    assert counted.stdout.strip() == "2", counted.stderr[-2000:]
    # what each node resolves from SkyPilot's own variables: the first node's address is rank 0's
    place = resolve(SimpleNamespace(name="sky-job", nodes=2), None, None, None,
                    {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n"})
    assert (place.count, place.rank, place.master) == (2, 1, "10.0.0.5:29500")


def test_nodes_are_refused_where_they_cannot_be(tmp_path, capsys):
    base = ["--storage", "s3://bucket/grpo", "--image", "registry/grpo-run:1"]
    assert main(["deploy", "k8s", *base, "--all", "--nodes", "2"]) == EXIT_USAGE
    assert "a queue (--all) is served one job at a time" in capsys.readouterr().err
    assert main(["deploy", "cloud-init", "--storage", "s3://bucket/grpo", "--job", "big", "--nodes", "2"]) == EXIT_USAGE
    assert "--nodes is for skypilot and k8s" in capsys.readouterr().err
    job = sky_job_file(tmp_path, nodes=2, parameters={"promptsPerStep": 2})
    assert main(["deploy", "k8s", "-f", job, "--image", "registry/grpo-run:1", "--nodes", "3"]) == EXIT_USAGE
    assert "says spec.nodes 2" in capsys.readouterr().err
    capsys.readouterr()
    # without --nodes the job file's spec.nodes decides
    assert main(["deploy", "k8s", "-f", job, "--image", "registry/grpo-run:1"]) == 0
    assert yaml.safe_load_all(capsys.readouterr().out).__next__()["kind"] == "Service"


def test_cloud_init_refuses_a_job_of_several_nodes_from_its_file_and_from_storage(tmp_path, capsys):
    """cloud-init user-data starts every instance as a job of one node; a job of several refuses
    that (exit 2, never restarted), so its instances would sit idle and billed. Refused here, from
    the file (-f) and from storage's copy (--job), naming the launchers that start N nodes."""
    job = sky_job_file(tmp_path, nodes=2, parameters={"promptsPerStep": 2})
    storage = str(tmp_path / "bucket")
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "-f", job]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{job} says spec.nodes 2: cloud-init user-data starts each instance as a job of one node" in err
    assert f"grpo-run deploy skypilot -f {job}" in err and f"grpo-run deploy k8s -f {job}" in err
    assert not (tmp_path / "bucket").exists()                           # no wheel put anywhere
    assert main(["apply", "-f", job, "--detach"]) == 0                 # submitted, then asked for by name
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "--storage", storage, "--job", "sky-job"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--job sky-job: {storage} holds it with spec.nodes 2" in err
    assert f"grpo-run deploy skypilot --storage {storage} --job sky-job" in err


def test_cloud_init_refuses_a_job_its_reachable_storage_does_not_hold(tmp_path, capsys):
    storage = tmp_path / "bucket"
    storage.mkdir()
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "--storage", str(storage), "--job", "not-submitted"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--job not-submitted: {storage} holds no job not-submitted" in err
    assert "grpo-run apply -f JOB.yaml --detach" in err and "grpo-run deploy cloud-init -f JOB.yaml" in err
    assert list(storage.iterdir()) == []                               # refused before the wheel goes there


def test_cloud_init_for_a_store_it_cannot_read_warns_and_still_prints(capsys):
    # gs:// with no credentials here (conftest): the nodes' own service account may well reach it
    assert main(["deploy", "cloud-init", "--storage", "gs://some-bucket/grpo", "--job", "my-job"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#cloud-config\n")
    assert "warning: could not check that gs://some-bucket/grpo holds job my-job (" in err
    assert "no Google credentials found" in err and "Traceback" not in err


def test_cloud_init_for_a_finished_job_warns_that_its_node_would_idle(tmp_path, capsys):
    job = sky_job_file(tmp_path)
    storage = str(tmp_path / "bucket")
    assert main(["apply", "-f", job, "--detach"]) == 0
    assert main(["cancel", "sky-job", "--storage", storage]) == 0          # Pending -> Cancelled at once
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "--storage", storage, "--job", "sky-job"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#cloud-config\n")
    assert f"warning: --job sky-job is Cancelled in {storage}: a node booted now finds nothing to do" in err
