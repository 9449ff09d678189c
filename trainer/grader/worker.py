"""The grader's worker process: runs the user's reward function in a sandbox.

Started by `grpo_run.trainer.grader.grader.Grader` as `python -m grpo_run.trainer.grader.worker
CONFIG_JSON`, with an allow-listed environment; never run by hand. It talks to its parent over two
private pipes (file descriptors named in the config), with length-prefixed JSON frames, so a reward
function that prints cannot corrupt the protocol: its stdout and stderr are a third pipe, which the
parent reads, scrubs and caps (`grpo_run.trainer.grader.process`). The reward function can still
write frames of its own to the response pipe (its number is in argv): the parent checks every
frame it reads as it would an untrusted one (`grpo_run.trainer.grader.replies`).

Conversation:
    worker -> parent  {"type": "sandbox", "mode": {"network": "netns"|"python", "filesystem":
                       "landlock"|"python", "signals": "landlock"|"pidns"|"none", "seccomp": "on"|"off"},
                       "why": {layer: TEXT (why it is not in force)}, "missing": [layer, ...]}
                      (before the reward's module is imported; when a layer that had to be in force
                      is missing, the worker exits after it)
    worker -> parent  {"type": "ready", "pid": N}
                   or {"type": "load_error", "kind": "exception"|"refused", "error": TEXT,
                       "summary": LINE (load_summary: FILE:LINE for a syntax error)}
                                                                       (then the worker exits)
    parent -> worker  {"items": [[completion, task], ...]}             (one request per batch)
    worker -> parent  one frame per item, in order, as soon as it is scored, up to and including
                      the first failure:
                      {"ok": FLOAT} or {"kind": "exception"|"timeout"|"invalid"|"refused", "error": TEXT}
                      (a batched function, TRL's signature, is called once for the request's items:
                      its frames come together after the call; its failure is the first item's)
A closed request pipe means the parent is gone or done: the worker exits.

Sandbox (environment, network, seccomp, filesystem, signals, processes, memory, time):
`grpo_run.trainer.grader.sandbox`, applied before the reward module is imported; its docstring
describes each layer.

Deliberately light: stdlib only, and nothing from the trainer (no torch) but the sandbox.
"""

from __future__ import annotations

import errno
import faulthandler
import importlib
import importlib.util
import json
import math
import os
import re
import reprlib
import signal
import struct
import sys
import sysconfig
import traceback
from types import TracebackType
from typing import Any, Callable

from grpo_run.trainer.grader import sandbox as grader_sandbox
from grpo_run.trainer.grader.sandbox import _children, _end_leftover_processes, apply_sandbox
from grpo_run.trainer.grader.trl import batch_arguments, is_batched

_HEADER = struct.Struct(">I")  # big-endian payload length in bytes
_MAX_ERROR_CHARS = 20_000  # a runaway traceback must not flood the trainer's logs
# One exception's message, cut before the traceback around it is formatted; short enough that the
# parent's cap (redact._MAX_TEXT_CHARS) keeps the traceback around it whole.
_MAX_MESSAGE_CHARS = 1_000
# Frames of these files are the worker's machinery, noise in the user's tracebacks: this module's
# and the sandbox's (its audit hook raises the refusals).
_OWN_FILES = frozenset({__file__, grader_sandbox.__file__})

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


# loading the reward function ------------------------------------------------------------------


def _module_name_for(path: str) -> str:
    # Not "__main__", so a script's `if __name__ == "__main__":` block stays asleep; prefixed so a
    # file called json.py cannot replace the stdlib module for everything imported after it.
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"grader_reward_{stem}"


class MissingFunction(AttributeError):
    """The reward's module loaded, but has no attribute of the ref's name."""


