"""Run Python the way a container under Docker's default seccomp profile runs it.

Docker's default profile refuses unshare() (EPERM) to a container without CAP_SYS_ADMIN, so no
user or network namespace can be made there: the reward sandbox loses its network layer. The
tests of `spec.sandbox: strict` need such a process without Docker: `without_namespaces(code)`
is a `python -c` program that installs a seccomp filter refusing unshare() to itself and
everything it starts, then runs `code`."""
from __future__ import annotations

import textwrap

UNSHARE = 272    # x86-64's syscall number

_PRELUDE = textwrap.dedent('''
    import ctypes
    from grpo_run.trainer.grader import seccomp
    from grpo_run.trainer.grader.landlock import no_new_privs
    _program = seccomp._assemble([(seccomp._LD_W_ABS, 0, 0, seccomp._NR), (seccomp._JEQ_K, "deny", 0, %d),
                                  (seccomp._RET_K, 0, 0, seccomp._RET_ALLOW), "deny",
                                  (seccomp._RET_K, 0, 0, seccomp._RET_EPERM)])
    _array = (seccomp._SockFilter * len(_program))(*(seccomp._SockFilter(*i) for i in _program))
    no_new_privs()
    assert ctypes.CDLL(None).prctl(22, 2, ctypes.byref(seccomp._SockFprog(len(_program), _array)), 0, 0) == 0
''') % UNSHARE


def without_namespaces(code: str) -> str:
    """A `python -c` program: unshare() refused from here on, then `code` (dedented)."""
    return _PRELUDE + textwrap.dedent(code)
