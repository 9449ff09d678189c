"""A fresh spot node, simulated over real S3 with nothing but what cloud-init writes: the job is
submitted from a laptop (`apply --detach`); a node made of the generated environment file and the
generated unit's command line trains it; SIGKILL at a random step; another node made the same
way finishes it, byte-identical to a run never interrupted, the baseline computed once."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.deploy import NodeSettings, cloud_init, systemd_unit
from tests.runner.test_resume import REPO, STEPS, exported_bytes, grpo_run, status, uninterrupted, write_job  # noqa: F401

ENV_FILE = "/etc/grpo-run/env"


def node_command(settings: NodeSettings, node: Path) -> tuple[list[str], dict[str, str]]:
    """What systemd would run on a node booted from the generated user-data: the unit's ExecStart,
    expanded as systemd expands it, in an environment of the env file cloud-init writes (empty
    settings dropped, as its runcmd does) and the unit's own Environment= lines. Two stand-ins:
    GRPO_RUN_HOME is `node` (the unit's state directory), and the AWS keys of the test server
    play the instance role."""
    doc = yaml.safe_load(cloud_init(settings))
    (content,) = [f["content"] for f in doc["write_files"] if f["path"] == ENV_FILE]
    env_file = dict(line.split("=", 1) for line in content.splitlines()
                    if line and not line.startswith("#") and not line.endswith("="))
    unit = systemd_unit(settings.prefix).splitlines()
    env = {"PATH": os.environ["PATH"], "HOME": str(node), "LANG": "C.UTF-8"}
    for line in unit:
        if line.startswith("Environment="):
            key, value = line[len("Environment="):].split("=", 1)
            env[key] = value
    env.update(env_file)                               # EnvironmentFile= wins over Environment=
    env["GRPO_RUN_HOME"] = str(node)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
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
def test_a_fresh_node_from_the_generated_files_trains_and_a_killed_one_is_replaced(tmp_path, s3_env, uninterrupted,
                                                                                   seed):
    kill_at = random.Random(seed).randrange(1, STEPS)
    print(f"seed {seed}: SIGKILL node A once it has logged step {kill_at}")
    grpo_run(tmp_path / "laptop", "apply", "-f", str(write_job(tmp_path, s3_env.url)), "--detach")
    settings = NodeSettings(storage=s3_env.url, job="resumable", endpoint=s3_env.server.endpoint_url,
                            region="us-east-1", prefix=str(REPO))

    node_a = tmp_path / "node-a"
    argv, env = node_command(settings, node_a)
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
    argv, env = node_command(settings, node_b)
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    assert exported_bytes(tmp_path / "reader", s3_env.url, tmp_path / "export") == uninterrupted
    st = status(tmp_path / "reader", s3_env.url)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert st["baseline"]["runs"] == 1