def load_reward_fn(ref: str, search_path: list[str]) -> RewardFn:
    """Import "pkg.module:function" or "/path/file.py:function" and return the callable.

    Raises whatever the import raises (ModuleNotFoundError, SyntaxError, the module's own
    errors), MissingFunction (an AttributeError naming what the module defines) for a missing
    function and TypeError for a non-callable one.
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
        if not hasattr(fn, part):
            # getattr's own message names the module as the worker loaded it (grader_reward_...),
            # a name the user never wrote: name the file and what it does define instead
            raise MissingFunction(f"{target} has no {part!r}; it defines: {', '.join(defined_names(fn)) or 'nothing public'}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{attr_path} in {target} is a {type(fn).__name__}, not a function")
    return fn


def defined_names(namespace: Any) -> list[str]:
    """The public callables `namespace` (a module or a class) defines itself, sorted: what a
    wrong function name should have been. Imported ones (`from math import sqrt`) are left out."""
    own = getattr(namespace, "__name__", None)
    names = []
    for name, value in vars(namespace).items():
        if name.startswith("_") or not callable(value):
            continue
        if getattr(value, "__module__", own) in (own, getattr(namespace, "__module__", None)):
            names.append(name)
    return sorted(names)


def load_summary(error: BaseException) -> str:
    """One line on why the reward could not be loaded, for a preflight to print without the
    traceback: a syntax error as FILE:LINE and what is wrong there; any other error as its type and
    message, at the innermost line of the user's code when there is one."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename}:{error.lineno}" if error.filename and error.lineno else (error.filename or "")
        return f"{where}: {type(error).__name__}: {error.msg}" if where else f"{type(error).__name__}: {error.msg}"
    message = " ".join(str(error).split())[:_MAX_MESSAGE_CHARS]
    # the innermost line of the user's code: not the worker's, not <frozen importlib>, not the
    # Python installation's (json.loads raising is the user's line that called it)
    installed = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename not in _OWN_FILES
              and not f.filename.startswith("<") and not f.filename.startswith(installed)]
    if isinstance(error, MissingFunction):
        return message                      # load_reward_fn's own words: the file and what it defines
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(error).__name__}: {message}"


# scoring --------------------------------------------------------------------------------------


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling."""
    chain: list[BaseException] = []
    stack: list[BaseException | None] = [error]
    while stack:
        part = stack.pop()
        if part is None or any(part is seen for seen in chain):
            continue
        chain.append(part)
        stack += [part.__cause__, part.__context__]
    return chain


def _describe(error: BaseException) -> tuple[str, str]:
    """How the user's code failed: ("refused", the sandbox's reason and the traceback) when one of
    the sandbox's refusals ended it, else ("exception", the traceback)."""
    chain = _chain(error)
    reason = next((r for r in (getattr(e, "grader_refusal", None) for e in chain) if isinstance(r, str)), None)
    if reason is not None:
        return "refused", f"{reason}\n{_format_error(error)}"
    text = _format_error(error)
    denied = {e.errno for e in chain if isinstance(e, OSError)}
    if grader_sandbox._landlock_scratch and errno.EACCES in denied:
        # Landlock's refusals of reads and writes below Python (C code, other programs) say only this.
        text += (
            f"\n(This 'Permission denied' may be the grader's sandbox: a reward function and the programs "
            f"it runs may read only its own folder, the Python installation and the system's libraries, "
            f"and write only in its scratch directory {grader_sandbox._landlock_scratch}; "
            f"that also rules out multiprocessing's locks and queues, which live in /dev/shm.)"
        )
    if grader_sandbox._seccomp_on and errno.EPERM in denied:
        text += (
            "\n(This 'Operation not permitted' may be the grader's sandbox: a reward function and the "
            "programs it runs may open no socket (socketpair() excepted) and may not read other processes.)"
        )
    return "exception", text



def _format_error(error: BaseException) -> str:
    """The traceback from the user's code down, without the worker's own frames on top."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    try:
        report = traceback.TracebackException(type(error), error, tb)
        _tidy(report)
        text = "".join(report.format())
    except Exception:  # a broken __str__ (or no memory left) must not take the worker down
        text = f"{type(error).__qualname__} (its message could not be formatted)\n"
    return _shorten(text)


def _tidy(report: traceback.TracebackException) -> None:
    """Before formatting, for each exception in the chain: drop the worker's frames (_OWN_FILES;
    the sandbox's audit hook raises its refusals from trainer.grader_sandbox), and cut the message
    to _MAX_MESSAGE_CHARS, since a 100 MB message would otherwise be copied into the traceback text
    (twice), which a worker near its memory limit cannot afford. `_str` is private but present in every Python we support;
    without it the whole text is still cut afterwards."""
    stack, seen = [report], set()
    while stack:
        part = stack.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        part.stack[:] = [frame for frame in part.stack if frame.filename not in _OWN_FILES]
        message = getattr(part, "_str", None)
        if isinstance(message, str) and len(message) > _MAX_MESSAGE_CHARS:
            part._str = _shorten(message, _MAX_MESSAGE_CHARS, "message")
        stack += [part.__cause__, part.__context__, *(getattr(part, "exceptions", None) or ())]


def _where_interrupted(error: RewardTimeout) -> str:
    """Where the user's code was when its time ran out: its frames only, no exception line."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename not in _OWN_FILES]
    return _shorten("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))


def _shorten(text: str, limit: int = _MAX_ERROR_CHARS, what: str = "traceback") -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {what} shortened: {len(text) - 2 * half:,} characters left out ...]\n{text[-half:]}"


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


