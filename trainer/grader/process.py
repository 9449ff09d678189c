"""The grader's handle on its worker process, from the trainer's side: spawning it, framing
requests and answers over two private pipes, deadlines, reading its crash log, killing it.

`trainer.grader.Grader` decides what to send, when to retry and what to report; this module only
moves frames. The code running inside the worker is `trainer.grader_worker` (the conversation is
described there); the frame format is defined there once and imported here.

    worker = WorkerProcess.spawn(settings)          # `python -m trainer.grader_worker SETTINGS`
    worker.send({"items": [...]}, deadline)         # WorkerGone if it is dead, WorkerOverdue past it
    frame = worker.read(deadline)                   # WorkerGone on EOF, WorkerOverdue past it
    worker.release()                                # SIGKILL, reap, close everything

Besides the pipes, each worker gets a scratch directory (the only place its reward function may
write; removed by release()), its own process group (so kill() takes whatever it started too) and
an environment of its own (`_worker_env`: an allow-list, none of the trainer's credentials). Its
stdout and stderr are one pipe, copied to our stderr by a thread, scrubbed of the trainer's secrets
(`redact`), up to _MAX_OUTPUT_BYTES per worker: a reward function that prints hundreds of MB must
not fill the trainer's log or disk. Past the limit one line says the rest is dropped, and one more,
when the worker ends, how much was. Every text in its frames and its crash log is scrubbed
(`redact.scrub`, the secrets listed once per frame) before anything here returns it, and its error
texts (a failure's "error" and "summary", the crash log) are capped too. A prompt or an observation
is never cut: the episode loop bounds it by tokens (`context`). A frame is checked before it is walked:
a JSON object of the frame format's keys, of at most _MAX_FRAME_VALUES values in all.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from grpo_run.trainer.grader import cgroup
from grpo_run.trainer.grader.reach import SCRATCH_PREFIX, node_places
from grpo_run.trainer.grader.redact import StreamScrubber, cap, clean, scrub, secret_names
from grpo_run.trainer.grader.worker import _HEADER  # the frame header, as the worker writes and reads it

__all__ = ["WorkerGone", "WorkerOverdue", "WorkerProcess"]

_MAX_FRAME_BYTES = 64 * 1024 * 1024  # the worker runs user code: never trust a length blindly
# Values (strings, numbers, lists, objects) in one frame: a reward is one number, a prompt a few
# hundred messages at most; a forged 64 MiB frame of empty strings holds 20 million.
_MAX_FRAME_VALUES = 100_000
# The top-level keys of every frame the worker writes (`worker`, `episodes`)
_FRAME_KEYS = frozenset({"ok", "kind", "error", "type", "mode", "why", "missing", "limits", "summary", "pid", "tools"})
_ERROR_KEYS = ("error", "summary")   # the failure texts: the only ones capped
_READ_AHEAD = 64 * 1024               # bytes a read of the worker's answers takes at most beyond the frame asked for
_MAX_CRASH_LOG_CHARS = 8_000
_MAX_OUTPUT_BYTES = 1 << 20  # of a worker's stdout and stderr, passed on to ours
_OUTPUT_DRAIN_S = 2.0  # release() waits this long for the output pipe's EOF after the kill
_EXIT_WAIT_S = 0.5  # how long a worker whose pipe is at EOF may take to exit before it is killed
# faulthandler's frame lines for the worker's own code and the `-m` machinery under it
_WORKER_FRAME = re.compile(r'^\s*File "(.*[/\\]trainer[/\\]grader[/\\](?:worker|sandbox|namespaces)\.py|<frozen runpy>)", '
                           r'line \d+ in ')
# What the worker's environment keeps of ours: where programs are, the language, Python's own
# behaviour (never PYTHONPATH: the worker imports grpo_run as installed, and a folder there would be
# readable to the reward too). Everything else, credentials above all, stays here.
_KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class WorkerGone(Exception):
    """The worker closed its end of the pipe: it exited or was killed."""


class WorkerOverdue(Exception):
    """The worker did not answer by the deadline."""


class WorkerProcess:
    """One worker process and its pipes: spawning, framing, deadlines, killing."""

    def __init__(
        self,
        proc: subprocess.Popen,
        request_fd: int,
        response_fd: int,
        crash_file: IO[bytes],
        output: _OutputRelay,
        scratch: str,
        tree: cgroup.TreeCgroup | None = None,
    ) -> None:
        self._proc = proc
        self._request_fd = request_fd
        self._response_fd = response_fd
        self._crash_file = crash_file
        self._output = output
        self._scratch = scratch
        self._tree = tree
        self._group_killed = False
        self._unread = bytearray()      # read from the worker, not yet taken as a frame

    @classmethod
    def spawn(cls, settings: dict[str, Any]) -> WorkerProcess:
        """Start `python -m grpo_run.trainer.grader.worker` with `settings` (ref, search_path,
        reward_folder, timeout_s, memory_mb, network, filesystem, signals, strict) plus its scratch
        directory, the node's folders no installation folder may hold (`protected`: `reach`), the
        pipes' and the crash log's file descriptors, and the cgroup it joins where the node has one:
        memory_mb for its processes plus scratch_mb for its scratch tmpfs, for the whole tree."""
        request_r, request_w = os.pipe()
        response_r, response_w = os.pipe()
        output_r, output_w = os.pipe()
        # faulthandler in the worker writes fatal-signal stack dumps here; anonymous, so nothing
        # to clean up on disk.
        crash_file = tempfile.TemporaryFile()
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
        places = node_places()
        tree, _ = cgroup.make(settings["memory_mb"] + settings.get("scratch_mb", 0), settings["max_processes"])
        config = dict(
            settings, scratch=scratch, cgroup=tree.join_settings() if tree else None, request_fd=request_r, response_fd=response_w, crash_fd=crash_file.fileno(),
            protected=[places.home, *places.temp, *places.secrets],
            # die with us: only when started from our main thread (the death signal follows the
            # thread that forked, and a pool's thread may end while the worker is still wanted)
            parent=os.getpid() if threading.current_thread() is threading.main_thread() else 0,
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "grpo_run.trainer.grader.worker", json.dumps(config)],
                pass_fds=(request_r, response_w, crash_file.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=output_w,
                stderr=output_w,
                env=_worker_env(scratch),
                cwd=scratch,
                start_new_session=True,  # its own process group: kill() takes its descendants too
            )
        except BaseException:
            for fd in (request_r, request_w, response_r, response_w, output_r, output_w):
                os.close(fd)
            crash_file.close()
            shutil.rmtree(scratch, ignore_errors=True)
            if tree:
                tree.remove()
            raise
        # Only the child keeps these ends, so its death shows up here as EOF.
        for fd in (request_r, response_w, output_w):
            os.close(fd)
        os.set_blocking(request_w, False)      # send() waits with a deadline, never in write()
        return cls(proc, request_w, response_r, crash_file, _OutputRelay(output_r, proc.pid), scratch, tree)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def send(self, message: dict, deadline: float) -> None:
        """One frame to the worker; raises WorkerGone when it is no longer reading, WorkerOverdue
        when it has not taken the whole frame by `deadline` (a time.monotonic() value), as a read
        does: a reward function that stops reading (and shrinks the pipe) must not block us."""
        payload = json.dumps(message).encode()
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        poller = select.poll()
        poller.register(self._request_fd, select.POLLOUT)
        try:
            while data:
                try:
                    data = data[os.write(self._request_fd, data) :]   # non-blocking: what fits now
                    continue
                except BlockingIOError:
                    pass
                remaining_ms = (deadline - time.monotonic()) * 1000
                if remaining_ms <= 0 or not poller.poll(remaining_ms):
                    raise WorkerOverdue()
        except (BrokenPipeError, OSError) as error:
            raise WorkerGone() from error

    def read(self, deadline: float) -> dict:
        """The next frame; raises WorkerGone on EOF (or a corrupt stream) and WorkerOverdue past
        `deadline` (a time.monotonic() value)."""
        (length,) = _HEADER.unpack(self._read_exactly(_HEADER.size, deadline))
        if length > _MAX_FRAME_BYTES:
            raise WorkerGone()  # corrupt stream (user code wrote to our fd?): treat as dead
        try:
            frame = json.loads(self._read_exactly(length, deadline))
        except (ValueError, RecursionError):  # a forged frame nested past the parser's depth
            raise WorkerGone() from None
        if not _walkable(frame):
            raise WorkerGone()    # not a frame the worker writes: a forged one, treated as a corrupt stream
        try:
            secrets = secret_names()    # once per frame: it costs a glob and a dozen stat calls
            return {key: cap(scrub(value, secrets=secrets)) if key in _ERROR_KEYS and isinstance(value, str)
                    else _scrubbed(value, secrets) for key, value in frame.items()}
        except RecursionError:
            raise WorkerGone() from None

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        # What the worker wrote is read as it comes, up to _READ_AHEAD bytes a read: a batch's
        # frames, written one after another, come in a few reads instead of two each (each a
        # wait for the worker: most of what scoring a cheap reward cost the trainer).
        buffer = self._unread
        poller = None
        while len(buffer) < n:
            if poller is None:
                poller = select.poll()  # not select.select: a trainer can hold more than 1024 fds
                poller.register(self._response_fd, select.POLLIN)
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not poller.poll(remaining_ms):
                raise WorkerOverdue()
            chunk = os.read(self._response_fd, max(n - len(buffer), _READ_AHEAD))
            if not chunk:
                raise WorkerGone()
            buffer += chunk
        taken = bytes(buffer[:n])
        del buffer[:n]
        return taken

    def crash_log(self) -> str:
        """What faulthandler wrote in the worker (stack dumps on fatal signals), if anything,
        without the worker's own frames below the user's."""
        try:
            data = os.pread(self._crash_file.fileno(), _MAX_CRASH_LOG_CHARS * 4, 0)
        except (OSError, ValueError):
            return ""
        lines = data.decode(errors="replace").splitlines(keepends=True)
        kept = [line for line in lines if not _WORKER_FRAME.match(line)]
        return clean("".join(kept)[-_MAX_CRASH_LOG_CHARS:])

    def abort(self, grace_s: float) -> None:
        """SIGABRT (faulthandler dumps the stack, then the process dies); SIGKILL if it won't."""
        if self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGABRT)
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass  # SIGABRT ignored too; kill() below cannot be
        self.kill()

    def kill_after_exit(self) -> None:
        """kill(), once the worker has had _EXIT_WAIT_S to end by itself: its pipe is at EOF, or
        carried what it should not, and it may be on its way out (in a PID namespace the process we
        started is its launcher, which exits a moment after the worker). How the worker ended is what
        the error reports."""
        try:
            self._proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and what it started, unless that left
        the group), reap, close our ends. Idempotent."""
        if not self._group_killed:
            # Also after the worker died: its orphans are still in the group. Its id cannot be
            # reused while any of them lives, and with none left this is ESRCH. Once only: later
            # the id may belong to someone else.
            self._group_killed = True
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._proc.poll() is None:
            self._proc.kill()  # it was no longer its group's leader (the reward function's doing)
        self._proc.wait()
        for fd_name in ("_request_fd", "_response_fd"):
            fd = getattr(self, fd_name)
            if fd >= 0:
                os.close(fd)
                setattr(self, fd_name, -1)
        # The crash log stays open: the error message reads it after the kill.

    def release(self) -> None:
        """kill(), then pass on the rest of its output, close the crash log and remove its scratch
        directory. Idempotent. A worker still there first sees its request pipe close and gets
        _EXIT_WAIT_S to end what its reward started (where it has no PID namespace, its own cleanup
        is what reaches a process that left its group)."""
        if self._proc.poll() is None and self._request_fd >= 0:
            os.close(self._request_fd)
            self._request_fd = -1
            try:
                self._proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._output.close(_OUTPUT_DRAIN_S)
        self._crash_file.close()
        shutil.rmtree(self._scratch, ignore_errors=True)
        if self._tree:
            self._tree.remove()
            self._tree = None

    def memory_hint(self, memory_mb: int) -> str:
        """Why a SIGKILL from outside came, as far as can be known: the tree's cgroup at its limit, or
        (without one) most likely the system out of memory."""
        if self._proc.returncode != -signal.SIGKILL:
            return ""
        if self._tree and self._tree.oom_kills():
            return (f" (the kernel killed it: the reward's processes and scratch together reached their cgroup's "
                    f"limit of {self._tree.memory_bytes >> 20} MiB, twice rewardMemoryMB={memory_mb})")
        return f" (SIGKILL from outside usually means the system ran out of memory; memory_mb={memory_mb})"


class _OutputRelay:
    """A thread copying a worker's stdout and stderr (one pipe) to our stderr, at most
    _MAX_OUTPUT_BYTES of it; the rest is read (so the worker never blocks on a full pipe) and
    counted. Writes to fd 2 itself, where the worker's output went before it had a pipe."""

    def __init__(self, fd: int, pid: int) -> None:
        self._fd = fd
        self._pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"grader-output-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        passed = dropped = 0
        scrubber = StreamScrubber()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                break  # EOF: the worker and everything it started have closed the pipe
            passed, dropped = self._pass_on(scrubber.feed(chunk), passed, dropped)
        passed, dropped = self._pass_on(scrubber.flush(), passed, dropped)
        if dropped:
            _write_stderr(
                f"[grader worker {self._pid}: dropped {_mib(dropped)} ({dropped:,} bytes) of the reward "
                f"function's output, after the first {_mib(_MAX_OUTPUT_BYTES)}]\n".encode()
            )

    def _pass_on(self, chunk: bytes, passed: int, dropped: int) -> tuple[int, int]:
        """Copy what fits under _MAX_OUTPUT_BYTES to our stderr; (passed, dropped) afterwards."""
        if chunk:
            shown = chunk[: max(0, _MAX_OUTPUT_BYTES - passed)]
            if shown:
                passed += len(shown)
                _write_stderr(shown)
            if len(shown) < len(chunk):
                if not dropped:
                    _write_stderr(
                        f"\n[grader worker {self._pid}: its output passed {_mib(_MAX_OUTPUT_BYTES)}; the rest "
                        f"is dropped, and counted when the worker ends]\n".encode()
                    )
                dropped += len(chunk) - len(shown)
        return passed, dropped

    def close(self, drain_s: float) -> None:
        """Wait up to drain_s for the pipe's EOF (what is left in it still passes, or counts), then
        stop and close it. Idempotent."""
        if self._fd < 0:
            return
        self._thread.join(drain_s)  # all of it only when something outside the group holds the pipe
        self._stop.set()
        self._thread.join()
        os.close(self._fd)
        self._fd = -1


