"""Starting a trainer process: alone or under accelerate's launcher, and, alone, started early.

A trainer alone is started with a control pipe (trainer.protocol.CONTROL_FD_ENV) so that nothing
it does before its first step waits on what it does not need (SPEC §10: the fresh node's path):
  * `PrewarmedTrainer`: started as soon as the node knows the job (runner.jobs.run), before the
    model is built or fetched, the lease taken and the record fetched; its interpreter and its
    imports (torch, transformers, peft: seconds) run meanwhile, then it waits for its plan. Handed
    over only when the environment the attempt would give a trainer is exactly the one it was
    started with (same threads, same variables); else it is ended and a trainer started afresh.
  * the attempt (runner.supervisor.attempt) starts it before the checkpoint fetch: the model's
    load, the graders' start and the engine's start run beside the fetch, and the trainer waits
    for CONTROL_GO before it reads the checkpoint or reports anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from grpo_run.checkpoint.procs import python_env
from grpo_run.checkpoint.storage.fsio import atomic_write_bytes
from grpo_run.runner.home import TINY_PREFIX, ensure_model, is_tiny, tiny_model_path
from grpo_run.runner.supervisor.runspec import RunSpec
from grpo_run.runner.supervisor.threads import trainer_threads
from grpo_run.trainer.protocol import (CONTROL_FD_ENV, CONTROL_GO, CONTROL_PLAN, EVENTS_FD_ENV, LATE_ENV, PARENT_ENV,
                                       PLAN_FILE, PREBUILD_ENV, PREBUILT_FD_ENV, PROGRESS_ENV, WORLD_ENV, Plan)

log = logging.getLogger(__name__)

# The node's switch for the trainer started early: "0" starts it only when its plan is ready (a
# node short of memory for two interpreters at once, or to measure what the early start saves).
PREWARM_ENV = "GRPO_RUN_PREWARM"
# How long the supervisor waits for the trainer started early to build a tiny demo model (seconds of a
# build that takes one or two) before it builds the model itself.
BUILD_WAIT_S = 300.0


@dataclass
class Spawned:
    """A started trainer process: the read end of its events pipe, and the write end of its
    control pipe (None under a launcher, which takes no pipe: it starts at once, its plan final)."""
    proc: subprocess.Popen
    events_fd: int
    control_fd: int | None = field(default=None)

    late: dict[str, str | None] = field(default_factory=dict)   # LATE_ENV as the attempt gives them

    def plan_written(self) -> None:
        """plan.json is there: the trainer loads the model, the graders and the engine."""
        if self.control_fd is not None:
            _say(self.control_fd, f"{CONTROL_PLAN} {json.dumps(self.late)}\n".encode())

    def go(self) -> None:
        """The checkpoint is restored and plan.json is the attempt's: the trainer goes on."""
        if self.control_fd is not None:
            _say(self.control_fd, f"{CONTROL_GO}\n".encode())
            os.close(self.control_fd)
            self.control_fd = None

    def give_up(self) -> None:
        """Close the control pipe: a trainer still waiting on it exits without a word."""
        if self.control_fd is not None:
            os.close(self.control_fd)
            self.control_fd = None


def _say(fd: int, what: bytes) -> None:
    try:
        os.write(fd, what)
    except BrokenPipeError:       # it died meanwhile: its exit status says how, as for any trainer
        pass


def launched(spec: RunSpec) -> bool:
    """Whether the job's trainer runs under accelerate's launcher (several processes or nodes)."""
    return spec.processes > 1 or spec.nodes is not None


def trainer_env(spec: RunSpec | None, *, progress: bool, kept_threads: int | None) -> dict[str, str]:
    """The environment a trainer for `spec` gets (None: one process alone), less its pipes."""
    env = python_env()
    env[PARENT_ENV] = str(os.getpid())
    env[PROGRESS_ENV] = "1" if progress else "0"
    if spec is None or not launched(spec):     # alone, whatever a launcher that started grpo-run itself says
        for var in WORLD_ENV:
            env.pop(var, None)
    if spec is not None and spec.nodes is not None:
        env.update(spec.nodes.environment())
    threads = trainer_threads(len(os.sched_getaffinity(0)), env, kept=kept_threads)
    if kept_threads and threads:
        log.info("trainer threads: %s, as the run's first trainer took", threads["OMP_NUM_THREADS"])
    env.update(threads)
    return env