# Training data is float32: it holds integers exactly only up to 2**24 (about 1.7e7) and is inf
# past 3.4e38, and the group statistics square the rewards. No meaningful reward is anywhere near
# this; one that is, is a bug (or an attack) and must not become training data.
MAX_ABS_REWARD = 1e6


def reward_problem(reward: float) -> str:
    """Why `reward` cannot be training data ("" when it can): the worker's check, and the parent's
    again on every frame (the reward function can write frames to the response pipe itself)."""
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        return f"returned {reward!r}; a reward must be a finite number within ±{MAX_ABS_REWARD:g}"
    return ""


def as_reward(value: Any) -> float:
    """The reward as a float; raises TypeError/ValueError for anything but a finite number within
    ±MAX_ABS_REWARD.

    Anything float() takes without parsing text counts: bool, int, float, numpy scalars (a
    np.bool_ from np.isclose is common), a one-element tensor.
    """
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        kind = type(value).__name__
        if isinstance(value, (str, bytes)) and len(value) > _SHOWN.maxstring:
            kind += f" of length {len(value):,}"
        raise TypeError(f"returned {_shown(value)} ({kind}); a reward must be a number (float, int or bool)")
    try:
        reward = float(value)
    except Exception as error:  # a 10**400 int, a complex, a many-element array
        kind = type(value).__name__
        raise ValueError(f"returned a value of type {kind} that float() rejects ({error})") from None
    if reward_problem(reward):
        raise ValueError(reward_problem(reward))
    return reward


_SHOWN = reprlib.Repr()  # slices a string before repr(): a 1 GB return value is not copied to show it
_SHOWN.maxstring = _SHOWN.maxother = 200


def _shown(value: Any) -> str:
    try:
        return _SHOWN.repr(value)
    except Exception as error:  # a broken (or enormous) __repr__
        return f"a {type(value).__name__} whose repr() failed ({type(error).__name__})"


def score_one(fn: RewardFn, completion: str, task: dict, timeout_s: float) -> dict:
    """One completion's result frame; never raises (a RewardTimeout included)."""
    try:
        value = _call_with_alarm(fn, completion, task, timeout_s)
    except RewardTimeout as error:
        return {"kind": "timeout", "error": _where_interrupted(error)}
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: all the user's failures
        kind, text = _describe(error)
        return {"kind": kind, "error": text}
    try:
        return {"ok": as_reward(value)}
    except (TypeError, ValueError) as error:
        return {"kind": "invalid", "error": str(error)}


# TRL's reward functions, batched ------------------------------------------------------------------


def score_batch(fn: Callable[..., Any], items: list, timeout_s: float) -> list[dict]:
    """The items' result frames from one call of a batched function, up to and including the first
    failure; never raises. The call gets `timeout_s` for the whole batch (the parent waits that
    long for the first frame). A failure of the call is the first item's; a wrong length or a
    value that is not a finite number, that item's."""
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        try:
            values = fn(**batch_arguments(fn, items))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except RewardTimeout as error:
        return [{"kind": "timeout", "error": _where_interrupted(error)}]
    except BaseException as error:  # the user's failures, all of them, as score_one
        kind, text = _describe(error)
        return [{"kind": kind, "error": text}]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__getitem__"):
        return [{"kind": "invalid", "error": f"returned {_shown(values)} ({type(values).__name__}); a batched reward "
                 f"(TRL's signature) returns a list with one number per completion ({len(items)} here)"}]
    if len(values) != len(items):
        return [{"kind": "invalid", "error": f"returned {len(values)} values for {len(items)} completions; a batched "
                 "reward (TRL's signature) returns one number per completion, in order"}]
    frames: list[dict] = []
    for i in range(len(items)):
        try:
            frames.append({"ok": as_reward(values[i])})
        except (TypeError, ValueError) as error:
            frames.append({"kind": "invalid", "error": f"completion {i} of the batch: {error}"})
            break
    return frames