def _write_stderr(data: bytes) -> None:
    try:
        while data:
            data = data[os.write(2, data) :]
    except OSError:
        pass  # our own stderr is gone: nothing to tell


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _worker_env(scratch: str) -> dict[str, str]:
    """The worker's whole environment: an allow-list (_KEPT_ENV, LC_*), never a copy of ours with
    things taken out: the trainer holds the node's credentials (AWS_*, HF_TOKEN, WANDB_API_KEY,
    MLFLOW_TRACKING_TOKEN) and GRPO_RUN_* (the supervisor's pid), and a new variable of tomorrow's
    must not reach the reward function either. What the worker needs of ours is in its argv."""
    env = {name: value for name, value in os.environ.items() if name in _KEPT_ENV or name.startswith("LC_")}
    env.setdefault("PATH", _DEFAULT_PATH)
    # A user's trainer/ or state.py next to the worker's folder cannot stand in for ours (cwd= is
    # the scratch directory too); see checkpoint.procs.python_env.
    env["PYTHONSAFEPATH"] = "1"
    # Grading is small sequential work and the trainer owns the cores; BLAS thread pools would also
    # reserve address space that counts against memory_mb.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    # Caches and dotfiles a library writes under ~ land in the scratch directory, removed with it.
    env["HOME"] = env["TMPDIR"] = scratch
    return env


