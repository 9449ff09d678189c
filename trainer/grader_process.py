"""The grader's handle on its worker process, from the trainer's side: spawning it, framing
requests and answers over two private pipes, deadlines, reading its crash log, killing it.

`trainer.grader.Grader` decides what to send, when to retry and what to report; this module only
moves frames. The code running inside the worker is `trainer.grader_worker` (the conversation is
described there); the frame format is defined there once and imported here.

    worker = WorkerProcess.spawn(settings)          # `python -m trainer.grader_worker SETTINGS`
    worker.send({"items": [...]})                   # WorkerGone if it is dead
    frame = worker.read(deadline)                   # WorkerGone on EOF, WorkerOverdue past it
    worker.release()                                # SIGKILL, reap, close everything
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from checkpoint.procs import python_env
from trainer.grader_worker import _HEADER  # the frame header, as the worker writes and reads it

__all__ = ["WorkerGone", "WorkerOverdue", "WorkerProcess"]

_MAX_FRAME_BYTES = 64 * 1024 * 1024  # the worker runs user code: never trust a length blindly
_MAX_CRASH_LOG_CHARS = 8_000
# faulthandler's frame lines for the worker's own code and the `-m` machinery under it
_WORKER_FRAME = re.compile(r'^\s*File "(.*[/\\]trainer[/\\]grader_worker\.py|<frozen runpy>)", line \d+ in ')


class WorkerGone(Exception):
    """The worker closed its end of the pipe: it exited or was killed."""


class WorkerOverdue(Exception):
    """The worker did not answer by the deadline."""


class WorkerProcess:
    """One worker process and its pipes: spawning, framing, deadlines, killing."""

    def __init__(
        self, proc: subprocess.Popen, request_fd: int, response_fd: int, crash_file: IO[bytes]
    ) -> None:
        self._proc = proc
        self._request_fd = request_fd
        self._response_fd = response_fd
        self._crash_file = crash_file

    @classmethod
    def spawn(cls, settings: dict[str, Any]) -> WorkerProcess:
        """Start `python -m trainer.grader_worker` with `settings` (ref, search_path, timeout_s,
        memory_mb, network) plus the pipes' and the crash log's file descriptors."""
        request_r, request_w = os.pipe()
        response_r, response_w = os.pipe()
        # faulthandler in the worker writes fatal-signal stack dumps here; anonymous, so nothing
        # to clean up on disk.
        crash_file = tempfile.TemporaryFile()
        config = dict(settings, request_fd=request_r, response_fd=response_w, crash_fd=crash_file.fileno())
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.grader_worker", json.dumps(config)],
                pass_fds=(request_r, response_w, crash_file.fileno()),
                stdin=subprocess.DEVNULL,
                env=_worker_env(),
            )
        except BaseException:
            for fd in (request_r, request_w, response_r, response_w):
                os.close(fd)
            crash_file.close()
            raise
        # Only the child keeps these ends, so its death shows up here as EOF.
        os.close(request_r)
        os.close(response_w)
        return cls(proc, request_w, response_r, crash_file)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def send(self, message: dict) -> None:
        """One frame to the worker; raises WorkerGone when it is no longer reading."""
        payload = json.dumps(message).encode()
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        try:
            while data:
                data = data[os.write(self._request_fd, data) :]
        except (BrokenPipeError, OSError) as error:
            raise WorkerGone() from error

    def read(self, deadline: float) -> dict:
        """The next frame; raises WorkerGone on EOF (or a corrupt stream) and WorkerOverdue past
        `deadline` (a time.monotonic() value)."""
        (length,) = _HEADER.unpack(self._read_exactly(_HEADER.size, deadline))
        if length > _MAX_FRAME_BYTES:
            raise WorkerGone()  # corrupt stream (user code wrote to our fd?): treat as dead
        try:
            return json.loads(self._read_exactly(length, deadline))
        except ValueError:
            raise WorkerGone() from None

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        buffer = bytearray()
        poller = select.poll()  # not select.select: a trainer can hold more than 1024 fds
        poller.register(self._response_fd, select.POLLIN)
        while len(buffer) < n:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not poller.poll(remaining_ms):
                raise WorkerOverdue()
            chunk = os.read(self._response_fd, n - len(buffer))
            if not chunk:
                raise WorkerGone()
            buffer += chunk
        return bytes(buffer)

    def crash_log(self) -> str:
        """What faulthandler wrote in the worker (stack dumps on fatal signals), if anything,
        without the worker's own frames below the user's."""
        try:
            data = os.pread(self._crash_file.fileno(), _MAX_CRASH_LOG_CHARS * 4, 0)
        except (OSError, ValueError):
            return ""
        lines = data.decode(errors="replace").splitlines(keepends=True)
        kept = [line for line in lines if not _WORKER_FRAME.match(line)]
        return "".join(kept)[-_MAX_CRASH_LOG_CHARS:]

    def abort(self, grace_s: float) -> None:
        """SIGABRT (faulthandler dumps the stack, then the process dies); SIGKILL if it won't."""
        if self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGABRT)
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass  # SIGABRT ignored too; kill() below cannot be
        self.kill()

    def kill(self) -> None:
        """SIGKILL, reap, close our ends. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for fd_name in ("_request_fd", "_response_fd"):
            fd = getattr(self, fd_name)
            if fd >= 0:
                os.close(fd)
                setattr(self, fd_name, -1)
        # The crash log stays open: the error message reads it after the kill.

    def release(self) -> None:
        """kill(), and close the crash log too."""
        self.kill()
        self._crash_file.close()


def _worker_env() -> dict[str, str]:
    env = python_env()     # the worker runs `-m trainer.grader_worker` from this very package
    # Grading is small sequential work and the trainer owns the cores; BLAS thread pools would also
    # reserve address space that counts against memory_mb.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env

