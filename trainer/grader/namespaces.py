"""Namespaces for the grader's worker: an empty network namespace, and where Landlock cannot scope
signals, a PID namespace.

A new user namespace comes first where allowed, even for root: in it the reward code holds no
capabilities over the host, so it cannot setns() its way back into the host's network namespace
(real root could). Mapping our own uid/gid keeps file ownership as before. Where user namespaces
are off, root (CAP_SYS_ADMIN) can still unshare the others alone.

unshare(CLONE_NEWPID) moves only the caller's future children, so `enter_pid_namespace` forks: the
child is the worker, pid 1 of a namespace that holds nothing of the host's, with its own /proc; the
process the trainer started stays outside as a launcher that passes the trainer's signals on and
exits as the worker does. From inside, the trainer, the supervisor and every other process of the
node have no pid at all, so they cannot be signalled; the worker's parent is pid 0.

Stdlib and ctypes only: it runs in the worker, before the reward module is imported, while it is
single-threaded (unshare(CLONE_NEWUSER) insists on that).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
from typing import Any

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1
_PID_MAX_MIN = 301   # the kernel's floor for a namespace's pid_max (RESERVED_PIDS + 1)
# The launcher passes these on to the worker; the trainer stops a hung worker with SIGABRT (for
# faulthandler's dump), and SIGKILLs the whole process group, which holds both.
_RELAYED = (signal.SIGABRT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

foreign_proc = False  # in a PID namespace whose /proc could not be mounted: /proc's pids are the host's
in_user_namespace = False  # unshare() made a user namespace: RLIMIT_NPROC counts only its processes


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def unshare(network: bool, pid: bool) -> tuple[bool, bool, str]:
    """Enter new namespaces: (network namespace made, PID namespace made, why not, in words). The PID
    namespace comes with a mount namespace (for its /proc) and takes effect for the children made
    afterwards (enter_pid_namespace). A failed unshare() changes nothing, so narrower ones follow."""
    if not network and not pid:
        return False, False, ""
    try:
        libc = _libc()
    except OSError as error:
        return False, False, f"there is no C library to call unshare() through ({error})"
    wanted = [(network, pid)] + ([(network, False)] if network and pid else [])
    errors: list[str] = []
    for net, pid_ns in wanted:
        flags = (_CLONE_NEWNET if net else 0) | (_CLONE_NEWPID | _CLONE_NEWNS if pid_ns else 0)
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | flags) == 0:
            global in_user_namespace
            in_user_namespace = True
            try:
                for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            except OSError:
                pass  # still in the namespaces; only the uid the reward code sees differs
            return net, pid_ns, "; ".join(errors)
        errors.append(f"unshare(CLONE_NEWUSER|{_names(flags)}): {os.strerror(ctypes.get_errno())}")
        if libc.unshare(flags) == 0:  # root without user namespaces
            return net, pid_ns, "; ".join(errors)
        errors.append(f"unshare({_names(flags)}): {os.strerror(ctypes.get_errno())}")
    return False, False, "; ".join(errors)


def _names(flags: int) -> str:
    names = [n for bit, n in ((_CLONE_NEWNET, "CLONE_NEWNET"), (_CLONE_NEWPID, "CLONE_NEWPID"),
                              (_CLONE_NEWNS, "CLONE_NEWNS")) if flags & bit]
    return "|".join(names)


def enter_pid_namespace(launcher_closes: tuple[int, ...]) -> str:
    """After unshare(pid=True): fork. Returns in the child, pid 1 of the new namespace with /proc
    mounted for it ("" or why /proc could not be, in words: then /proc shows the host's pids and
    `foreign_proc` is set). The parent never returns: it closes `launcher_closes` (the pipes, so that
    the worker's end alone keeps them open), relays signals to the child and exits as it does."""
    global foreign_proc
    child = os.fork()
    if child == 0:
        libc = _libc()
        # Die with the launcher: the trainer may SIGKILL it alone (kill() when the group is gone).
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0))
        # Our mounts must not propagate to the host's; then a /proc that shows only this namespace.
        ok = libc.mount(b"none", b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) == 0 and libc.mount(
            b"proc", b"/proc", b"proc", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), None) == 0
        if ok:
            return ""
        foreign_proc = True
        return f"mounting a /proc for the PID namespace failed ({os.strerror(ctypes.get_errno())})"
    _launch(child, launcher_closes)


def contain(scratch: str, scratch_mb: int, max_processes: int) -> dict[str, str]:
    """As pid 1 of our own PID and mount namespaces: a tmpfs of `scratch_mb` MiB over the scratch
    folder (what the reward writes there counts against it, and is gone with the namespace), and
    the namespace's pid_max (Linux 6.14+) so that it holds fewer than `max_processes` processes at
    once. {"scratch": ..., "processes": ...}: what holds, in words ("" where it could not be)."""
    held = {"scratch": "", "processes": ""}
    libc = _libc()
    options = f"size={scratch_mb}m,mode=0700".encode()
    if libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), options) == 0:
        held["scratch"] = f"tmpfs of {scratch_mb} MiB"
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(max(_PID_MAX_MIN, max_processes)))
        held["processes"] = f"pid_max {max(_PID_MAX_MIN, max_processes)} in its PID namespace"
    except OSError:
        pass        # before Linux 6.14 pid_max is the host's alone
    return held


def _launch(child: int, closes: tuple[int, ...]) -> None:
    faulthandler.disable()  # the worker's stack matters, not the launcher's
    for fd in closes:
        os.close(fd)

    def relay(signum: int, _frame: Any) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in _RELAYED:
        signal.signal(signum, relay)
    _, status = os.waitpid(child, 0)  # retried after each relayed signal (PEP 475)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die the same way, so the trainer reports how
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
