"""A fresh spot node, simulated over real S3 with nothing but what cloud-init writes: the job is
submitted from a laptop folder outside the repository (`apply --detach`, which puts the wheel of
the grpo-run installed there into the bucket); the install step of the generated user-data runs
for real into a new venv (grpo-run from that wheel; its dependencies from this test's own venv
through a .pth line, pip kept off the network); a node made of that venv, the generated
environment file and the generated unit's command line trains the job; SIGKILL at a random step;
another node made the same way finishes it, byte-identical to a run never interrupted, the
baseline computed once."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.deploy.node import NodeSettings, cloud_init, systemd_unit
from grpo_run.runner.deploy.wheel import build_wheel, publish
from tests.runner.jobs.test_resume import STEPS, exported_bytes, grpo_run, status, uninterrupted, write_job  # noqa: F401

ENV_FILE = "/etc/grpo-run/env"
INSTALL_SH = "/etc/grpo-run/install.sh"
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def written(user_data: str, path: str) -> str:
    (content,) = [f["content"] for f in yaml.safe_load(user_data)["write_files"] if f["path"] == path]
    return content


def env_file(user_data: str) -> dict[str, str]:
    """The env file cloud-init writes, empty settings dropped (as its runcmd does)."""
    return dict(line.split("=", 1) for line in written(user_data, ENV_FILE).splitlines()
                if line and not line.startswith("#") and not line.endswith("="))


def install_for_real(user_data: str, prefix: Path) -> subprocess.CompletedProcess:
    """The generated install step (/etc/grpo-run/install.sh), run as cloud-init's runcmd runs it:
    with the env file's settings and the node's credentials (the test server's keys play the
    instance role). Stand-in for python3-venv's fresh venv: one made here first (the script keeps
    an existing one), with this test's site-packages on a .pth line so nothing is downloaded, and
    pip told never to use an index: a dependency not already here fails the install."""
    venv = prefix / ".venv"
    subprocess.run([Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_deps_from_the_test_venv.pth").write_text(
        "".join(p + "\n" for p in sys.path if p.endswith("site-packages")))
    script = prefix / "install.sh"
    script.write_text(written(user_data, INSTALL_SH))
    env = {"PATH": os.environ["PATH"], "HOME": str(prefix), "LANG": "C.UTF-8", "PIP_NO_INDEX": "1",
           **env_file(user_data), **{k: os.environ[k] for k in AWS_KEYS}}
    return subprocess.run(["bash", str(script)], env=env, cwd=prefix, capture_output=True, text=True, timeout=600)


def deployed_user_data(tmp_path: Path, s3_env, prefix: Path) -> str:
    """`grpo-run deploy cloud-init` as a user runs it on a laptop: it puts this grpo-run's wheel
    into the bucket and prints the user-data that installs it into `prefix`."""
    laptop = tmp_path / "laptop"
    laptop.mkdir(exist_ok=True)
    user = {**os.environ, "GRPO_RUN_HOME": str(laptop / "home")}
    if not (laptop / "job.yaml").exists():       # storage holds the job, as `deploy cloud-init --job` requires
        submitted = subprocess.run([str(Path(sys.executable).parent / "grpo-run"), "apply", "-f",
                                    str(write_job(laptop, s3_env.url)), "--detach"], cwd=laptop, env=user,
                                   capture_output=True, text=True, timeout=300)
        assert submitted.returncode == 0, submitted.stderr
    deployed = subprocess.run([str(Path(sys.executable).parent / "grpo-run"), "deploy", "cloud-init", "--storage",
                               s3_env.url, "--job", "resumable", "--endpoint", s3_env.server.endpoint_url, "--region",
                               "us-east-1", "--torch", "cpu", "--prefix", str(prefix)],
                              cwd=laptop, env=user, capture_output=True, text=True)
    assert deployed.returncode == 0, deployed.stderr
    return deployed.stdout


def url_in(user_data: str, name: str) -> tuple[str, str]:
    """(bucket, key) of the WHEEL_URL or CONSTRAINTS_URL the install step fetches."""
    (url,) = {line.split('"')[1] for line in written(user_data, INSTALL_SH).splitlines() if line.startswith(f"{name}=")}
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def installed_anything(prefix: Path) -> list[str]:
    """What pip put into the node's venv: grpo-run's files or dist-info, or any .pth of a wheel."""
    site = next((prefix / ".venv" / "lib").glob("python*/site-packages"))
    return sorted(p.name for p in site.iterdir() if p.name.startswith("grpo_run") or
                  (p.suffix == ".pth" and p.name != "_deps_from_the_test_venv.pth"))


@pytest.mark.trust
def test_a_wheel_swapped_in_storage_is_refused_by_the_node_before_pip_runs(tmp_path, s3_env):
    prefix = tmp_path / "opt-grpo-run"
    user_data = deployed_user_data(tmp_path, s3_env, prefix)
    client = s3_env.server.client()
    bucket, key = url_in(user_data, "WHEEL_URL")
    # a bucket writer's wheel: the same package plus a .pth that runs as root at the node's next python start
    marker = tmp_path / "owned"
    original = tmp_path / "original.whl"
    original.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    swapped = tmp_path / "swapped.whl"
    with zipfile.ZipFile(original) as zf, zipfile.ZipFile(swapped, "w") as out:
        for info in zf.infolist():
            out.writestr(info, zf.read(info))
        out.writestr("zzz_owned.pth", f"import pathlib; pathlib.Path({str(marker)!r}).write_text('root')\n")
    client.put_object(Bucket=bucket, Key=key, Body=swapped.read_bytes())

    installed = install_for_real(user_data, prefix)
    assert installed.returncode != 0
    want = hashlib.sha256(original.read_bytes()).hexdigest()
    got = hashlib.sha256(swapped.read_bytes()).hexdigest()
    assert f"refused s3://{bucket}/{key}: its sha256 is {got}, not {want}" in installed.stderr
    assert installed_anything(prefix) == [] and not marker.exists()
    assert not (prefix / "dist" / original.name).exists()             # the refused file is not kept either
    # `grpo-run deploy` again puts this grpo-run's own wheel back, and names the same bytes
    again = deployed_user_data(tmp_path, s3_env, prefix)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == original.read_bytes()
    assert f'WHEEL_SHA256="{want}"' in written(again, INSTALL_SH)


@pytest.mark.trust
def test_constraints_that_carry_a_pip_option_are_refused_by_the_node(tmp_path, s3_env):
    """Even with the launch file's own hash (a constraints file the generator was given), a line
    that is a pip option (--extra-index-url, -e, -r) never reaches pip."""
    wheel = build_wheel(tmp_path / "wheel")
    pinned = wheel.constraints + b"--extra-index-url http://127.0.0.1:9/simple\n"
    evil = publish(replace(wheel, constraints=pinned, constraints_sha256=""), s3_env.url)
    prefix = tmp_path / "opt-grpo-run"
    user_data = cloud_init(NodeSettings(storage=s3_env.url, job="resumable", endpoint=s3_env.server.endpoint_url,
                                        region="us-east-1", torch="cpu", prefix=str(prefix), wheel=evil))
    assert f'CONSTRAINTS_SHA256="{hashlib.sha256(pinned).hexdigest()}"' in written(user_data, INSTALL_SH)
    installed = install_for_real(user_data, prefix)
    assert installed.returncode != 0
    lines = len(pinned.decode().splitlines())
    assert (f"line {lines} is not `name==version` ('--extra-index-url http://127.0.0.1:9/simple'); a pip option "
            f"from storage is never used") in installed.stderr
    assert installed_anything(prefix) == []


def node_command(user_data: str, prefix: Path, node: Path) -> tuple[list[str], dict[str, str]]:
    """What systemd would run on a node booted from the generated user-data, grpo-run installed at
    `prefix`: the unit's ExecStart, expanded as systemd expands it, in an environment of the env
    file cloud-init writes and the unit's own Environment= lines. Two stand-ins: GRPO_RUN_HOME is
    `node` (the unit's state directory), and the AWS keys of the test server play the instance role."""
    unit = systemd_unit(str(prefix)).splitlines()
    env = {"PATH": os.environ["PATH"], "HOME": str(node), "LANG": "C.UTF-8"}
    for line in unit:
        if line.startswith("Environment="):
            key, value = line[len("Environment="):].split("=", 1)
            env[key] = value
    env.update(env_file(user_data))                    # EnvironmentFile= wins over Environment=
    env["GRPO_RUN_HOME"] = str(node)
    for key in AWS_KEYS:
        env[key] = os.environ[key]
    (start,) = [line[len("ExecStart="):] for line in unit if line.startswith("ExecStart=")]
    argv = []
    for word in start.split():
        if word.startswith("${"):
            argv.append(env.get(word[2:-1], ""))       # ${VAR}: one word
        elif word.startswith("$"):
            argv += env.get(word[1:], "").split()      # $VAR: split, and nothing when empty
        else:
            argv.append(word)
    return argv, env


def steps_done(node: Path) -> int:
    db = node / "runs" / "resumable" / "state.db"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("select count(*) from steps").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7])