def _popen(command: list[str], env: dict[str, str], work: Path, *, control: bool,
           extra_fds: tuple[int, ...] = ()) -> Spawned:
    """`python COMMAND` in its own session in `work`, with its events pipe (and a control pipe);
    `extra_fds`: more descriptors it inherits (closed here once it has them)."""
    work.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    env = {**env, EVENTS_FD_ENV: str(write_fd)}
    keep = [write_fd, *extra_fds]
    control_r = control_w = None
    if control:
        control_r, control_w = os.pipe()
        env[CONTROL_FD_ENV] = str(control_r)
        keep.append(control_r)
    try:
        proc = subprocess.Popen([sys.executable, *command], env=env, pass_fds=keep, cwd=work, start_new_session=True)
    except BaseException:
        for fd in (read_fd, control_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in keep:
            os.close(fd)
    return Spawned(proc, read_fd, control_w)


def start_trainer(spec: RunSpec, work: Path, plan: Plan, *, progress: bool, kept_threads: int | None,
                  prewarmed: PrewarmedTrainer | None = None) -> Spawned:
    """The trainer for `plan` in its own session: alone (the prewarmed one when it fits, with a
    control pipe: it waits for Spawned.go before its first step), or under accelerate's launcher
    (one rank per GPU, or this node's ranks of several nodes; no pipe: it goes at once).
    `kept_threads`: the run's first trainer's thread count (a run keeps it)."""
    plan_path = work / PLAN_FILE
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(plan_path, plan.to_json().encode())
    env = trainer_env(spec, progress=progress, kept_threads=kept_threads)
    if launched(spec):
        return _popen(["-m", "grpo_run.trainer.launch", str(spec.processes), str(plan_path)], env, work, control=False)
    spawned = prewarmed.take(env, work) if prewarmed is not None else None
    if spawned is None:
        spawned = _popen(["-m", "grpo_run.trainer.child", str(plan_path)], env, work, control=True)
    spawned.plan_written()
    return spawned


def spawn_trainer(spec: RunSpec, work: Path, plan: Plan, *, progress: bool,
                  kept_threads: int | None) -> tuple[subprocess.Popen, int]:
    """A trainer that goes at once (no control pipe): the process and its events pipe's read end
    (runner.supervisor.follower: the ranks of a node other than rank 0's)."""
    plan_path = work / PLAN_FILE
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(plan_path, plan.to_json().encode())
    env = trainer_env(spec, progress=progress, kept_threads=kept_threads)
    command = ["-m", "grpo_run.trainer.launch", str(spec.processes), str(plan_path)] if launched(spec) else \
        ["-m", "grpo_run.trainer.child", str(plan_path)]
    spawned = _popen(command, env, work, control=False)
    return spawned.proc, spawned.events_fd


class PrewarmedTrainer:
    """A trainer process started before its plan exists, waiting for it (see the module's doc).
    Owned by whoever started it: `close` ends it unless an attempt took it."""

    def __init__(self, work: Path, *, progress: bool, model: str | None = None,
                 kept_threads: int | None = None) -> None:
        """`model`: the job's spec.model; a tiny demo model not built on this node yet is built by
        the process while it waits (it imports torch and transformers anyway; `model_path`).
        `kept_threads`: the run's first trainer's thread count, as storage's record says."""
        self.work = Path(work)
        self.env = trainer_env(None, progress=progress, kept_threads=kept_threads)
        extra, fds, self._built_fd = {}, (), None
        if model is not None and is_tiny(model) and not (tiny_model_path(model) / "config.json").exists():
            self._built_fd, write = os.pipe()
            extra = {PREBUILD_ENV: json.dumps({"name": model[len(TINY_PREFIX):], "path": str(tiny_model_path(model))}),
                     PREBUILT_FD_ENV: str(write)}
            fds = (write,)
        self._spawned: Spawned | None = _popen(["-m", "grpo_run.trainer.child", str(self.work / PLAN_FILE)],
                                               {**self.env, **extra}, self.work, control=True, extra_fds=fds)

    def model_path(self, model: str) -> str:
        """`spec.model` resolved as runner.home.ensure_model does, a tiny model this process was
        asked to build waited for first (built here after all if it could not: the error is then
        this node's own)."""
        if self._built_fd is not None:
            fd, self._built_fd = self._built_fd, None
            try:
                ready, _, _ = select.select([fd], [], [], BUILD_WAIT_S)
                said = os.read(fd, 4096).decode(errors="replace").strip() if ready else "no answer"
            finally:
                os.close(fd)
            if said != "ok":
                log.info("the trainer started early did not build %s (%s); building it here", model, said or "it ended")
        return ensure_model(model)

    def take(self, env: dict[str, str], work: Path) -> Spawned | None:
        """The process, for a trainer that would get `env` in `work`; None when it does not fit
        (or has died): then it is ended, and the caller starts one afresh. Only LATE_ENV may differ
        (the trainer reads those once its plan is there, and gets them with it)."""
        spawned, self._spawned = self._spawned, None
        if spawned is None:
            return None
        differ = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k))
        if not set(differ) - set(LATE_ENV) and Path(work) == self.work and spawned.proc.poll() is None:
            spawned.late = {k: env.get(k) for k in differ}
            return spawned
        differ = [k for k in differ if k not in LATE_ENV]
        log.info("the trainer started early does not fit this attempt (%s); starting another",
                 ", ".join(differ) or "it has ended" if Path(work) == self.work else "another work folder")
        _end(spawned)
        return None

    def close(self) -> None:
        """End it, unless an attempt took it."""
        if self._built_fd is not None:
            os.close(self._built_fd)
            self._built_fd = None
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            _end(spawned)


def _end(spawned: Spawned) -> None:
    spawned.give_up()                     # a trainer still waiting for its plan exits by itself
    if spawned.proc.poll() is None:
        spawned.proc.kill()
    spawned.proc.wait()
    os.close(spawned.events_fd)


@contextlib.contextmanager
def prewarmed_trainer(work: Path, *, alone: bool, progress: bool, model: str | None = None,
                      kept_threads: int | None = None) -> Iterator[PrewarmedTrainer | None]:
    """A PrewarmedTrainer in `work` for the job's first attempt, ended on the way out unless an
    attempt took it; None for a job whose trainer runs under a launcher (`alone` False: several
    processes or nodes), or when GRPO_RUN_PREWARM=0 (the node's own setting)."""
    prewarmed = None
    if alone and os.environ.get(PREWARM_ENV) != "0":
        try:
            prewarmed = PrewarmedTrainer(work, progress=progress, model=model, kept_threads=kept_threads)
        except OSError as e:              # no process to spare (fds, memory): the attempt starts its own
            log.warning("could not start the trainer early (%s); it starts when its plan is ready", e)
    try:
        yield prewarmed
    finally:
        if prewarmed is not None:
            prewarmed.close()
