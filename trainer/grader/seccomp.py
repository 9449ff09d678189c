"""A seccomp filter for the grader's worker: no sockets but socketpair, whatever namespaces the node
allows.

A network namespace leaves pathname unix sockets reachable (systemd-resolved's varlink socket for
DNS, D-Bus, docker.sock, a CRI socket, a listener of the trainer's), and where no namespace can be
made, nothing in the kernel stopped a reward from reaching 169.254.169.254 (instance-role
credentials) with ctypes or `curl`. This filter makes these system calls fail with EPERM for the
worker and everything it starts:
  * socket() and connect(), for every family: a reward function needs neither;
  * socketpair() of datagram sockets: a datagram socket may send to any address with sendto(),
    a host's /dev/log or journal socket included. Stream pairs (multiprocessing.Pipe) still work;
  * io_uring: its rings open and connect sockets without these system calls;
  * ptrace, process_vm_readv/writev, pidfd_getfd: reading another process's memory (the trainer's
    environment holds its credentials) or taking its file descriptors. Landlock refuses these too,
    where the kernel has it;
  * open_by_handle_at: opening files by handle, around path-based rules;
  * prctl(PR_SET_PDEATHSIG): the worker of a PID namespace dies with its launcher; the reward
    function may not undo that.
The filter is x86_64 only (its system call numbers); elsewhere `install` says why it is not in
force. System calls made through the 32-bit ABI (int 0x80) or the x32 ABI, whose numbers differ,
are all refused.

Stdlib and ctypes only: it runs in the worker, before the reward module is imported.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Any

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
# x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl)
_SOCKET, _CONNECT, _SOCKETPAIR, _PTRACE, _PRCTL = 41, 42, 53, 101, 157
_OPEN_BY_HANDLE_AT, _PROCESS_VM_READV, _PROCESS_VM_WRITEV = 304, 310, 311
_IO_URING_SETUP, _IO_URING_ENTER, _IO_URING_REGISTER, _PIDFD_GETFD = 425, 426, 427, 438
_DENIED = (_SOCKET, _CONNECT, _PTRACE, _OPEN_BY_HANDLE_AT, _PROCESS_VM_READV, _PROCESS_VM_WRITEV,
           _IO_URING_SETUP, _IO_URING_ENTER, _IO_URING_REGISTER, _PIDFD_GETFD)
_SOCK_DGRAM, _SOCK_TYPE_MASK = 2, 0xF  # the type argument also carries SOCK_NONBLOCK and SOCK_CLOEXEC
_PR_SET_PDEATHSIG = 1

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian)
_NR, _ARCH = 0, 4


def _arg_low(i: int) -> int:
    return 16 + 8 * i  # the low 32 bits of args[i]


# classic BPF
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | errno.EPERM
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _program() -> list[tuple[int, Any, Any, int]]:
    """The filter as (code, jump if true, jump if false, k); jumps are labels, resolved by _assemble."""
    prog: list[tuple[int, Any, Any, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "deny", _AUDIT_ARCH_X86_64),  # other ABIs number their system calls differently
        (_LD_W_ABS, 0, 0, _NR),
        (_JGE_K, "deny", 0, _X32_SYSCALL_BIT),
    ]
    prog += [(_JEQ_K, "deny", 0, nr) for nr in _DENIED]
    prog += [
        (_JEQ_K, "socketpair", 0, _SOCKETPAIR),
        (_JEQ_K, "prctl", 0, _PRCTL),
        (_RET_K, 0, 0, _RET_ALLOW),
        "socketpair",
        (_LD_W_ABS, 0, 0, _arg_low(1)),
        (_AND_K, 0, 0, _SOCK_TYPE_MASK),
        (_JEQ_K, "deny", 0, _SOCK_DGRAM),
        (_RET_K, 0, 0, _RET_ALLOW),
        "prctl",
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JEQ_K, "deny", 0, _PR_SET_PDEATHSIG),
        (_RET_K, 0, 0, _RET_ALLOW),
        "deny",
        (_RET_K, 0, 0, _RET_EPERM),
    ]
    return prog  # type: ignore[return-value]


def _assemble(prog: list) -> list[tuple[int, int, int, int]]:
    labels: dict[str, int] = {}
    code: list[tuple[int, Any, Any, int]] = []
    for entry in prog:
        if isinstance(entry, str):
            labels[entry] = len(code)
        else:
            code.append(entry)

    def offset(at: int, target: Any) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - at - 1  # relative to the next instruction
        assert 0 <= jump < 256, "a BPF jump is one byte"
        return jump

    return [(c, offset(i, jt), offset(i, jf), k) for i, (c, jt, jf, k) in enumerate(code)]


def install() -> str:
    """Install the filter on this process and what it starts; "" once in force, else why not, in
    words. PR_SET_NO_NEW_PRIVS must already be set (landlock.no_new_privs)."""
    if platform.machine() != "x86_64":
        return f"the filter's system call numbers are x86_64's and this is {platform.machine() or 'unknown'}"
    instructions = _assemble(_program())
    array = (_SockFilter * len(instructions))(*(_SockFilter(*i) for i in instructions))
    prog = _SockFprog(len(instructions), array)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as error:
        return f"there is no C library to call it through ({error})"
    zero = ctypes.c_ulong(0)
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog), zero, zero):
        code = ctypes.get_errno()
        return (f"prctl(PR_SET_SECCOMP) failed ({os.strerror(code)}): the kernel needs CONFIG_SECCOMP_FILTER, "
                f"and no_new_privs must be set")
    return ""
