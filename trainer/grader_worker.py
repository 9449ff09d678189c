"""The grader's worker process: runs the user's reward function in a sandbox.

Started by `trainer.grader.Grader` as `python -m trainer.grader_worker CONFIG_JSON`; never run by
hand. It talks to its parent over two private pipes (file descriptors named in the config), with
length-prefixed JSON frames, so a reward function that prints cannot corrupt the protocol: fd 1 is
pointed at stderr before any user code runs.

Conversation:
    worker -> parent  {"type": "ready", "sandbox": "netns"|"python", "pid": N}
                   or {"type": "load_error", "error": TEXT}            (then the worker exits)
    parent -> worker  {"items": [[completion, task], ...]}             (one request per batch)
    worker -> parent  one frame per item, in order, as soon as it is scored, up to and including
                      the first failure:
                      {"ok": FLOAT} or {"kind": "exception"|"timeout"|"invalid", "error": TEXT}
A closed request pipe means the parent is gone or done: the worker exits.

Sandbox, set up before the reward module is imported so its top level is confined too:
  * network: a fresh network namespace (no interfaces up, not even loopback) when the kernel lets
    us make one, otherwise Python-level blocking of sockets and name lookups (best effort: code
    that shells out or uses ctypes gets past it);
  * memory: RLIMIT_AS, so allocations past the limit raise MemoryError;
  * time: SIGALRM per completion raises `RewardTimeout` inside the user's code. Code that never
    returns to the interpreter (stuck in C, or ignoring SIGALRM) is the parent's job: it sends
    SIGABRT, which faulthandler turns into a dump of where the code was stuck, then SIGKILL.

Deliberately light: stdlib only, and nothing from the trainer (no torch).
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import importlib.util
import json
import math
import os
import re
import resource
import signal
import socket
import struct
import sys
import traceback
from types import TracebackType
from typing import Any, Callable

_HEADER = struct.Struct(">I")  # big-endian payload length in bytes
_MAX_ERROR_CHARS = 20_000  # a runaway traceback must not flood the trainer's logs
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000

RewardFn = Callable[[str, dict], Any]


class RewardTimeout(BaseException):
    """Raised inside the user's code when its time is up.

    A BaseException so that a reward function's own `except Exception:` does not swallow it.
    """


# protocol -------------------------------------------------------------------------------------


def write_frame(fd: int, message: dict) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, remaining = [], n
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict | None:
    """The next message from the parent, or None when the parent closed the pipe."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if payload is None else json.loads(payload)


# sandbox --------------------------------------------------------------------------------------


def _enter_network_namespace() -> bool:
    """Move this process into an empty network namespace; False when the kernel refuses.

    A new user namespace comes first where allowed, even for root: in it the reward code holds no
    capabilities over the host, so it cannot setns() its way back into the host's network
    namespace (real root could). Mapping our own uid/gid keeps file ownership as before. Where
    user namespaces are off, root (CAP_SYS_ADMIN) can still unshare the network alone.
    unshare(CLONE_NEWUSER) needs a single-threaded process: call this before starting threads.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        try:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        except OSError:
            pass  # still cut off from the network; only the uid the reward code sees differs
        return True
    return libc.unshare(_CLONE_NEWNET) == 0


def _network_disabled(*_args: Any, **_kwargs: Any) -> Any:
    raise PermissionError("network access is disabled in the grader")


class _NoNetworkSocket(socket.socket):
    """socket.socket that refuses every family but AF_UNIX (multiprocessing needs that one)."""

    def __init__(self, family: Any = -1, type: Any = -1, proto: Any = -1, fileno: Any = None):
        if fileno is None and family != socket.AF_UNIX:  # -1, the default, means AF_INET
            _network_disabled()
        super().__init__(family, type, proto, fileno)


def _block_network_in_python() -> None:
    socket.socket = _NoNetworkSocket  # type: ignore[misc]
    for name in (
        "create_connection",
        "create_server",
        "getaddrinfo",
        "gethostbyname",
        "gethostbyname_ex",
        "gethostbyaddr",
        "getnameinfo",
    ):
        setattr(socket, name, _network_disabled)


def apply_sandbox(memory_mb: int, network: str) -> str:
    """Confine this process; returns the network mode in force ("netns" or "python").

    Raises OSError when network == "netns" and no namespace could be made.
    """
    mode = "python"
    if network in ("auto", "netns") and _enter_network_namespace():
        mode = "netns"
    elif network == "netns":
        raise OSError("a network namespace was required (network='netns') but unshare() failed")
    if mode == "python":
        _block_network_in_python()
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return mode


# loading the reward function ------------------------------------------------------------------


def _module_name_for(path: str) -> str:
    # Not "__main__", so a script's `if __name__ == "__main__":` block stays asleep; prefixed so a
    # file called json.py cannot replace the stdlib module for everything imported after it.
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"grader_reward_{stem}"


def load_reward_fn(ref: str, search_path: list[str]) -> RewardFn:
    """Import "pkg.module:function" or "/path/file.py:function" and return the callable.

    Raises whatever the import raises (ModuleNotFoundError, SyntaxError, the module's own
    errors), AttributeError for a missing function and TypeError for a non-callable one.
    """
    target, _, attr_path = ref.rpartition(":")
    sys.path[:0] = list(search_path)
    if target.endswith(".py") or os.sep in target:
        # Like `python file.py`: the file's folder is importable, so it can import its neighbours.
        sys.path.insert(0, os.path.dirname(target))
        name = _module_name_for(target)
        spec = importlib.util.spec_from_file_location(name, target)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a Python module from {target!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickle look their module up here
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn: Any = module
    for part in attr_path.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{attr_path} in {target} is a {type(fn).__name__}, not a function")
    return fn


# scoring --------------------------------------------------------------------------------------


def _format_error(error: BaseException) -> str:
    """The traceback from the user's code down, without this module's own frames on top."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    try:
        text = "".join(traceback.format_exception(type(error), error, tb))
    except Exception:  # a broken __str__ must not take the worker down
        text = f"{type(error).__qualname__} (its message could not be formatted)\n"
    return _shorten(text)