def serve(fn: RewardFn, request_fd: int, response_fd: int, timeout_s: float, helpers: frozenset[int]) -> None:
    """Answer requests until the parent closes the pipe. `helpers`: the children the module's import
    started, spared by the cleanup after each item (after each call, for a batched function)."""
    worker_pid = os.getpid()
    batched = is_batched(fn)
    while (request := read_frame(request_fd)) is not None:
        if batched:
            results = score_batch(fn, request["items"], timeout_s) if request["items"] else []
            if os.getpid() != worker_pid:
                os._exit(0)  # as below: only the worker answers
            _end_leftover_processes(helpers)
            for result in results:
                write_frame(response_fd, result)
            continue
        for completion, task in request["items"]:
            result = score_one(fn, completion, task, timeout_s)
            if os.getpid() != worker_pid:
                # A copy forked below Python (os.fork() is refused) returned from the reward
                # function: only the worker answers, or the parent would take its frame for the
                # next item's.
                os._exit(0)
            _end_leftover_processes(helpers)
            write_frame(response_fd, result)
            if "ok" not in result:
                # Stop at the first failure: the parent retries from here, or gives up, and
                # should not wait for the rest of a batch it may throw away.
                break


def _reward_file(ref: str) -> str | None:
    target = ref.rpartition(":")[0]
    return target if target.endswith(".py") or os.sep in target else None


def _missing(config: dict, mode: dict[str, str]) -> list[str]:
    """The layers that must be in force and are not: all of them when strict, else those a setting
    names a mechanism for (network="netns", filesystem="landlock", signals="landlock"|"pidns")."""
    strict = config.get("strict", False)
    wanted = {
        "network": strict or config["network"] == "netns",
        "filesystem": strict or config["filesystem"] == "landlock",
        "signals": strict or config["signals"] in ("landlock", "pidns"),
        "seccomp": strict,
    }
    off = {"network": "python", "filesystem": "python", "signals": "none", "seccomp": "off"}
    missing = [layer for layer, must in wanted.items() if must and mode[layer] == off[layer]]
    if config["signals"] in ("landlock", "pidns") and mode["signals"] not in ("none", config["signals"]):
        missing.append("signals")  # another mechanism than the one asked for
    return missing


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    request_fd, response_fd = config["request_fd"], config["response_fd"]
    # User prints (Python or C level) go to one pipe, fds 1 and 2 alike, which the parent reads;
    # one Python stream for both keeps their lines in order.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Ctrl-C reaches the whole process group; stopping the worker is the parent's decision, and a
    # KeyboardInterrupt inside the reward function would read as the user's error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Fatal signals (SIGSEGV, and the parent's SIGABRT for a hung call) dump the Python stack
    # here; the parent reads it back into the error it reports.
    faulthandler.enable(file=config["crash_fd"], all_threads=True)
    try:
        mode, why = apply_sandbox(
            memory_mb=config["memory_mb"], network=config["network"], filesystem=config["filesystem"],
            signals=config["signals"], scratch=config["scratch"], reward_file=_reward_file(config["ref"]),
            search_path=config["search_path"], protected=config["protected"],
            launcher_closes=(request_fd, response_fd, config["crash_fd"]),
        )
        missing = _missing(config, mode)
        # Sent before any of the reward's code runs, so this frame alone is the worker's own word:
        # the reward's module could write a forged one later.
        write_frame(response_fd, {"type": "sandbox", "mode": mode, "why": why, "missing": missing})
        if missing:
            return 1  # never import the reward with a layer missing that had to be in force
        fn = load_reward_fn(config["ref"], config["search_path"])
    except BaseException as error:
        kind, text = _describe(error)
        write_frame(response_fd, {"type": "load_error", "kind": kind, "error": text, "summary": load_summary(error)})
        _end_leftover_processes(frozenset())
        return 1
    helpers = frozenset(_children())
    write_frame(response_fd, {"type": "ready", "pid": os.getpid()})
    try:
        serve(fn, request_fd, response_fd, config["timeout_s"], helpers)
    except BrokenPipeError:
        pass  # the parent went away mid-batch: nothing left to report to
    _end_leftover_processes(frozenset())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
