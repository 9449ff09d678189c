"""The grader's worker process: runs the user's reward function in a sandbox.

Started by `trainer.grader.Grader` as `python -m trainer.grader_worker CONFIG_JSON`; never run by
hand. It talks to its parent over two private pipes (file descriptors named in the config), with
length-prefixed JSON frames, so a reward function that prints cannot corrupt the protocol: its
stdout and stderr are a third pipe, which the parent reads and caps (`trainer.grader_process`).

Conversation:
    worker -> parent  {"type": "ready", "sandbox": "netns"|"python", "filesystem": "landlock"|"python",
                       "filesystem_why": TEXT (why not Landlock; "" when it is), "pid": N}
                   or {"type": "load_error", "kind": "exception"|"refused", "error": TEXT}
                                                                       (then the worker exits)
    parent -> worker  {"items": [[completion, task], ...]}             (one request per batch)
    worker -> parent  one frame per item, in order, as soon as it is scored, up to and including
                      the first failure:
                      {"ok": FLOAT} or {"kind": "exception"|"timeout"|"invalid"|"refused", "error": TEXT}
A closed request pipe means the parent is gone or done: the worker exits.

Sandbox, set up before the reward module is imported so its top level is confined too:
  * network: a fresh network namespace (no interfaces up, not even loopback) when the kernel lets
    us make one, otherwise Python-level blocking of sockets and name lookups (best effort: code
    that shells out or uses ctypes gets past it);
  * filesystem: reads anywhere, writes only inside a scratch directory (made by the parent, which
    removes it with the worker; it is the worker's cwd and $TMPDIR) and to /dev/null. Landlock
    enforces it in the kernel, for every process the reward function starts too; where Landlock
    is unavailable only writes made through Python are refused (best effort, like the network).
    Either way an audit hook refuses Python-level writes first, so the failure says what was
    refused and why, and counts as "refused" (never retried, never a score). Writes below Python
    get Landlock's bare "Permission denied", so a failure carrying one gets a note that the sandbox
    may be why. This rules out multiprocessing's locks and queues (POSIX semaphores, files in
    /dev/shm), hence multiprocessing.Queue and ProcessPoolExecutor; Process and Manager work;
  * processes: os.fork() is refused (a forked copy of the worker would carry on in its serve
    loop); multiprocessing's fork start method is let through, as its children always exit. A
    copy forked below Python (ctypes, C code) that returns into this module exits before it can
    answer. The worker is a child subreaper: processes an item leaves running, grandchildren
    included, are killed before the item's answer is sent. Those started while the module was
    imported are its helpers (a REPL, a server) and live as long as the worker;
  * memory: RLIMIT_AS, so allocations past the limit raise MemoryError;
  * time: SIGALRM per completion raises `RewardTimeout` inside the user's code. Code that never
    returns to the interpreter (stuck in C, or ignoring SIGALRM) is the parent's job: it sends
    SIGABRT, which faulthandler turns into a dump of where the code was stuck, then SIGKILL.

Deliberately light: stdlib only, and nothing from the trainer (no torch).
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import importlib
import importlib.util
import json
import math
import os
import re
import reprlib
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
_MAX_MESSAGE_CHARS = 4_000  # one exception's message, cut before the traceback around it is formatted
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_MAX_KILL_ROUNDS = 100  # each round kills the children orphaned by the previous one
# Landlock (linux/landlock.h). The syscall numbers are the same on every architecture: they came
# after the tables were unified at 424.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_WRITE_FILE = 1 << 1
# ABI 1's rights that change the filesystem: write a file (bit 1), remove a directory or a file,
# make a character device, directory, regular file, socket, fifo, block device or symlink (4-12).
_FS_CHANGES_ABI1 = _FS_WRITE_FILE | sum(1 << bit for bit in range(4, 13))
_FS_REFER = 1 << 13  # ABI 2: link or move a file into another directory
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_FILE_RIGHTS = _FS_WRITE_FILE | _FS_TRUNCATE  # of those, the ones a rule on one file may grant
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

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


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]  # ABI 1's struct: all the rights used here


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header too
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _confine_writes_with_landlock(scratch: str) -> str:
    """Let this process, and every process it starts, change the filesystem only inside `scratch`
    and write to /dev/null (reads stay allowed everywhere). Returns "" once in force, otherwise why
    not, in words; nothing is restricted then."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as error:
        return f"there is no C library to call it through ({error})"
    libc.syscall.restype = ctypes.c_long

    def syscall(name: str, number: int, *args: Any) -> int:
        result = libc.syscall(ctypes.c_long(number), *args)
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{name}: {os.strerror(code)}")
        return result

    try:
        abi = syscall(
            "landlock_create_ruleset",
            _SYS_LANDLOCK_CREATE_RULESET,
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
        )
    except OSError as error:
        return f"the kernel offers no Landlock ({error.strerror}; it needs Linux 5.13+ with landlock among its LSMs)"
    handled = _FS_CHANGES_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    try:
        attr = _RulesetAttr(handled)
        ruleset = syscall(
            "landlock_create_ruleset",
            _SYS_LANDLOCK_CREATE_RULESET,
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
            ctypes.c_uint32(0),
        )
        try:
            for path, allowed in ((scratch, handled), (os.devnull, handled & _FS_FILE_RIGHTS)):
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneathAttr(allowed, fd)
                    syscall(
                        f"landlock_add_rule({path})",
                        _SYS_LANDLOCK_ADD_RULE,
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    )
                finally:
                    os.close(fd)
            # Landlock insists on no_new_privs: no setuid program the reward runs can shed it.
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
                code = ctypes.get_errno()
                raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")
            syscall("landlock_restrict_self", _SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
        finally:
            os.close(ruleset)
    except OSError as error:
        return f"Landlock could not be set up ({error.strerror})"
    return ""


# audit event -> (what it does, which argument is the path it changes, which is that path's dir_fd)
# os.mkfifo and os.mknod raise no audit event: Landlock alone stops those.
_CHANGES = {
    "os.remove": ("removing", 0, 1),  # os.unlink too
    "os.rmdir": ("removing the directory", 0, 1),
    "os.mkdir": ("making the directory", 0, 2),
    "os.rename": ("moving a file to", 1, 3),  # os.replace too; the source is checked as well
    "os.link": ("making a link at", 1, 3),
    "os.symlink": ("making a link at", 1, 2),
    "os.truncate": ("truncating", 0, None),
}


class _Refusals:
    """An audit hook that refuses, inside Python, what the sandbox does not allow: changing the
    filesystem outside the scratch directory, and os.fork().

    Landlock would refuse the same writes with a bare "Permission denied"; refusing them first
    gives an error that says what was refused and why, and marks it (`grader_refusal`) so that
    the item counts as refused. Where Landlock is unavailable this hook is all there is.
    """

    def __init__(self, scratch: str) -> None:
        self.scratch = os.path.realpath(scratch)

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open":
            path, _mode, flags = args
            if flags & _WRITE_FLAGS:
                self._check("writing to", _changed_path(path, None, follow=True))
        elif event in _CHANGES:
            what, at, dir_fd_at = _CHANGES[event]
            dir_fd = args[dir_fd_at] if dir_fd_at is not None else None
            target = _changed_path(args[at], dir_fd, follow=event == "os.truncate")
            if event == "os.rename":
                self._check("moving", _changed_path(args[0], args[2], follow=False))
            if event == "os.mkdir" and target is not None and os.path.lexists(target):
                return  # fails with FileExistsError as it would anyway (os.makedirs(exist_ok=True))
            self._check(what, target)
        elif event in ("os.fork", "os.forkpty"):
            self._check_fork()

    def _check(self, what: str, target: str | None) -> None:
        if target is None or target == os.devnull:
            return
        if target == self.scratch or target.startswith(self.scratch + os.sep):
            return
        _refuse(
            f"{what} {target!r} was refused: a reward function may write only in its scratch "
            f"directory {self.scratch} (its working directory and $TMPDIR, removed with the worker) "
            f"and to /dev/null",
            errno.EACCES,
        )

    def _check_fork(self) -> None:
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back
        if caller is not None and caller.f_globals.get("__name__") == "multiprocessing.popen_fork":
            return  # multiprocessing's child runs its target and os._exit()s: it never comes back here
        _refuse(
            "os.fork() was refused: a forked copy of the grader's worker would carry on as the "
            "worker; run programs with subprocess (subprocess.run), or use multiprocessing",
            errno.EPERM,
        )


def _changed_path(path: Any, dir_fd: Any, *, follow: bool) -> str | None:
    """The absolute path an operation changes: through symlinks for what it writes into (follow),
    up to the last component for what it removes, moves or makes. None for a file descriptor."""
    if isinstance(path, int):
        return None  # an open file: it was checked when it was opened
    try:
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # -1: no dir_fd
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    except (TypeError, OSError):
        return None  # the call itself will fail (or Landlock decides)
    path = os.path.abspath(path)
    if follow:
        return os.path.realpath(path)
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail)


