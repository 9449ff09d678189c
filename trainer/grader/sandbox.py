"""The grader worker's sandbox: what confines the user's reward function, in layers.

`apply_sandbox` is called by the worker (`trainer.grader_worker`) before the reward module is
imported, so its top level is confined too:
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
    copy forked below Python (ctypes, C code) that returns into the worker's serve loop exits
    before it can answer. The worker is a child subreaper: processes an item leaves running,
    grandchildren included, are killed (`_end_leftover_processes`) before the item's answer is
    sent. Those started while the module was imported are its helpers (a REPL, a server) and live
    as long as the worker;
  * memory: RLIMIT_AS, so allocations past the limit raise MemoryError;
  * time (armed by the worker, not here): SIGALRM per completion raises `RewardTimeout` inside the
    user's code. Code that never returns to the interpreter (stuck in C, or ignoring SIGALRM) is
    the parent's job: it sends SIGABRT, which faulthandler turns into a dump of where the code was
    stuck, then SIGKILL.

Deliberately light: stdlib only, and nothing from the trainer (no torch): it runs in the worker.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import socket
import sys
from typing import Any

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


# network --------------------------------------------------------------------------------------


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


# filesystem -----------------------------------------------------------------------------------


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


# processes ------------------------------------------------------------------------------------


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


# applying it ----------------------------------------------------------------------------------


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

