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
    worker -> parent  {"type": "ready", "pid": N}  (an environment with tools: and "tools": [SCHEMA, ...])
                   or {"type": "load_error", "kind": "exception"|"refused", "error": TEXT,
                       "summary": LINE (load_summary: FILE:LINE for a syntax error)}
                                                                       (then the worker exits)
    parent -> worker  {"items": [[completion, task], ...]}             (one request per batch)
                   or {"items": [...], "groups": [G, ...]}   (a group reward: consecutive items, G at a time)
                   or {"op": "reset" | "step", "items": [...]}  (an episodes environment, "episodes": true in
                      its config: the conversation is in grpo_run.trainer.grader.episodes)
    worker -> parent  one frame per item, in order, as soon as it is scored, up to and including
                      the first failure:
                      {"ok": FLOAT} or {"kind": "exception"|"timeout"|"invalid"|"refused", "error": TEXT}
                      (a batched function, TRL's signature, is called once for the request's items:
                      its frames come together after the call; its failure is the first item's;
                      a group reward is called once per group: all its frames, or one failure)
A closed request pipe means the parent is gone or done: the worker exits.

Sandbox (environment, network, seccomp, filesystem, signals, processes, memory, time):
`grpo_run.trainer.grader.sandbox`, applied before the reward module is imported; its docstring
describes each layer.

Deliberately light: stdlib only, and nothing from the trainer (no torch) but the sandbox.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import re
import signal
import struct
import sys
import sysconfig
import traceback
from typing import Any

from grpo_run.trainer.grader import cgroup
from grpo_run.trainer.grader.calls import (  # noqa: F401  (MAX_ABS_REWARD, reward_problem: the parent's checks)
    _MAX_MESSAGE_CHARS, _OWN_FILES, MAX_ABS_REWARD, RewardFn, _describe, reward_problem, score_batch, score_group,
    score_one,
)
from grpo_run.trainer.grader.sandbox import children_of, end_leftover_processes, apply_sandbox
from grpo_run.trainer.grader.trl import is_batched

_HEADER = struct.Struct(">I")  # big-endian payload length in bytes


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
    if type(error).__name__ == "ToolProblem":   # tool_schema's own words: the tool, its argument, the fix
        return f"ToolProblem: {message}"
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(error).__name__}: {message}"


def serve(fn: RewardFn, request_fd: int, response_fd: int, timeout_s: float, helpers: frozenset[int],
          group: bool = False) -> None:
    """Answer requests until the parent closes the pipe. `helpers`: the children the module's import
    started, spared by the cleanup after each item (after each call, for a batched function or a
    group). `group`: call `fn` once per group of the request's items (its "groups": their sizes)."""
    worker_pid = os.getpid()
    batched = is_batched(fn) and not group
    while (request := read_frame(request_fd)) is not None:
        if group:
            start = 0
            for size in request["groups"]:
                results = score_group(fn, request["items"][start:start + size], timeout_s)
                start += size
                if os.getpid() != worker_pid:
                    os._exit(0)  # as below: only the worker answers
                end_leftover_processes(helpers)
                for result in results:
                    write_frame(response_fd, result)
                if "ok" not in results[0]:
                    break        # as below: the parent retries from this group, or gives up
            continue
        if batched:
            results = score_batch(fn, request["items"], timeout_s) if request["items"] else []
            if os.getpid() != worker_pid:
                os._exit(0)  # as below: only the worker answers
            end_leftover_processes(helpers)
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
            end_leftover_processes(helpers)
            write_frame(response_fd, result)
            if "ok" not in result:
                # Stop at the first failure: the parent retries from here, or gives up, and
                # should not wait for the rest of a batch it may throw away.
                break