def _refuse(reason: str, code: int) -> None:
    # A PermissionError, so code that copes with an unwritable cache folder carries on as it would
    # under Landlock alone; the mark makes the item "refused" when it ends the reward function.
    error = PermissionError(code, reason)
    error.grader_refusal = reason  # type: ignore[attr-defined]
    raise error


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
    if _landlock_scratch and any(isinstance(e, OSError) and e.errno == errno.EACCES for e in chain):
        # Landlock's refusals of writes below Python (C code, other programs) say only this.
        text += (
            f"\n(This 'Permission denied' may be the grader's sandbox: a reward function and the programs "
            f"it runs may write only in its scratch directory {_landlock_scratch}; that also rules out "
            f"multiprocessing's locks and queues, which live in /dev/shm.)"
        )
    return "exception", text


def _become_subreaper() -> None:
    """Orphans among this process's descendants are reparented to it, not to init, so the cleanup
    after each item finds them. A no-op where prctl is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _children() -> set[int]:
    """This process's children, running or not yet reaped."""
    me = os.getpid()
    pids: set[int] = set()
    if os.path.exists(f"/proc/{me}/task/{me}/children"):
        for tid in os.listdir(f"/proc/{me}/task"):
            try:
                with open(f"/proc/{me}/task/{tid}/children") as f:
                    pids.update(int(pid) for pid in f.read().split())
            except FileNotFoundError:
                pass  # the thread ended meanwhile
        return pids
    # A kernel without CONFIG_PROC_CHILDREN: every process's parent, from its stat line.
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                pids.add(int(entry))
    return pids


