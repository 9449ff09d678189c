"""What the fault-injection tests share: starting `grpo-run` as a node, finding its processes,
waiting (polled, bounded) for what a node has reached, and sending each cloud's notice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.emulators import AwsImdsEmulator, AzureScheduledEventsEmulator, GcpMetadataEmulator
from tests.tiny_models import seed_home

REPO = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).resolve().parent / "inject"    # sitecustomize: the fault points, armed from outside
SOURCES = ("aws", "gcp", "azure", "signal")
NOTICE_WINDOW_S = 25.0     # inside the shortest notice (GCP, Azure: about 30 s)
_EMULATORS = {"aws": ("GRPO_RUN_AWS_METADATA_URL", AwsImdsEmulator),
              "gcp": ("GRPO_RUN_GCP_METADATA_URL", GcpMetadataEmulator),
              "azure": ("GRPO_RUN_AZURE_METADATA_URL", AzureScheduledEventsEmulator)}


def start_node(home: Path, *args: str, fault: str | None = None, log: Path | None = None,
               **env_extra: str) -> subprocess.Popen:
    """`grpo-run ARGS` in the background on a node whose local disk is `home`. A `fault`
    (GRPO_RUN_FAULT) fires once: its marker file is `marker(home)`. Its output is piped, or
    appended to `log` (then communicate() returns nothing: read the file)."""
    env = {**os.environ, "GRPO_RUN_HOME": str(seed_home(home)), **env_extra}
    env.pop("GRPO_RUN_FAULT", None)
    if fault:
        env.update(fault_env(fault, marker(home), env))
    argv = [sys.executable, "-m", "grpo_run.runner.cli", *args]
    if log is None:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        with open(log, "a") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    _started.append(proc)
    return proc


_started: list[subprocess.Popen] = []       # the nodes this process started, for kill_nodes_left_running


def kill_nodes_left_running() -> list[int]:
    """SIGKILL every node started here that still runs, with all its descendants (collected
    first: a killed supervisor's children would be reparented out of reach). A test that failed
    while waiting leaves its node running; without this it trains on, loading the machine for
    every later test (seen: 17 minutes of a clean-clone run). Returns the nodes killed."""
    killed = []
    for proc in _started:
        if proc.poll() is None:
            tree, todo = [], [proc.pid]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children(pid))
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            killed.append(proc.pid)
    _started.clear()
    return killed


def fault_env(fault: str, marker: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What arms `fault` ([hold:]POINT@STEP[/trainer|/rankR], see tests/faults/inject/grpo_run_faults.py)
    in every process of a node: GRPO_RUN_FAULT, the marker file that makes it fire once, and
    PYTHONPATH with tests/faults/inject first (then `env`'s own, default os.environ's), whose
    sitecustomize each Python process of the node imports at start-up."""
    path = (os.environ if env is None else env).get("PYTHONPATH")
    return {"GRPO_RUN_FAULT": fault, "GRPO_RUN_FAULT_MARKER": str(marker),
            "PYTHONPATH": os.pathsep.join([str(INJECT), path] if path else [str(INJECT)])}


def marker(home: Path) -> Path:
    return home.parent / f"{home.name}.fault-fired"


def wait_until(what: str, reached: Callable[[], bool], proc: subprocess.Popen | None = None,
               timeout: float = 180) -> None:
    """Poll `reached` until it is true; fail if `proc` ended first or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while not reached():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the node ended (status {proc.returncode}) before {what}:\n{(err or '')[-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)


@contextmanager
def notice_source(source: str) -> Iterator[tuple[dict[str, str], Callable[[subprocess.Popen], None]]]:
    """(environment for the node, trigger(proc)) for one source of notices: a cloud's metadata
    emulator, or SIGTERM to the supervisor (systemd, Kubernetes)."""
    if source == "signal":
        yield {"GRPO_RUN_NOTICES": "none"}, lambda proc: proc.send_signal(signal.SIGTERM)
        return
    var, emulator_class = _EMULATORS[source]
    with emulator_class() as emulator:
        yield {"GRPO_RUN_NOTICES": source, var: emulator.url}, lambda proc: emulator.trigger_preempt()


def children(pid: int) -> list[int]:
    """Direct child processes of `pid`, from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""
