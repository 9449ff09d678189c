"""A fresh spot node, simulated over real S3 with nothing but what cloud-init writes: the job is
submitted from a laptop folder outside the repository (`apply --detach`, which puts the wheel of
the grpo-run installed there into the bucket); the install step of the generated user-data runs
for real into a new venv (grpo-run from that wheel; its dependencies from this test's own venv
through a .pth line, pip kept off the network); a node made of that venv, the generated
environment file and the generated unit's command line trains the job; SIGKILL at a random step;
another node made the same way finishes it, byte-identical to a run never interrupted, the
baseline computed once."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.deploy import systemd_unit
from tests.runner.test_resume import STEPS, exported_bytes, grpo_run, status, uninterrupted, write_job  # noqa: F401

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
    rebuilt = subprocess.run([python, "-c", "import sys, pathlib; from grpo_run.runner.wheel import build_wheel; "
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
