"""The checkpoint writer: a process of its own that turns a snapshot in shared memory into a
sealed local checkpoint, so checkpoint I/O never holds the trainer's GIL. Uploading is not its
job: the supervisor (runner/) uploads what it seals.

Why a process: in threads, every write, fsync and hash of a checkpoint hands Python's GIL back
and forth with the training thread. On the demo's 50 ms steps on 2 cores that cost +26% per
step with a checkpoint after every step, more than the work itself; in a process of its own the
same work costs the trainer only the copy into shared memory.

    trainer (CheckpointWriter)                       writer (`python -m checkpoint.writer`)
    copy tensors into the shared buffer  --request-->  write the files from the buffer
    (waits only while the previous                     <--released--  (the buffer is free again)
     snapshot is still being read)                     fsync, manifest (sha256), rename, prune
                                         <--sealed---

A request describes the checkpoint's files (`layout`): text, or safetensors files whose tensors
lie at given offsets of the buffer. The buffer is a memfd (not /dev/shm, which containers often
cap at 64 MiB) the writer inherits. Requests and replies are JSON lines on its stdin and stdout.
Each checkpoint is hashed here, once, when it is sealed; everyone after trusts its manifest.

The writer dies with the trainer (PR_SET_PDEATHSIG), ignores SIGINT and SIGTERM (the trainer decides when to
stop), and ends when its stdin closes or on a `close` request, after what is queued.
"""

from __future__ import annotations

import ctypes
import json
import logging
import logging.handlers
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter

from .manifest import FINITE_META, KEEP_CHECKPOINTS, checkpoint_dir, finalize_checkpoint, prune, staging_dir
from .procs import die_with_parent, python_env

log = logging.getLogger(__name__)

Layout = dict[str, dict[str, Any]]   # relative path -> {"text": str} | {"tensors": [...], "metadata": {...}}


class WriterDied(RuntimeError):
    """The writer process ended without being asked to (killed, out of memory)."""


# --- the lines: requests on the writer's stdin, replies on its stdout -----------------------------

class Write(BaseModel):
    """Write the checkpoint of `step` from the buffer (`size` bytes) and seal it."""
    op: Literal["checkpoint"] = "checkpoint"
    step: int
    size: int
    files: Layout


class Close(BaseModel):
    """Finish what is queued, then end."""
    op: Literal["close"] = "close"


class Released(BaseModel):
    """The snapshot of `released` was read out of the buffer: the trainer may fill it again."""
    released: int


class Sealed(BaseModel):
    """Checkpoint `sealed` is sealed on the local disk."""
    sealed: int


class Failed(BaseModel):
    """Checkpoint `failed` could not be written: `error`, and its errno where it had one (ENOSPC)."""
    failed: int
    error: str
    errno: int | None = None


class Closed(BaseModel):
    """The writer ends: nothing follows."""
    closed: Literal[True] = True


Request = Annotated[Union[Write, Close], Field(discriminator="op")]
Reply = Union[Released, Sealed, Failed, Closed]
_REQUEST: TypeAdapter[Request] = TypeAdapter(Request)
_REPLY: TypeAdapter[Reply] = TypeAdapter(Reply)


def _line(message: BaseModel) -> str:
    return message.model_dump_json() + "\n"


# A float is NaN or infinite exactly when every bit of its exponent is set (IEEE 754; bfloat16 is
# float32's upper half): (the unsigned integer of its width, the exponent's mask).
_EXPONENT_BITS = {"float64": ("<u8", 0x7FF0000000000000), "float32": ("<u4", 0x7F800000),
                  "float16": ("<u2", 0x7C00), "bfloat16": ("<u2", 0x7F80)}
_CHECK_CHUNK = 1 << 22          # elements per pass: the check's temporaries stay small


def weights_finite(layout: Layout, buffer: Any) -> bool | None:
    """Whether every floating-point tensor of a checkpoint (weights, optimizer moments) holds
    finite numbers only; None when one has a float type this cannot read (float8), so nothing is
    claimed. Reads the exponent bits in place, in chunks: no copy of the snapshot."""
    import numpy as np

    known = True
    for spec in layout.values():
        for name, dtype, shape, offset, nbytes in spec.get("tensors", ()):
            if dtype not in _EXPONENT_BITS:
                known = known and not dtype.startswith(("float", "bfloat", "complex"))
                continue
            kind, mask = _EXPONENT_BITS[dtype]
            width = np.dtype(kind).itemsize
            count = nbytes // width
            for start in range(0, count, _CHECK_CHUNK):
                n = min(_CHECK_CHUNK, count - start)
                bits = np.frombuffer(buffer, dtype=kind, count=n, offset=offset + start * width)
                if np.any((bits & np.array(mask, dtype=kind)) == mask):
                    return False
    return True if known else None