def _walkable(frame: Any) -> bool:
    """True when `frame` is a JSON object of the frame format's keys holding at most
    _MAX_FRAME_VALUES values: counted without recursion, stopping at the limit."""
    if not isinstance(frame, dict) or not frame.keys() <= _FRAME_KEYS:
        return False
    pending, count = [frame], 1
    while pending:
        value = pending.pop()
        if isinstance(value, (dict, list)):
            count += len(value)        # counted before they are taken: a list of 20 M is refused at once
            if count > _MAX_FRAME_VALUES:
                return False
            pending.extend(value.values() if isinstance(value, dict) else value)
    return True


def _scrubbed(value: Any, secrets: list[tuple[str, str]]) -> Any:
    """`value` with every text in it scrubbed of `secrets` (`redact.scrub`), never cut."""
    if isinstance(value, str):
        return scrub(value, secrets=secrets)
    if isinstance(value, dict):
        return {key: _scrubbed(item, secrets) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrubbed(item, secrets) for item in value]
    return value


# how a worker ended, in words -------------------------------------------------------------------


def how_it_died(returncode: int | None) -> str:
    """How the worker ended, in words, from its return code (None: it is still there, not answering)."""
    if returncode is None:
        return "stopped answering"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def section(title: str, text: str) -> str:
    return f"\n{title}:\n{text.rstrip()}" if text.strip() else ""
