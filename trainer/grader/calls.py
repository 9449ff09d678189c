"""How the grader's worker calls the user's reward function: one completion (`score_one`), a
batch in one call (TRL's signature, `score_batch`) or one prompt's group (`score_group`), each
under the per-call time limit, and what comes back turned into result frames: a reward, or how
the call failed (the traceback without the worker's own frames, shortened), never raising.

Standard library only, as the worker is (`grpo_run.trainer.grader.worker`).
"""

from __future__ import annotations

import errno
import math
import os
import reprlib
import signal
import traceback
from types import TracebackType
from typing import Any, Callable

from grpo_run.trainer.grader import sandbox as grader_sandbox
from grpo_run.trainer.grader.trl import batch_arguments

_MAX_ERROR_CHARS = 20_000  # a runaway traceback must not flood the trainer's logs
# One exception's message, cut before the traceback around it is formatted; short enough that the
# parent's cap (redact._MAX_TEXT_CHARS) keeps the traceback around it whole.
_MAX_MESSAGE_CHARS = 1_000
# Frames of these files are the worker's machinery, noise in the user's tracebacks: this module's,
# the worker's and the sandbox's (its audit hook raises the refusals).
_OWN_FILES = frozenset({__file__, os.path.join(os.path.dirname(__file__), "worker.py"), grader_sandbox.__file__})

RewardFn = Callable[[str, dict], Any]


class RewardTimeout(BaseException):
    """Raised inside the user's code when its time is up.

    A BaseException so that a reward function's own `except Exception:` does not swallow it.
    """


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


def call_with_alarm(call: Callable[[], Any], timeout_s: float) -> Any:
    # Reinstalled every call: the previous call's user code may have replaced or ignored it.
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def failed_reply(error: BaseException) -> dict:
    """The result frame of a call that raised: its time ran out, or the user's code failed
    (SystemExit and KeyboardInterrupt too: all the user's failures)."""
    if isinstance(error, RewardTimeout):
        return {"kind": "timeout", "error": _where_interrupted(error)}
    kind, text = _describe(error)
    return {"kind": kind, "error": text}


def _not_a_list(values: Any) -> bool:
    return isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__getitem__")


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
        raise TypeError(f"returned {shown(value)} ({kind}); a reward must be a number (float, int or bool)")
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


def shown(value: Any) -> str:
    try:
        return _SHOWN.repr(value)
    except Exception as error:  # a broken (or enormous) __repr__
        return f"a {type(value).__name__} whose repr() failed ({type(error).__name__})"


def score_one(fn: RewardFn, completion: str, task: dict, timeout_s: float) -> dict:
    """One completion's result frame; never raises (a RewardTimeout included)."""
    try:
        value = call_with_alarm(lambda: fn(completion, task), timeout_s)
    except BaseException as error:
        return failed_reply(error)
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
    try:
        values = call_with_alarm(lambda: fn(**batch_arguments(fn, items)), timeout_s)
    except BaseException as error:  # the user's failures, all of them, as score_one
        return [failed_reply(error)]
    if _not_a_list(values):
        return [{"kind": "invalid", "error": f"returned {shown(values)} ({type(values).__name__}); a batched reward "
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


# one prompt's group ------------------------------------------------------------------------------


def score_group(fn: Callable[..., Any], items: list, timeout_s: float) -> list[dict]:
    """The result frames of one group (the G completions of one prompt, [completion, task] items
    sharing the task) from one call, `fn(completions, task) -> list of G numbers`; never raises.
    All of the group's frames are rewards, or there is one frame, the first item's, saying how the
    call failed (a wrong length, or a value that is not a finite number, fails the whole group):
    the parent retries a group whole."""
    try:
        values = call_with_alarm(lambda: fn([completion for completion, _ in items], items[0][1]), timeout_s)
    except BaseException as error:  # the user's failures, all of them, as score_one
        return [failed_reply(error)]
    if _not_a_list(values):
        return [{"kind": "invalid", "error": f"returned {shown(values)} ({type(values).__name__}); a group reward "
                 f"returns a list with one number per completion of the group ({len(items)} here)"}]
    if len(values) != len(items):
        return [{"kind": "invalid", "error": f"returned {len(values)} values for a group of {len(items)} completions; "
                 "a group reward returns one number per completion, in order"}]
    frames: list[dict] = []
    for i in range(len(items)):
        try:
            frames.append({"ok": as_reward(values[i])})
        except (TypeError, ValueError) as error:
            return [{"kind": "invalid", "error": f"completion {i} of the group: {error}"}]
    return frames