def write_files(folder: Path, layout: Layout, buffer: Any) -> None:
    """Write a checkpoint's files into `folder` (not fsynced: `finalize_checkpoint` does that).

    Safetensors entries are `[name, dtype, shape, offset, nbytes]`: the tensor's bytes lie at
    `offset` in `buffer` (a writable bytearray or mmap), dtype as torch names it ("float32")."""
    from safetensors import TensorSpec, serialize_file

    anchor = ctypes.c_char.from_buffer(buffer) if len(buffer) else None   # the buffer's address
    base = ctypes.addressof(anchor) if anchor is not None else 0
    try:
        for path, spec in layout.items():
            dest = folder / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if "text" in spec:
                dest.write_text(spec["text"])
                continue
            tensors = {}
            for name, dtype, shape, offset, nbytes in spec["tensors"]:
                if offset + nbytes > len(buffer):
                    raise ValueError(f"{path}: {name} lies outside the snapshot buffer")
                tensors[name] = TensorSpec(dtype=dtype, shape=shape, data_ptr=base + offset, data_len=nbytes)
            serialize_file(tensors, str(dest), metadata=spec.get("metadata") or None)
    finally:
        del anchor       # an mmap cannot be resized or closed while its address is exported


class CheckpointWriter:
    """The trainer's side: owns the writer process, the shared buffer and the replies.

        writer = CheckpointWriter(work / "checkpoints", keep=3, meta={"job": name})
        buf = writer.buffer(nbytes)              # waits until the previous snapshot was read
        ... copy tensors into buf ...
        writer.submit(step, layout)
        for event in writer.poll(): ...          # {"sealed": step} / {"failed": step, ...}

    Events (dicts, in the order they happened): `{"sealed": step}` once the checkpoint is
    sealed on the local disk; `{"failed": step, "error": str}` when it could not be written.
    Raises WriterDied when the process is gone unasked."""

    def __init__(self, root: Path, *, keep: int = KEEP_CHECKPOINTS, meta: dict[str, Any] | None = None,
                 log_file: Path | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)      # also the writer's working folder
        self._fd = _shared_fd(self.root)
        self._size = 0
        self._map: mmap.mmap | None = None
        self._busy: int | None = None         # the step whose snapshot the writer is still reading
        self._events: list[dict[str, Any]] = []
        self._pending = b""
        self._closing = False                 # close() asked it to end: its exit is no death
        args = [sys.executable, "-m", "grpo_run.checkpoint.writer", "--fd", str(self._fd), "--root", str(self.root),
                "--keep", str(keep), "--parent", str(os.getpid()), "--meta", json.dumps(meta or {})]
        if log_file is not None:
            args += ["--log", str(log_file)]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[self._fd],
                                      env=python_env(), cwd=self.root)
        os.set_blocking(self._proc.stdout.fileno(), False)

    # --- requests ----------------------------------------------------------------------------

    def buffer(self, nbytes: int) -> mmap.mmap:
        """The shared buffer, at least `nbytes` long, once the writer has read the previous
        snapshot out of it. Grown (never shrunk) as needed."""
        self._wait(lambda: self._busy is None, None)
        if nbytes > self._size or self._map is None:
            if self._map is not None:
                self._map.close()
            self._size = max(nbytes, self._size, mmap.PAGESIZE)
            os.ftruncate(self._fd, self._size)
            self._map = mmap.mmap(self._fd, self._size)
        return self._map

    def submit(self, step: int, layout: Layout) -> None:
        """Write the checkpoint of `step` from the buffer and seal it."""
        self._busy = step
        self._send(Write(step=step, size=self._size, files=layout))

    # --- replies -----------------------------------------------------------------------------

    def poll(self) -> list[Sealed | Failed | Closed]:
        """The events since the last call, without waiting. Raises WriterDied once the process
        has ended unasked (the trainer polls every step: it stops at once, not at the next
        checkpoint, so no more steps are trained that nothing could save)."""
        self._read(0)
        if not self._closing and self._proc.poll() is not None:
            self._read(0)
            raise WriterDied(f"the checkpoint writer process ended (status {self._proc.returncode}); "
                             "its error is in the log above")
        events, self._events = self._events, []
        return events

    def wait_sealed(self, step: int, timeout: float | None = None) -> list[Sealed | Failed | Closed]:
        """Wait until checkpoint `step` is sealed or has failed, or `timeout`; returns every
        event since the last poll (the caller sees which)."""
        def ended() -> bool:
            return any((isinstance(e, Sealed) and e.sealed >= step) or (isinstance(e, Failed) and e.failed >= step)
                       for e in self._events)
        self._wait(ended, timeout)
        return self.poll()

    def close(self, timeout: float | None = None) -> list[Sealed | Failed]:
        """Let the writer finish what is queued, then end it. Returns the events not yet
        polled. Closing twice is harmless."""
        if self._fd < 0:
            return []
        self._closing = True
        if self._proc.poll() is None:
            try:
                self._send(Close())
                self._wait(lambda: any(isinstance(e, Closed) for e in self._events), timeout)
            except WriterDied:
                pass
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        while self._read(0):          # what it said before it ended
            pass
        events = [e for e in self.poll() if not isinstance(e, Closed)]
        try:
            self._proc.stdin.close()
        except BrokenPipeError:       # a request it died before reading is still buffered: dropped
            pass
        self._proc.stdout.close()
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return events

    def _send(self, request: Write | Close) -> None:
        try:
            self._proc.stdin.write(_line(request).encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise WriterDied(f"the checkpoint writer process ended (status {self._proc.wait()})") from None

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if not self._read(left if left is not None else 1.0) and self._proc.poll() is not None:
                self._read(0)
                if not done():
                    raise WriterDied(f"the checkpoint writer process ended (status {self._proc.returncode}); "
                                     "its error is in the log above")
        return True

    def _read(self, timeout: float) -> bool:
        """Read what the writer has said within `timeout`; False when nothing came."""
        fd = self._proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return False
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            return False
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            event = _REPLY.validate_json(line)
            if isinstance(event, Released):
                if event.released == self._busy:
                    self._busy = None
                continue
            self._events.append(event)
        return True


def _shared_fd(root: Path) -> int:
    """A file descriptor for the shared buffer: a memfd on Linux; elsewhere an unlinked file
    under `root` (the page cache shares it just the same)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("grpo-run-snapshot", 0)
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".snapshot-buffer-", dir=root)
    os.unlink(path)
    return fd


# --- the writer process ----------------------------------------------------------------------


def _serve(args) -> int:
    root = Path(args.root)
    meta = json.loads(args.meta)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                        # a stray print must not corrupt the replies

    def reply(event: Released | Sealed | Failed | Closed) -> None:
        replies.write(_line(event))

    buffer: mmap.mmap | None = None
    kept: list[int] = []
    for line in sys.stdin:
        request = _REQUEST.validate_json(line)
        if isinstance(request, Close):
            break
        step = request.step
        final = checkpoint_dir(root, step)
        try:
            if final.exists():            # the same step again (a stop right after a checkpoint)
                reply(Released(released=step))
            else:
                if buffer is None or len(buffer) != request.size:
                    if buffer is not None:
                        buffer.close()
                    buffer = mmap.mmap(args.fd, request.size)
                staging = staging_dir(root, step)
                if staging.exists():
                    shutil.rmtree(staging)
                staging.mkdir(parents=True)
                try:
                    write_files(staging, request.files, buffer)
                    finite = weights_finite(request.files, buffer)
                finally:
                    reply(Released(released=step))
                # "finite": checked here, at seal time; prune never removes the newest such one
                finalize_checkpoint(staging, final, step=step,
                                    meta=meta if finite is None else {**meta, FINITE_META: finite})
                kept = prune(root, keep=args.keep, trusted={*kept, step})
            reply(Sealed(sealed=step))
        except Exception as exc:     # reported to the trainer, which stops the run on it
            log.error("checkpoint %d could not be written: %s", step, exc)
            reply(Failed(failed=step, error=f"{type(exc).__name__}: {exc}", errno=getattr(exc, "errno", None)))
    reply(Closed())
    return 0


WRITER_NICE = 10


def _lower_priority() -> None:
    """Nice 10: the writer runs mostly on CPU time the trainer leaves, yet is never starved.
    Against a busy trainer it still gets about a tenth of a core, so checkpoints keep becoming
    durable. (SCHED_IDLE, tried first, starved it outright on a busy node: a test killed at
    step 8 found no checkpoint in storage.) At normal priority the writer took about 0.6 ms of
    step time for every ms of its own CPU on the demo's 50 ms steps on 2 cores."""
    try:
        os.nice(WRITER_NICE)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="grpo-run's checkpoint writer (started by the trainer)")
    ap.add_argument("--fd", type=int, required=True, help="the shared snapshot buffer (a memfd)")
    ap.add_argument("--root", required=True, help="the local checkpoints folder")
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--parent", type=int, required=True, help="the trainer's pid: the writer dies with it")
    ap.add_argument("--meta", default="{}", help="JSON for every manifest's meta")
    ap.add_argument("--log", help="append INFO and above here (warnings also go to stderr)")
    args = ap.parse_args(argv)

    # The trainer decides when to stop: a terminal's Ctrl-C, or a SIGTERM sent to the trainer's
    # whole process group (torchrun's agent stops a rank with killpg), must not end a checkpoint
    # half-written; the writer still dies with the trainer (below) and ends on `close`.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _lower_priority()
    die_with_parent()
    if os.getppid() != args.parent:       # the trainer died before the line above
        return 1
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(to_terminal)
    if args.log:
        # the trainer rotates that file (trainer.logs): this process follows the name, never rotates it
        to_file = logging.handlers.WatchedFileHandler(args.log)
        to_file.setFormatter(fmt)
        root.addHandler(to_file)
        logging.getLogger("grpo_run.checkpoint").setLevel(logging.INFO)
    try:
        return _serve(args)
    except BrokenPipeError:       # the trainer is gone (killed with its node): nobody to tell
        return 0


__all__ = ["CheckpointWriter", "Layout", "WriterDied", "weights_finite", "write_files"]


if __name__ == "__main__":
    sys.exit(main())
