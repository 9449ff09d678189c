"""The sandboxed grader: scores completions with the user's reward function in another process.

The trainer never grades itself. A worker process (`grpo_run.trainer.grader.worker`, started and
spoken to through `grpo_run.trainer.grader.process`) imports the reward function once and then
scores one batch per request, in a sandbox (`grpo_run.trainer.grader.sandbox`): none of the node's
credentials in its environment, no network and no sockets, reads only of its own folder and the
Python installation, writes only in a scratch directory of its own, no signals to the run's
processes, a memory limit and a time limit per completion. The reward function may be untrusted
code; `Grader.sandbox_mode` says which layers are in force, and `strict=True` refuses to run it
without all of them (SandboxUnavailable). A reward function that raises, hangs, returns something
that is not a finite number within ±MAX_ABS_REWARD, or kills its process is an infrastructure
failure: it is retried (the worker is restarted when it died or hung) and, if it keeps failing,
`Grader.score` raises `RewardFunctionError` carrying the function's own error, scrubbed of the
trainer's secrets and capped (`grpo_run.trainer.grader.redact`). One that does what the sandbox
refuses (reads or writes outside its folders, the network, os.fork()) fails at once, saying what
was refused. It is never recorded as a reward of 0, which would silently teach the policy that the
completion was wrong. What it prints reaches the trainer's stderr, scrubbed, up to 1 MiB per worker.

    with Grader("my_env.rewards:exact_match", timeout_s=5) as grader:
        rewards = grader.score(completions, tasks)      # [B*G] floats, one round trip
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import TracebackType
from typing import Any, Callable, Literal, Mapping, Sequence, get_args

from grpo_run.trainer.grader.layers import LAYERS, SandboxUnavailable, is_sandbox_frame
from grpo_run.trainer.grader.reach import node_places, why_not
from grpo_run.trainer.grader.process import WorkerGone, WorkerOverdue, WorkerProcess, how_it_died, section
from grpo_run.trainer.grader.refs import RewardFunctionError, encode_items, resolve_ref
from grpo_run.trainer.grader.replies import Failure, outcome
from grpo_run.trainer.grader.sandbox import MAX_PROCESSES
from grpo_run.trainer.grader.worker import MAX_ABS_REWARD

__all__ = ["MAX_ABS_REWARD", "Grader", "RewardFunctionError", "SandboxUnavailable"]

log = logging.getLogger(__name__)

NetworkSandbox = Literal["auto", "netns", "python"]
FilesystemSandbox = Literal["auto", "landlock", "python"]
SignalsSandbox = Literal["auto", "landlock", "pidns"]


class Grader:
    """Owns one sandboxed worker process that runs a reward function.

    reward_ref: "package.module:function" (imported in the worker, with search_path entries put
        first on its sys.path) or "/path/to/file.py:function" (loaded by path as a module that is
        not __main__, with the file's folder importable, so a script's main guard stays asleep).
    timeout_s: per completion, enforced with SIGALRM inside the worker; code that ignores it is
        killed kill_grace_s later by the parent (and the worker restarted).
    memory_mb: the worker's address-space limit (RLIMIT_AS); allocating past it raises MemoryError.
    retries: extra tries per completion after the first, so a transient failure (a crash, a flaky
        dependency) costs a retry rather than the run. Waits between rounds: retry_wait_s, through
        `sleep` (injectable so tests do not wait).
    network: "auto" makes an empty network namespace when the kernel allows and otherwise relies on
        seccomp and Python-level refusals; "netns" insists on the namespace; "python" never tries
        it. `Grader.sandbox` says which is in force.
    filesystem: the reward function (and every program it runs) may read only its own folder, the
        Python installation and the system's libraries, and write only in its scratch directory,
        which is its working directory, $TMPDIR and $HOME and is removed with the worker. "auto"
        enforces that with Landlock when the kernel has it and otherwise refuses only what goes
        through Python (a warning says so); "landlock" insists on Landlock; "python" never tries
        it. `Grader.filesystem` says which is in force.
    signals: how the reward function is kept from signalling the run's processes: "auto" takes
        Landlock's signal scope where the kernel has it (Linux 6.12+) and otherwise a PID namespace;
        "landlock" or "pidns" insists on that one.
    strict: refuse to run the reward function (SandboxUnavailable, naming what is missing and how
        to get it) unless every layer is in force: network namespace, Landlock, signals, seccomp.
        False (the library's default for now) runs it with what the node allows, and warns once.
        `Grader.sandbox_mode` says which layers are in force.
    load_timeout_s: how long importing the reward module may take.
    group: the function scores one prompt's group at a time, `fn(completions, task) -> [G numbers]`
        (relative judges, ranking, diversity): `score` gets the groups' sizes. timeout_s is per
        group; a group is retried whole, and one that fails never becomes scores.
    episodes: the ref is an episodes environment's class, served by the worker one object per
        episode (`grpo_run.trainer.episodes.host.EnvironmentHost` speaks to it; `score` does not).

    Raises RewardFunctionError at once when the ref cannot be loaded, SandboxUnavailable when a
    layer that had to be in force is not, ValueError for bad settings.
    """

    def __init__(
        self,
        reward_ref: str,
        *,
        search_path: Sequence[str] = (),
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        retries: int = 2,
        network: NetworkSandbox = "auto",
        filesystem: FilesystemSandbox = "auto",
        signals: SignalsSandbox = "auto",
        strict: bool = False,
        group: bool = False,
        episodes: bool = False,
        kill_grace_s: float = 2.0,
        load_timeout_s: float = 60.0,
        retry_wait_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        problems = [
            f"{name}: must be > 0 (got {value})"
            for name, value in [
                ("timeout_s", timeout_s),
                ("kill_grace_s", kill_grace_s),
                ("load_timeout_s", load_timeout_s),
            ]
            if not value > 0
        ]
        if memory_mb < 64:
            problems.append(f"memory_mb: must be >= 64 (got {memory_mb}): the interpreter alone needs ~20 MB")
        if retries < 0:
            problems.append(f"retries: must be >= 0 (got {retries})")
        if retry_wait_s < 0:
            problems.append(f"retry_wait_s: must be >= 0 (got {retry_wait_s})")
        if network not in get_args(NetworkSandbox):
            problems.append(f"network: must be 'auto', 'netns' or 'python' (got {network!r})")
        if filesystem not in get_args(FilesystemSandbox):
            problems.append(f"filesystem: must be 'auto', 'landlock' or 'python' (got {filesystem!r})")
        if signals not in get_args(SignalsSandbox):
            problems.append(f"signals: must be 'auto', 'landlock' or 'pidns' (got {signals!r})")
        if strict and "python" in (network, filesystem):
            problems.append("strict: cannot be combined with network='python' or filesystem='python', which turn a "
                            "layer of the sandbox off")
        if problems:
            raise ValueError("; ".join(problems))

        self.reward_ref = reward_ref
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.retries = retries
        self._ref = resolve_ref(reward_ref)
        self._search_path, self._reward_folder = self._reach([os.path.abspath(p) for p in search_path])
        self._network = network
        self._filesystem_setting = filesystem
        self._signals = signals
        self._strict = strict
        self.group = group
        self.episodes = episodes
        self._kill_grace_s = kill_grace_s
        self._load_timeout_s = load_timeout_s
        self._retry_wait_s = retry_wait_s
        self._sleep = sleep
        self._lock = threading.Lock()  # one batch at a time: the pipe carries one conversation
        self._groups: dict[int, int] = {}  # the batch being scored: {first completion: group size}
        self._closed = False
        self._worker: WorkerProcess | None = None
        self._mode: dict[str, str] = {}
        self._limits: dict[str, str] = {}
        self._why: dict[str, str] = {}
        # Started now so that a bad ref fails before any GPU time is spent, not at the first step.
        self._worker = self._start_worker()

    # public ------------------------------------------------------------------------------------

    @property
    def sandbox_mode(self) -> dict[str, str]:
        """The layers of the sandbox in force, for the trainer's events and the run's record:
        {"network": "netns" (no network interfaces at all) | "python",
         "filesystem": "landlock" (reads and writes confined in the kernel, for every process the
             reward function starts too) | "python" (only what goes through Python is refused),
         "signals": "landlock" (Landlock's scope) | "pidns" (a PID namespace of its own) | "none",
         "seccomp": "on" (no sockets but socketpair, no reading other processes) | "off"}.
        A layer's second value (or "none", "off") means it is not in force; `sandbox_gaps` says why.
        The live worker's; a restarted worker that differs is warned about."""
        return dict(self._mode)

    @property
    def sandbox_limits(self) -> dict[str, str]:
        """What bounds the reward's whole process tree, in words (the worker's own report):
        {"contained": how every process it starts ends with the worker, "processes": the cap on
        how many at once, "scratch": its scratch folder's size, "file size": RLIMIT_FSIZE}; "" where
        nothing holds on this node."""
        return dict(self._limits)

    @property
    def sandbox_gaps(self) -> dict[str, str]:
        """{layer: why it is not (fully) in force, in words}; empty when every layer is."""
        return dict(self._why)

    @property
    def sandbox(self) -> str:
        """The network isolation in force: "netns" or "python" (sandbox_mode["network"])."""
        return self._mode.get("network", "")

    @property
    def filesystem(self) -> str:
        """The filesystem confinement in force: "landlock" or "python" (sandbox_mode["filesystem"])."""
        return self._mode.get("filesystem", "")

    @property
    def worker_pid(self) -> int | None:
        """The live worker's pid, or None between a crash and the restart, and after close()."""
        return self._worker.pid if self._worker is not None else None

    def score(self, completions: Sequence[str], tasks: Sequence[Mapping[str, Any]],
              groups: Sequence[int] | None = None) -> list[float]:
        """One reward per completion, fn(completions[i], tasks[i]), in order; for a group
        function, fn(one group's completions, its task) per group, `groups` the sizes of the
        consecutive groups (None: each completion alone).

        Raises RewardFunctionError when a completion (a group) failed on all 1 + retries tries
        (the last error is reported), TypeError/ValueError when the inputs cannot be sent to the
        worker (tasks must be JSON-compatible; tuples arrive as lists) or the groups do not add
        up, RuntimeError after close().
        """
        if len(completions) != len(tasks):
            raise ValueError(
                f"got {len(completions)} completions but {len(tasks)} tasks; need one task per completion"
            )
        sizes = list(groups) if groups is not None else [1] * len(completions)
        if sum(sizes) != len(completions) or any(size < 1 for size in sizes):
            raise ValueError(f"groups {sizes} do not split {len(completions)} completions into groups of 1 or more")
        items = encode_items(completions, tasks)
        self._groups = {}
        start = 0
        for size in sizes:
            self._groups[start] = size
            start += size
        with self._lock:
            if self._closed:
                raise RuntimeError("Grader.score called after close()")
            rewards: list[float | None] = [None] * len(items)
            tries = [0] * len(items)
            before: dict[int, Failure] = {}
            while pending := [i for i, reward in enumerate(rewards) if reward is None]:
                outcomes = self._score_pass(pending, items)
                failed = False
                for i, outcome in outcomes.items():
                    if isinstance(outcome, float):
                        rewards[i] = outcome
                        continue
                    failed = True
                    tries[i] += 1
                    again = _same_again(before.get(i), outcome)
                    if tries[i] > self.retries or outcome.kind == "refused" or again:  # a retry is refused again
                        raise self._give_up(i, len(items), tries[i], outcome, again=again)
                    before[i] = outcome
                if failed and self._retry_wait_s:
                    self._sleep(self._retry_wait_s)
            return [reward for reward in rewards if reward is not None]

    def close(self) -> None:
        """Kill the worker. Idempotent; the Grader cannot score afterwards."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.release()
                self._worker = None

    def __enter__(self) -> Grader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A forgotten close() must not leave an orphan worker behind.
        worker = getattr(self, "_worker", None)
        if worker is not None:
            try:
                worker.release()
            except Exception:
                pass  # at interpreter shutdown modules may already be half torn down

    # internals ---------------------------------------------------------------------------------

    def _start_worker(self) -> WorkerProcess:
        """A fresh worker with the reward function loaded. Load failures are not retried:
        importing the same module again fails the same way."""
        worker = WorkerProcess.spawn(
            {
                "ref": self._ref,
                "search_path": self._search_path,
                "reward_folder": self._reward_folder,
                "timeout_s": self.timeout_s,
                "memory_mb": self.memory_mb,
                "scratch_mb": self.memory_mb,     # a tmpfs: memory too, so the same budget
                "max_processes": MAX_PROCESSES,
                "network": self._network,
                "filesystem": self._filesystem_setting,
                "signals": self._signals,
                "strict": self._strict,
                "group": self.group,
                "episodes": self.episodes,
                **self._more_config(),
            }
        )
        deadline = time.monotonic() + self._load_timeout_s
        try:
            hello = worker.read(deadline)  # written before any of the reward's code ran
            if hello.get("type") != "load_error":  # that one: setting the sandbox up failed
                if not is_sandbox_frame(hello):
                    raise WorkerGone()
                self._note_sandbox(hello["mode"], hello["why"])
                limits = hello.get("limits")
                self._limits = {k: v for k, v in limits.items() if isinstance(k, str) and isinstance(v, str)} \
                    if isinstance(limits, dict) else {}
                if hello["missing"]:
                    worker.release()
                    raise SandboxUnavailable.of(self.reward_ref, hello["mode"], hello["why"], hello["missing"],
                                                strict=self._strict)
                hello = worker.read(deadline)
        except WorkerGone:
            hello = {"type": "died"}
        except WorkerOverdue:
            worker.abort(self._kill_grace_s)
            detail = (
                f"importing it took longer than load_timeout_s={self._load_timeout_s:g}"
                f"{section('It was here', worker.crash_log())}"
            )
            worker.release()
            raise RewardFunctionError(
                f"cannot load reward function {self.reward_ref!r}: {detail}", ref=self.reward_ref, kind="hung"
            ) from None
        if hello.get("type") == "ready":
            self._ready(hello, worker)
            return worker
        worker.kill_after_exit()
        error, kind, summary = hello.get("error"), hello.get("kind"), hello.get("summary")
        if not (isinstance(error, str) and kind in ("exception", "refused")):
            error = (
                f"the worker process {how_it_died(worker.returncode)} while loading it"
                f"{section('Crash report', worker.crash_log())}"
            )
            kind = "crashed"
        worker.release()
        raise RewardFunctionError(f"cannot load reward function {self.reward_ref!r}:\n{error}", ref=self.reward_ref,
                                  kind=kind, summary=summary if isinstance(summary, str) and kind != "crashed" else None)

    def _more_config(self) -> dict[str, Any]:
        """What a subclass adds to the worker's config (EnvironmentHost: its tools)."""
        return {}

    def _ready(self, hello: dict[str, Any], worker: WorkerProcess) -> None:
        """The worker's ready frame, for a subclass to read (EnvironmentHost: its tools' schemas)."""

    def _reach(self, search_path: list[str]) -> tuple[list[str], bool]:
        """The search path the reward may be given to read, and whether its file's folder too
        (`reach`: never the node's home, temporary or GRPO_RUN_HOME folders, nor secrets); what is
        left out is said once."""
        places = node_places()
        kept, dropped = [], []
        for folder in search_path:
            why = why_not(folder, places)
            (dropped.append(f"{folder} ({why})") if why else kept.append(folder))
        target = self._ref.rpartition(":")[0]
        folder_ok = True
        if target.endswith(".py") or os.sep in target:
            why = why_not(os.path.dirname(target), places)
            folder_ok = why is None
            if why:
                dropped.append(f"{os.path.dirname(target)} ({why}; the reward gets its own file alone)")
        if dropped:
            log.warning("reward function %r is not given these folders to read: %s; put what it needs next to its "
                        "file, in a folder of the job's own", self.reward_ref, "; ".join(dropped))
        return kept, folder_ok

    def _note_sandbox(self, mode: dict[str, str], why: dict[str, str]) -> None:
        """Keep the worker's sandbox mode; warn once when a layer is not in force, and when a
        restarted worker's differs."""
        if self._mode and mode != self._mode:
            log.warning("the grader's sandbox for reward function %r changed with its restarted worker: %s -> %s",
                        self.reward_ref, self._mode, mode)
        elif not self._mode and why and not self._strict:
            log.warning(
                "the grader cannot keep reward function %r fully sandboxed, and runs it anyway (strict=False): %s",
                self.reward_ref,
                "; ".join(f"{layer}: {LAYERS[layer][-1]} ({text})" for layer, text in why.items()),
            )
        self._mode, self._why = dict(mode), dict(why)

    def _score_pass(self, pending: list[int], items: list[list[Any]]) -> dict[int, float | Failure]:
        """Send the pending items in one request and collect what comes back.

        The worker stops at the first failure (as it does when it crashes or hangs): items after
        it get no outcome, were never tried, and go into the next pass without using up a try.
        """
        if self._worker is None:
            self._worker = self._start_worker()
        worker = self._worker
        outcomes: dict[int, float | Failure] = {}
        request: dict[str, Any] = {"items": [items[i] for i in pending]}
        if self.group:      # pending is whole groups: each group's outcomes are all rewards, or a failure
            waiting = set(pending)
            request["groups"] = [size for start, size in self._groups.items() if start in waiting]
        try:
            worker.send(request, time.monotonic() + self.timeout_s + self._kill_grace_s)
        except WorkerGone:
            pass  # it died while idle or mid-request; reading reports how
        except WorkerOverdue:    # it stopped reading requests: its reward code holds the worker
            outcomes[pending[0]] = self._restart_after(worker, "hung")
            return outcomes
        for i in pending:
            try:
                frame = worker.read(time.monotonic() + self.timeout_s + self._kill_grace_s)
            except WorkerGone:
                outcomes[i] = self._restart_after(worker, "crashed")
                break
            except WorkerOverdue:
                outcomes[i] = self._restart_after(worker, "hung")
                break
            outcomes[i] = result = outcome(frame)
            if isinstance(result, Failure):
                break
        return outcomes

    def _restart_after(self, worker: WorkerProcess, kind: Literal["crashed", "hung"]) -> Failure:
        """Put the dead or stuck worker down (the next pass starts a new one) and say what happened."""
        if kind == "hung":
            # SIGABRT first: faulthandler in the worker prints where the code is stuck.
            worker.abort(self._kill_grace_s)
            detail = (
                f"did not return within timeout_s={self.timeout_s:g} and ignored the in-process "
                f"timeout (stuck in C code, or SIGALRM ignored or caught); the grader worker was "
                f"killed after {self.timeout_s + self._kill_grace_s:g} s"
                f"{section('Where it was stuck', worker.crash_log())}"
            )
        else:
            worker.kill_after_exit()
            detail = (
                f"the grader worker process {how_it_died(worker.returncode)} while running it"
                f"{worker.memory_hint(self.memory_mb)}"
                f"{section('Crash report', worker.crash_log())}"
            )
        worker.release()
        self._worker = None
        return Failure(kind, detail)

    def _give_up(self, index: int, total: int, tries: int, failure: Failure, again: bool = False) -> RewardFunctionError:
        if failure.kind == "refused":
            return RewardFunctionError(
                f"reward function {self.reward_ref!r} did what the grader refuses, on completion "
                f"{index} of {total} (not retried: it would be refused again):\n{failure.detail.rstrip()}",
                ref=self.reward_ref,
                index=index,
                kind=failure.kind,
            )
        what, detail = failure.describe(self.timeout_s, invalid="returned a non-number")
        if failure.kind == "invalid":
            detail = f"{self._ref.rpartition(':')[2]} {detail}"
        on_tries = "on its only try" if tries == 1 else f"on all {tries} tries"
        on_tries = (f"twice with the same error, so not again (retries={self.retries} are for failures a retry "
                    f"can pass; this one is the code's own)") if again else f"{on_tries} (retries={self.retries})"
        size = self._groups.get(index, 1) if self.group else 1
        where = f"the group of completions {index}-{index + size - 1}" if size > 1 else f"completion {index}"
        return RewardFunctionError(
            f"reward function {self.reward_ref!r} {what} on {where} of {total}, "
            f"{on_tries}; the last error:\n{detail.rstrip()}",
            ref=self.reward_ref,
            index=index,
            kind=failure.kind,
        )


def _same_again(before: Failure | None, now: Failure) -> bool:
    """A raise or a non-number that repeats word for word on the same completion is the code's own
    (int('') raises every time): retrying it again only costs time. Timeouts, hangs and crashes
    depend on the node (its load, its memory) and keep their retries."""
    return (before is not None and now.kind in ("exception", "invalid")
            and (before.kind, before.detail) == (now.kind, now.detail))