def _end_leftover_processes(keep: frozenset[int]) -> None:
    """SIGKILL and reap every child but those in `keep`. Their own children are orphaned onto us
    (a subreaper), so repeat until none is left; a fork bomb that outpaces this dies with the
    worker's process group, which the parent kills."""
    for _ in range(_MAX_KILL_ROUNDS):
        leftover = _children() - keep
        if not leftover:
            return
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in leftover:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped meanwhile, by a thread of the reward function's


_landlock_scratch = ""  # the scratch directory once Landlock confines writes to it


def apply_sandbox(memory_mb: int, network: str, filesystem: str, scratch: str) -> dict[str, str]:
    """Confine this process; returns what is in force, for the ready frame: "sandbox" (the network:
    "netns" or "python"), "filesystem" ("landlock" or "python") and "filesystem_why" (why not
    Landlock; "" when it is in force).

    Raises OSError when network == "netns" and no namespace could be made, or when
    filesystem == "landlock" and Landlock could not be set up.
    """
    global _landlock_scratch
    # The network first: joining a user namespace writes /proc/self/uid_map, which Landlock forbids.
    mode = "python"
    if network in ("auto", "netns") and _enter_network_namespace():
        mode = "netns"
    elif network == "netns":
        raise OSError("a network namespace was required (network='netns') but unshare() failed")
    if mode == "python":
        _block_network_in_python()
    if filesystem == "python":
        why = "filesystem='python' was asked for"
    else:
        why = _confine_writes_with_landlock(scratch)
        if why and filesystem == "landlock":
            raise OSError(f"Landlock was required (filesystem='landlock') but {why}")
    if not why:
        _landlock_scratch = scratch
    sys.addaudithook(_Refusals(scratch))
    sys.dont_write_bytecode = True  # a __pycache__ next to the user's module would be refused
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # nor by the Python programs it runs
    for var in ("TMPDIR", "TEMP", "TMP"):
        os.environ[var] = scratch
    os.chdir(scratch)
    _become_subreaper()
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return {"sandbox": mode, "filesystem": "python" if why else "landlock", "filesystem_why": why}


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
        report = traceback.TracebackException(type(error), error, tb)
        _tidy(report)
        text = "".join(report.format())
    except Exception:  # a broken __str__ (or no memory left) must not take the worker down
        text = f"{type(error).__qualname__} (its message could not be formatted)\n"
    return _shorten(text)


def _tidy(report: traceback.TracebackException) -> None:
    """Before formatting, for each exception in the chain: drop this module's frames (the sandbox's
    audit hook raises its refusals from here), and cut the message to _MAX_MESSAGE_CHARS, since a
    100 MB message would otherwise be copied into the traceback text (twice), which a worker near
    its memory limit cannot afford. `_str` is private but present in every Python we support;
    without it the whole text is still cut afterwards."""
    stack, seen = [report], set()
    while stack:
        part = stack.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        part.stack[:] = [frame for frame in part.stack if frame.filename != __file__]
        message = getattr(part, "_str", None)
        if isinstance(message, str) and len(message) > _MAX_MESSAGE_CHARS:
            part._str = _shorten(message, _MAX_MESSAGE_CHARS, "message")
        stack += [part.__cause__, part.__context__, *(getattr(part, "exceptions", None) or ())]


def _where_interrupted(error: RewardTimeout) -> str:
    """Where the user's code was when its time ran out: its frames only, no exception line."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
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


def as_reward(value: Any) -> float:
    """The reward as a float; raises TypeError/ValueError for anything but a finite number.

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
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward!r}; a reward must be a finite number")
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


def serve(fn: RewardFn, request_fd: int, response_fd: int, timeout_s: float, helpers: frozenset[int]) -> None:
    """Answer requests until the parent closes the pipe. `helpers`: the children the module's import
    started, spared by the cleanup after each item."""
    worker_pid = os.getpid()
    while (request := read_frame(request_fd)) is not None:
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
        sandbox = apply_sandbox(config["memory_mb"], config["network"], config["filesystem"], config["scratch"])
        fn = load_reward_fn(config["ref"], config["search_path"])
    except BaseException as error:
        kind, text = _describe(error)
        write_frame(response_fd, {"type": "load_error", "kind": kind, "error": text})
        _end_leftover_processes(frozenset())
        return 1
    helpers = frozenset(_children())
    write_frame(response_fd, {"type": "ready", **sandbox, "pid": os.getpid()})
    try:
        serve(fn, request_fd, response_fd, config["timeout_s"], helpers)
    except BrokenPipeError:
        pass  # the parent went away mid-batch: nothing left to report to
    _end_leftover_processes(frozenset())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