def _load_tools(config: dict) -> tuple[dict[str, Any], list[dict]]:
    """The episodes' tools by name, and their schemas in the job's order (none without "tools")."""
    from grpo_run.trainer.grader.tools import ToolProblem, tool_schema

    tools: dict[str, Any] = {}
    schemas = []
    for ref in config.get("tools", []):
        fn = load_reward_fn(ref, config["search_path"])
        schema = tool_schema(fn)
        name = schema["function"]["name"]
        if name in tools:
            raise ToolProblem(f"two tools are named {name!r} ({ref} and an earlier one); the model calls a tool by "
                              "its name, so each must have its own")
        tools[name] = fn
        schemas.append(schema)
    return tools, schemas


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


def _die_with(parent: int) -> None:
    """SIGKILL when the trainer's thread that started us (its main thread) ends: a trainer killed
    with SIGKILL (a hang, a lost lease) must not leave its worker, and the reward's processes in the
    worker's PID namespace, behind. Exits at once if it has already ended."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                                                ctypes.c_ulong(0), ctypes.c_ulong(0))  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:
        os._exit(1)


def _first_to_go() -> None:
    """When the node runs out of memory, the kernel kills the reward's processes (which inherit
    this) before the trainer's: raising one's own oom_score_adj needs no privilege."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    # Into the tree's cgroup before anything else, so every process started from here is born in it.
    tree = cgroup.join(config.get("cgroup"))
    _first_to_go()
    request_fd, response_fd = config["request_fd"], config["response_fd"]
    if config.get("parent"):
        _die_with(config["parent"])
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
        mode, why, limits = apply_sandbox(
            memory_mb=config["memory_mb"], network=config["network"], filesystem=config["filesystem"],
            signals=config["signals"], scratch=config["scratch"],
            reward_files=[f for f in map(_reward_file, [config["ref"], *config.get("tools", [])]) if f],
            search_path=config["search_path"], protected=config["protected"],
            reward_folder=config.get("reward_folder", True), scratch_mb=config.get("scratch_mb", 1024),
            launcher_closes=(request_fd, response_fd, config["crash_fd"]),
        )
        limits["memory"] = tree or f"RLIMIT_AS {config['memory_mb']} MiB per process (no cgroup for the tree)"
        if tree and "processes" in tree and not limits["processes"]:
            limits["processes"] = tree
        missing = _missing(config, mode)
        # Sent before any of the reward's code runs, so this frame alone is the worker's own word:
        # the reward's module could write a forged one later.
        write_frame(response_fd, {"type": "sandbox", "mode": mode, "why": why, "missing": missing, "limits": limits})
        if missing:
            return 1  # never import the reward with a layer missing that had to be in force
        fn = load_reward_fn(config["ref"], config["search_path"])
        if config.get("episodes"):
            from grpo_run.trainer.grader.episodes import class_problem

            if class_problem(fn):
                raise TypeError(class_problem(fn))
        tools, schemas = _load_tools(config)
    except BaseException as error:
        kind, text = _describe(error)
        write_frame(response_fd, {"type": "load_error", "kind": kind, "error": text, "summary": load_summary(error)})
        end_leftover_processes(frozenset())
        return 1
    helpers = frozenset(children_of())
    write_frame(response_fd, {"type": "ready", "pid": os.getpid(), **({"tools": schemas} if tools else {})})
    try:
        if config.get("episodes"):          # an environment's objects, one per episode (trainer.episodes)
            from grpo_run.trainer.grader.episodes import serve_episodes

            serve_episodes(fn, lambda: read_frame(request_fd), lambda frame: write_frame(response_fd, frame),
                           config["timeout_s"], lambda: end_leftover_processes(helpers), tools=tools,
                           tool_timeout_s=config.get("tool_timeout_s", config["timeout_s"]),
                           step_timeout_s=config.get("step_timeout_s"), tool_format=config.get("tool_format", "hermes"))
        else:
            serve(fn, request_fd, response_fd, config["timeout_s"], helpers, group=config.get("group", False))
    except BrokenPipeError:
        pass  # the parent went away mid-batch: nothing left to report to
    end_leftover_processes(frozenset())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
