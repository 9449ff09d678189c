"""The deploy files a fresh spot node boots with: the systemd unit parses and runs `grpo-run
resume`, the cloud-init user-data is valid and writes every setting the unit uses."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "grpo-run-resume.service"
CLOUD_INIT = DEPLOY / "cloud-init.yaml"
ENV_FILE = "/etc/grpo-run/env"
GRPO_RUN = "/opt/grpo-run/.venv/bin/grpo-run"

# $VAR or ${VAR} in a unit's command lines (systemd's own specifiers are %x, not $).
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}, keys repeated as written (Environment=
    may appear many times). Raises ValueError on a line that is neither a section, a setting, a
    comment nor blank."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = iter(text.splitlines())
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        while stripped.endswith("\\"):                   # continuation lines
            stripped = stripped[:-1] + " " + next(lines, "").strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            current = sections.setdefault(stripped[1:-1], [])
            continue
        key, sep, value = stripped.partition("=")
        if current is None or not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()):
            raise ValueError(f"{UNIT.name}:{number}: not a setting: {line!r}")
        current.append((key.strip(), value.strip()))
    return sections


def settings(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def cloud_config() -> dict:
    return yaml.safe_load(CLOUD_INIT.read_text())


def env_file_keys() -> set[str]:
    """Variables cloud-init writes into /etc/grpo-run/env (commented-out ones do not count)."""
    (entry,) = [f for f in cloud_config()["write_files"] if f["path"] == ENV_FILE]
    keys = set()
    for line in entry["content"].splitlines():
        match = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)=", line)
        if match:
            keys.add(match.group(1))
    return keys


def test_the_unit_parses_and_runs_grpo_run_resume_after_the_network_is_up():
    unit = parse_unit(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit)
    (start,) = settings(unit["Service"], "ExecStart")
    assert start.split()[:2] == [GRPO_RUN, "resume"]
    assert "--storage ${GRPO_RUN_STORAGE}" in start
    assert "network-online.target" in " ".join(settings(unit["Unit"], "After"))
    assert "network-online.target" in " ".join(settings(unit["Unit"], "Wants"))
    assert settings(unit["Service"], "EnvironmentFile") == [ENV_FILE]
    assert settings(unit["Install"], "WantedBy") == ["multi-user.target"]


def test_done_preempted_over_budget_and_cancelled_are_not_restarted_but_failures_are():
    service = dict(parse_unit(UNIT.read_text())["Service"])
    assert service["Restart"] == "on-failure"                 # exit 0 (done) is never restarted
    # 5: with the unit's --wait, only after --wait-limit of another live node holding the job
    assert {"2", "3", "4", "5", "6"} <= set(service["RestartPreventExitStatus"].split())
    assert "1" not in service["RestartPreventExitStatus"].split()              # failed: restarted


def test_a_stop_leaves_time_for_an_emergency_checkpoint_signalled_to_the_supervisor_alone():
    service = dict(parse_unit(UNIT.read_text())["Service"])
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"].rstrip("s")) >= 60


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_itself_accepts_the_unit(tmp_path):
    """`systemd-analyze verify` checks every key and value; it also wants ExecStart's binary to
    exist, so a copy points at one that does (the test is about the unit, not this node)."""
    executable = shutil.which("true") or "/bin/sh"
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(GRPO_RUN, executable))
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if UNIT.name in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


def test_cloud_init_is_a_cloud_config_that_installs_and_enables_the_unit():
    text = CLOUD_INIT.read_text()
    assert text.splitlines()[0] == "#cloud-config"
    config = cloud_config()
    assert config["packages"] == ["python3-venv"]        # no git: the node installs a wheel from storage
    commands = "\n".join(" ".join(c) if isinstance(c, list) else c for c in config["runcmd"])
    assert "/etc/grpo-run/install.sh" in commands
    # the unit of the grpo-run the node installed, written by it
    assert f"/opt/grpo-run/.venv/bin/grpo-run deploy systemd --prefix /opt/grpo-run > /etc/systemd/system/{UNIT.name}" in commands
    assert f"systemctl enable {UNIT.name}" in commands
    (env,) = [f for f in config["write_files"] if f["path"] == ENV_FILE]
    assert env["permissions"] == "0600"                       # it may hold credentials
    (install,) = [f for f in config["write_files"] if f["path"] == "/etc/grpo-run/install.sh"]
    assert install["permissions"] == "0755" and install["content"].strip() == "@GRPO_RUN_INSTALL_SH@"


def test_every_variable_the_unit_uses_is_written_by_cloud_init():
    unit = parse_unit(UNIT.read_text())
    used = set()
    for _, value in unit["Service"]:
        used |= set(_VAR.findall(value))
    assert {"GRPO_RUN_JOB", "GRPO_RUN_STORAGE"} <= used
    written = env_file_keys()
    defaults = {v.split("=", 1)[0] for v in settings(unit["Service"], "Environment")}
    assert used - written - defaults == set()
    assert "GRPO_RUN_HOME" in written


def test_every_placeholder_is_documented_and_none_is_left_after_filling_them_in():
    text = CLOUD_INIT.read_text()
    placeholders = set(re.findall(r"@([A-Z_]+)@", text))
    assert {"GRPO_RUN_STORAGE", "GRPO_RUN_JOB", "GRPO_RUN_INSTALL_SH"} <= placeholders
    installs = set(re.findall(r"@([A-Z_]+)@", (DEPLOY / "install-node.sh").read_text()))
    assert {"GRPO_RUN_WHEEL_URL", "GRPO_RUN_CONSTRAINTS_URL", "GRPO_RUN_FETCHER", "GRPO_RUN_TORCH_INDEX",
            "GRPO_RUN_EXTRAS"} == installs
    readme = (DEPLOY / "README.md").read_text()
    assert all(f"@{p}@" in readme for p in placeholders | installs), (placeholders | installs)
    filled = re.sub(r"@([A-Z_]+)@", "x", text)
    assert yaml.safe_load(filled)["write_files"]