def _where_interrupted(error: RewardTimeout) -> str:
    """Where the user's code was when its time ran out: its frames only, no exception line."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    return _shorten("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))


def _shorten(text: str) -> str:
    if len(text) <= _MAX_ERROR_CHARS:
        return text
    half = _MAX_ERROR_CHARS // 2
    return text[:half] + "\n[... traceback shortened ...]\n" + text[-half:]


def _raise_timeout(_signum: int, _frame: Any) -> None:
    raise RewardTimeout()


def _call_with_alarm(fn: RewardFn, completion: str, task: dict, timeout_s: float) -> Any:
    # Reinstalled every call: the previous call's user code may have replaced or ignored it.
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(completion, task)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def as_reward(value: Any) -> float:
    """The reward as a float; raises TypeError/ValueError for anything but a finite number.

    Anything float() takes without parsing text counts: bool, int, float, numpy scalars (a
    np.bool_ from np.isclose is common), a one-element tensor.
    """
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        raise TypeError(
            f"returned {shown} ({type(value).__name__}); a reward must be a number (float, int or bool)"
        )
    try:
        reward = float(value)
    except Exception as error:  # a 10**400 int, a complex, a many-element array
        kind = type(value).__name__
        raise ValueError(f"returned a value of type {kind} that float() rejects ({error})") from None
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward!r}; a reward must be a finite number")
    return reward


def score_one(fn: RewardFn, completion: str, task: dict, timeout_s: float) -> dict:
    """One completion's result frame; never raises (a RewardTimeout included)."""
    try:
        value = _call_with_alarm(fn, completion, task, timeout_s)
    except RewardTimeout as error:
        return {"kind": "timeout", "error": _where_interrupted(error)}
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: all the user's failures
        return {"kind": "exception", "error": _format_error(error)}
    try:
        return {"ok": as_reward(value)}
    except (TypeError, ValueError) as error:
        return {"kind": "invalid", "error": str(error)}


def serve(fn: RewardFn, request_fd: int, response_fd: int, timeout_s: float) -> None:
    while (request := read_frame(request_fd)) is not None:
        for completion, task in request["items"]:
            result = score_one(fn, completion, task, timeout_s)
            write_frame(response_fd, result)
            if "ok" not in result:
                # Stop at the first failure: the parent retries from here, or gives up, and
                # should not wait for the rest of a batch it may throw away.
                break


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    request_fd, response_fd = config["request_fd"], config["response_fd"]
    # User prints (Python or C level) go to stderr; fd 1 is nobody's protocol but it must not be
    # the trainer's stdout either.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Ctrl-C reaches the whole process group; stopping the worker is the parent's decision, and a
    # KeyboardInterrupt inside the reward function would read as the user's error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Fatal signals (SIGSEGV, and the parent's SIGABRT for a hung call) dump the Python stack
    # here; the parent reads it back into the error it reports.
    faulthandler.enable(file=config["crash_fd"], all_threads=True)
    try:
        sandbox = apply_sandbox(config["memory_mb"], config["network"])
        fn = load_reward_fn(config["ref"], config["search_path"])
    except BaseException as error:
        write_frame(response_fd, {"type": "load_error", "error": _format_error(error)})
        return 1
    write_frame(response_fd, {"type": "ready", "sandbox": sandbox, "pid": os.getpid()})
    try:
        serve(fn, request_fd, response_fd, config["timeout_s"])
    except BrokenPipeError:
        pass  # the parent went away mid-batch: nothing left to report to
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
