"""Landlock for the grader's worker: what the reward function may read, write and run, and whom it
may signal, enforced by the kernel for the worker and every process it starts.

Landlock is allow-only: each handled right is denied everywhere but beneath the paths given a rule.
`restrict` handles reading files and listing folders, running programs, and every right that
changes the filesystem (ABI 1, Linux 5.13), moving files between folders (ABI 2) and truncating
(ABI 3); with ABI 4 (Linux 6.7) every TCP bind and connect; with ABI 6 (Linux 6.12) signals to
processes outside the sandbox and connecting to abstract unix sockets made outside it (scopes).
Rules also keep the sandbox from ptrace-ing, or reading /proc/<pid>/environ and mem of, processes
outside it, and from mounting anything.

Stdlib and ctypes only: it runs in the worker, before the reward module is imported.
"""

from __future__ import annotations

import ctypes
import os
import stat
from typing import Any, Iterable

# linux/landlock.h. The syscall numbers are the same on every architecture: they came after the
# tables were unified at 424.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
# ABI 1's rights that change the filesystem: write a file (bit 1), remove a directory or a file,
# make a character device, directory, regular file, socket, fifo, block device or symlink (4-12).
CHANGES = WRITE_FILE | sum(1 << bit for bit in range(4, 13))
_REFER = 1 << 13  # ABI 2: link or move a file into another directory
TRUNCATE = 1 << 14  # ABI 3
READ = READ_FILE | READ_DIR
RUN = READ | EXECUTE  # the dynamic loader reads what it maps; exec needs both on the binary
ALL = RUN | CHANGES | _REFER | TRUNCATE
# Of those, the ones a rule on a single file (not a folder) may grant; others make the rule EINVAL.
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
SCOPE_ABI = 6


class _RulesetAttr(ctypes.Structure):
    # The ABI 6 struct; the kernel accepts it whole from older ABIs on as long as the fields it does
    # not know are zero (copy_struct_from_user), and each field is set only where the ABI has it.
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header too
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall(libc: Any, name: str, number: int, *args: Any) -> int:
    result = libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")
    return result


def abi() -> tuple[int, str]:
    """(the kernel's Landlock ABI version, "") or (0, why there is none, in words)."""
    try:
        libc = _libc()
    except OSError as error:
        return 0, f"there is no C library to call it through ({error})"
    try:
        version = _syscall(libc, "landlock_create_ruleset", _SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except OSError as error:
        return 0, (f"the kernel offers no Landlock ({error.strerror}): it needs Linux 5.13+ with landlock among "
                   f"its LSMs (CONFIG_SECURITY_LANDLOCK, and lsm=...,landlock on the kernel command line)")
    return version, ""


def no_new_privs() -> None:
    """PR_SET_NO_NEW_PRIVS, which Landlock and seccomp both insist on: no setuid program the reward
    runs can shed them. Raises OSError."""
    libc = _libc()
    zero = ctypes.c_ulong(0)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero):
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")


def restrict(rules: Iterable[tuple[str, int]], version: int) -> dict[str, bool]:
    """Confine this process and its future children: each (path, rights) grants those rights beneath
    the path (only the file rights on a file); a path that does not exist is skipped. `version` is
    what abi() returned. Returns which optional parts are in force: "scoped" (signals and abstract
    unix sockets, ABI 6) and "tcp" (TCP bind/connect denied, ABI 4). Raises OSError.

    Call it in a single-threaded process: it restricts the calling thread and what it starts.
    """
    handled = RUN | CHANGES | (_REFER if version >= 2 else 0) | (TRUNCATE if version >= 3 else 0)
    tcp = version >= 4
    scoped = version >= SCOPE_ABI
    libc = _libc()
    attr = _RulesetAttr(handled, (_NET_BIND_TCP | _NET_CONNECT_TCP) if tcp else 0,
                        (_SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET) if scoped else 0)
    ruleset = _syscall(libc, "landlock_create_ruleset", _SYS_CREATE_RULESET, ctypes.byref(attr),
                       ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this node (lib64, a missing site-packages): nothing to allow
            try:
                allowed &= handled
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= _FILE_RIGHTS
                rule = _PathBeneathAttr(allowed, fd)
                _syscall(libc, f"landlock_add_rule({path})", _SYS_ADD_RULE, ctypes.c_int(ruleset),
                         ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        no_new_privs()
        _syscall(libc, "landlock_restrict_self", _SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return {"scoped": scoped, "tcp": tcp}