def test_a_fresh_node_from_the_generated_files_trains_and_a_killed_one_is_replaced(tmp_path, s3_env, uninterrupted,  # noqa: F811
                                                                                   seed):
    kill_at = random.Random(seed).randrange(1, STEPS)
    print(f"seed {seed}: SIGKILL node A once it has logged step {kill_at}")
    # the laptop: a folder of the user's own, outside the repository, and this venv's grpo-run
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    user = {**os.environ, "GRPO_RUN_HOME": str(laptop / "home")}
    grpo = str(Path(sys.executable).parent / "grpo-run")
    submitted = subprocess.run([grpo, "apply", "-f", str(write_job(laptop, s3_env.url)), "--detach"], cwd=laptop,
                               env=user, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stderr
    prefix = tmp_path / "opt-grpo-run"
    deployed = subprocess.run([grpo, "deploy", "cloud-init", "--storage", s3_env.url, "--job", "resumable",
                               "--endpoint", s3_env.server.endpoint_url, "--region", "us-east-1", "--torch", "cpu",
                               "--prefix", str(prefix)], cwd=laptop, env=user, capture_output=True, text=True)
    assert deployed.returncode == 0, deployed.stderr
    user_data = deployed.stdout

    installed = install_for_real(user_data, prefix)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    python = prefix / ".venv" / "bin" / "python"
    where = subprocess.run([python, "-c", "import grpo_run.runner.cli.commands as c; print(c.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(prefix / ".venv")            # the wheel, not this checkout
    # Installed from a wheel, grpo-run rebuilds that wheel from its RECORD: the same files, the same key
    (key,) = {line.split('"')[1] for line in written(user_data, INSTALL_SH).splitlines() if line.startswith("WHEEL_URL=")}
    rebuilt = subprocess.run([python, "-c", "import sys, pathlib; from grpo_run.runner.deploy.wheel import build_wheel; "
                              "print(build_wheel(pathlib.Path(sys.argv[1])).folder)", str(tmp_path / "rebuilt")],
                             cwd=tmp_path, capture_output=True, text=True)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert f"/{rebuilt.stdout.strip()}/" in key

    node_a = tmp_path / "node-a"
    argv, env = node_command(user_data, prefix, node_a)
    assert argv[:2] == [str(prefix / ".venv" / "bin" / "grpo-run"), "resume"]
    assert argv[1:] == ["resume", "resumable", "--storage", s3_env.url, "--wait"]
    booted = subprocess.Popen(argv, env=env, cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while steps_done(node_a) < kill_at and booted.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(booted.pid, signal.SIGKILL)              # the node is gone: supervisor, trainer, grader, writer
    booted.wait()
    assert booted.returncode == -signal.SIGKILL, booted.stderr.read()[-2000:]

    node_b = tmp_path / "node-b"
    argv, env = node_command(user_data, prefix, node_b)
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    assert exported_bytes(tmp_path / "reader", s3_env.url, tmp_path / "export") == uninterrupted
    st = status(tmp_path / "reader", s3_env.url)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert st["baseline"]["runs"] == 1
