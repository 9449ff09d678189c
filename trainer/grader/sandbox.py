"""The grader worker's sandbox: what confines the user's reward function, in layers.

`apply_sandbox` is called by the worker (`grpo_run.trainer.grader.worker`) before the reward module
is imported, so its top level is confined too. The reward function may be untrusted code (planted
through the bucket): it must take nothing of the node's. Each layer, and which are in force (the
`mode` the worker reports and `Grader.sandbox_mode` exposes):
  * environment (the parent's doing, `grpo_run.trainer.grader.process`): an allow-list, with no
    credentials; $HOME and $TMPDIR are the scratch directory;
  * network ("netns" | "python"): a fresh network namespace (no interfaces up, not even loopback)
    where the kernel lets us make one (`namespaces`); Python-level refusals of sockets and name
    lookups in every mode, so a reward that tries gets a clear "refused";
  * seccomp ("on" | "off"): no socket() or connect() at all, datagram socketpairs, io_uring or
    reading other processes (`seccomp`): pathname unix sockets on the host and 169.254.169.254 stay
    out of reach even where no namespace could be made;
  * filesystem ("landlock" | "python"): reads only of the reward's own folder and search path, as
    far as the parent grants them (`reach`: never the home folder, its hidden folders, /tmp,
    GRPO_RUN_HOME or mounted secrets; else the reward's file alone), the Python installation, the system's programs and
    libraries, a few harmless files of /etc, /dev/null and /dev/urandom, /proc/self and the scratch
    directory; writes only inside the scratch directory (made by the parent, removed with the
    worker; the worker's cwd, $TMPDIR and $HOME) and to /dev/null; programs run only from those
    folders. Landlock (`landlock`) enforces it in the kernel, for every process the reward function
    starts too. An audit hook refuses the same through Python first, so the failure says what was
    refused and why, and counts as "refused" (never retried, never a score); where Landlock is
    unavailable that hook is all there is (best effort: C code and other programs get past it).
    Refusals below Python get Landlock's bare "Permission denied", so a failure carrying one gets
    a note that the sandbox may be why. This rules out multiprocessing's locks and queues (POSIX
    semaphores, files in /dev/shm), hence multiprocessing.Queue and ProcessPoolExecutor, and
    Manager (a unix socket); Process and Pipe work;
  * signals ("landlock" | "pidns" | "none"): Landlock's scope (ABI 6, Linux 6.12) keeps the reward
    from signalling any process outside its sandbox; and wherever one can be made (on older kernels
    it is the signal layer itself) the worker is pid 1 of its own PID namespace (`namespaces`),
    where no process of the node has a pid;
  * processes: os.fork() is refused (a forked copy of the worker would carry on in its serve
    loop); multiprocessing's fork start method is let through, as its children always exit. A
    copy forked below Python (ctypes, C code) that returns into the worker's serve loop exits
    before it can answer. The worker is a child subreaper: processes an item leaves running,
    grandchildren included, are killed (`end_leftover_processes`) before the item's answer is
    sent. Those started while the module was imported are its helpers (a REPL, a server) and live
    as long as the worker;
  * limits on the whole tree (`namespaces.contain`, reported as the sandbox frame's "limits"): the
    worker is pid 1 of a PID namespace wherever one can be made, so every process the reward
    starts, in a session of its own or not, dies with it; at most MAX_PROCESSES at once (the
    namespace's pid_max, Linux 6.14+; RLIMIT_NPROC in its user namespace for a user other than
    root); the scratch directory a tmpfs of scratch_mb; RLIMIT_FSIZE of scratch_mb on every file;
  * memory: RLIMIT_AS per process, so allocations past the limit raise MemoryError; the tree as a
    whole is bounded by its cgroup (`cgroup`, made by the trainer, joined by the worker first
    thing) where the node gives one;
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
from typing import Any, Sequence

from grpo_run.trainer.grader import landlock, namespaces, seccomp

_PR_SET_CHILD_SUBREAPER = 36
# At most this many processes at once in the reward's PID namespace (its pid_max, Linux 6.14+) or,
# for a user other than root, in its user namespace (RLIMIT_NPROC): a fork bomb stops there.
MAX_PROCESSES = 301
_MAX_KILL_ROUNDS = 100  # each round kills the children orphaned by the previous one
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# What the interpreter and the programs a reward runs need besides the Python installation: the
# system's programs and libraries (the dynamic loader reads /etc/ld.so.cache), the time zone, user
# names (not /etc/shadow), file types, the machine's cores and memory. Nothing here holds a secret.
_SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.preload", "/etc/localtime", "/etc/timezone", "/etc/passwd",
                 "/etc/group", "/etc/nsswitch.conf", "/etc/mime.types", "/etc/os-release",
                 "/proc/cpuinfo", "/proc/meminfo")
_READ_ONLY = ("/sys/devices/system/cpu",  # how many cores (os.cpu_count, BLAS)
              "/dev/urandom", "/dev/random", "/dev/zero", "/proc/self")
_NETWORK_EVENTS = {  # audit event -> what it does; all refused (socket.__new__ and send* in part)
    "socket.__new__": "opening a network socket",
    "socket.connect": "connecting a socket",
    "socket.bind": "binding a socket",
    "socket.sendto": "sending to an address",
    "socket.sendmsg": "sending to an address",
    "socket.getaddrinfo": "looking up a host name",
    "socket.gethostbyname": "looking up a host name",
    "socket.gethostbyaddr": "looking up an address",
    "socket.getnameinfo": "looking up an address",
}


# filesystem -----------------------------------------------------------------------------------


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def readable_rules(scratch: str, reward_files: Sequence[str], search_path: Sequence[str],
                   protected: Sequence[str], reward_folder: bool = True) -> list[tuple[str, int]]:
    """(path, Landlock rights) of everything the reward function may read (and run, and in the
    scratch directory change). Computed from this interpreter's sys.path before the reward's folders
    are added: the installation, the grpo_run package (an editable install's source folder too; the
    catalog's rewards are ours); an installation folder that is / or holds one of `protected` (the
    node's home and temporary folders) is never granted. Which of the reward's own folders it may
    have is the parent's decision (`reach`): `search_path` holds only those, and without
    `reward_folder` a reward file gets a rule for itself alone. `reward_files`: the reward's (or
    environment's) file, and an environment's tools' files."""
    import grpo_run.trainer  # already imported: this module is part of it

    def broad(folder: str) -> bool:
        return folder == os.sep or any(_inside(p, folder) for p in protected)

    installation = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                    *grpo_run.trainer.__path__, *(p for p in sys.path if p and os.path.isdir(p))}
    rules = [(folder, landlock.RUN) for folder in _SYSTEM_FOLDERS]
    rules += [(os.path.realpath(p), landlock.RUN) for p in sorted(installation) if not broad(os.path.realpath(p))]
    rules += [(path, landlock.READ_FILE) for path in _SYSTEM_FILES]
    rules += [(path, landlock.READ) for path in _READ_ONLY]
    rules += [(os.devnull, landlock.READ_FILE | landlock.WRITE_FILE | landlock.TRUNCATE), (scratch, landlock.ALL)]
    for reward_file in reward_files:
        folder = os.path.dirname(reward_file)
        rules.append((folder, landlock.RUN) if reward_folder and not broad(folder) else (reward_file, landlock.READ_FILE))
    rules += [(os.path.realpath(p), landlock.RUN) for p in search_path if not broad(os.path.realpath(p))]
    return rules


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
    """An audit hook that refuses, inside Python, what the sandbox does not allow: reading outside
    the readable folders, changing the filesystem outside the scratch directory, the network, and
    os.fork().

    Landlock and seccomp would refuse most of it with a bare "Permission denied" or "Operation not
    permitted"; refusing first gives an error that says what was refused and why, and marks it
    (`grader_refusal`) so that the item counts as refused. Where they are unavailable this hook is
    all there is.
    """

    def __init__(self, scratch: str, readable: Sequence[tuple[str, int]]) -> None:
        self.scratch = os.path.realpath(scratch)
        self.folders: list[str] = []
        self.files: set[str] = {os.devnull}
        for path, _rights in readable:
            real = os.path.realpath(path)
            if os.path.isdir(real):
                self.folders.append(real)
            elif os.path.exists(real):
                self.files.add(real)

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open":
            path, _mode, flags = args
            if flags & _WRITE_FLAGS:
                self._check("writing to", _changed_path(path, None, follow=True))
            elif not flags & getattr(os, "O_PATH", 0):
                self._check_read("reading", path)
        elif event in ("os.listdir", "os.scandir"):
            self._check_read("listing", args[0] if args[0] is not None else ".")
        elif event in _CHANGES:
            what, at, dir_fd_at = _CHANGES[event]
            dir_fd = args[dir_fd_at] if dir_fd_at is not None else None
            target = _changed_path(args[at], dir_fd, follow=event == "os.truncate")
            if event == "os.rename":
                self._check("moving", _changed_path(args[0], args[2], follow=False))
            if event == "os.mkdir" and target is not None and os.path.lexists(target):
                return  # fails with FileExistsError as it would anyway (os.makedirs(exist_ok=True))
            self._check(what, target)
        elif event in _NETWORK_EVENTS:
            self._check_network(event, args)
        elif event in ("os.fork", "os.forkpty"):
            self._check_fork()

    def _check(self, what: str, target: str | None) -> None:
        if target is None or target == os.devnull or _inside(target, self.scratch):
            return
        _refuse(
            f"{what} {target!r} was refused: a reward function may write only in its scratch "
            f"directory {self.scratch} (its working directory, $TMPDIR and $HOME, removed with the "
            f"worker) and to /dev/null",
            errno.EACCES,
        )

    def _check_read(self, what: str, path: Any) -> None:
        target = _changed_path(path, None, follow=True)
        if target is None or target in self.files or any(_inside(target, f) for f in self.folders):
            return
        _refuse(
            f"{what} {target!r} was refused: a reward function may read only its own folder (and "
            f"search_path), the Python installation, the system's programs and libraries, and its "
            f"scratch directory {self.scratch}; give it what it needs in the task, or next to its file",
            errno.EACCES,
        )

    def _check_network(self, event: str, args: tuple) -> None:
        if event == "socket.__new__" and args[1] == socket.AF_UNIX:
            return  # socketpair() (multiprocessing.Pipe) wraps its sockets; a bare one is seccomp's
        if event in ("socket.sendto", "socket.sendmsg") and args[1] is None:
            return  # on a connected socket: the peer is the other end of a socketpair
        _refuse(
            f"network access is disabled in the grader: {_NETWORK_EVENTS[event]} was refused; a reward "
            f"function may not reach the network or any socket but its own socketpair()s",
            errno.EPERM,
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
    after each item finds them. A no-op where prctl is missing (and as pid 1 of a PID namespace,
    it is its namespace's init anyway)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


# The worker's own /proc files, opened once (pid, its stat, its main thread's children): while it
# runs one thread, its children are read with two preads, no path looked up. Looking them up (and
# the sandbox's audit hook resolving each path) after every reward call cost about 60 us a call,
# most of what scoring a completion of the arithmetic environment costs.
_own_proc: tuple[int, int, int] | None = None
_CHILDREN_READ = 1 << 16


def _children_of_one_thread(me: int) -> set[int] | None:
    """This process's children when it has one thread, from its pre-opened /proc files; None when
    it has more (each thread has its own children) or the files cannot be read as expected."""
    global _own_proc
    try:
        if _own_proc is None or _own_proc[0] != me:
            stat = os.open(f"/proc/{me}/stat", os.O_RDONLY | os.O_CLOEXEC)
            children = os.open(f"/proc/{me}/task/{me}/children", os.O_RDONLY | os.O_CLOEXEC)
            _own_proc = (me, stat, children)
        _, stat, children = _own_proc
        after_name = os.pread(stat, 4096, 0).rsplit(b")", 1)[1].split()
        if int(after_name[17]) != 1:         # num_threads, stat's 20th field (state is the 3rd)
            return None
        listed = os.pread(children, _CHILDREN_READ, 0)
    except (OSError, ValueError, IndexError):
        return None
    if len(listed) >= _CHILDREN_READ:         # more than one read holds: the full scan below
        return None
    return {int(pid) for pid in listed.split()}


def children_of() -> set[int]:
    """This process's children, running or not yet reaped. Empty in a PID namespace whose /proc is
    the host's: its pids are not ours to kill (`end_leftover_processes` kills the whole namespace)."""
    me = os.getpid()
    pids: set[int] = set()
    if namespaces.foreign_proc:
        return pids
    one_thread = _children_of_one_thread(me)
    if one_thread is not None:
        return one_thread
    if os.path.exists(f"/proc/{me}/task/{me}/children"):
        for tid in os.listdir(f"/proc/{me}/task"):
            try:
                with open(f"/proc/{me}/task/{tid}/children") as f:
                    pids.update(int(pid) for pid in f.read().split())
            except FileNotFoundError:
                pass  # the thread ended meanwhile
        return pids
    # A kernel without CONFIG_PROC_CHILDREN: every process's parent, from its stat line. The
    # sandbox lets us read no other process's /proc: then leftovers live until the worker's group
    # is killed.
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                pids.add(int(entry))
    return pids


def end_leftover_processes(keep: frozenset[int]) -> None:
    """SIGKILL and reap every child but those in `keep`. Their own children are orphaned onto us
    (a subreaper), so repeat until none is left; a fork bomb that outpaces this dies with the
    worker's process group, which the parent kills."""
    if namespaces.foreign_proc:
        _end_namespace()
        return
    for _ in range(_MAX_KILL_ROUNDS):
        leftover = children_of() - keep
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


def _end_namespace() -> None:
    """As pid 1 of a PID namespace whose children we cannot list: kill(-1) reaches every other
    process in the namespace (helpers too), and every orphan there is ours to reap."""
    for _ in range(_MAX_KILL_ROUNDS):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return  # nobody left
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass


# applying it ----------------------------------------------------------------------------------


_landlock_scratch = ""  # the scratch directory once Landlock confines writes to it
_seccomp_on = False


def apply_sandbox(*, memory_mb: int, network: str, filesystem: str, signals: str, scratch: str,
                  reward_files: Sequence[str], search_path: Sequence[str], protected: Sequence[str],
                  reward_folder: bool, launcher_closes: tuple[int, ...], scratch_mb: int = 1024,
                  max_processes: int = MAX_PROCESSES) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Confine this process; returns what is in force, for the sandbox frame: the mode
    {"network": "netns"|"python", "filesystem": "landlock"|"python", "signals": "landlock"|"pidns"|
    "none", "seccomp": "on"|"off"}, {layer: why it is not in force (or in part), in words} and the
    limits on the reward's whole process tree, in words ({"contained": how every process it starts
    ends with the worker, "processes": ..., "scratch": ..., "file size": ...}; "" where none holds).

    network, filesystem, signals: "auto" takes the strongest the kernel allows; "python" (network,
    filesystem) or a named mechanism ("pidns") asks for that one. Whether a layer must be in force
    is the worker's decision (strict). With a PID namespace this forks (`namespaces`): only the
    child returns; `launcher_closes` are the file descriptors the launcher closes.
    """
    global _landlock_scratch, _seccomp_on
    why: dict[str, str] = {}
    version, no_landlock = (0, "filesystem='python' was asked for") if filesystem == "python" else landlock.abi()
    scope = version >= landlock.SCOPE_ABI and signals != "pidns"
    # Namespaces first: joining a user namespace writes /proc/self/uid_map, which Landlock forbids.
    # A PID namespace wherever one can be made, with Landlock's scope too: when its pid 1 (the
    # worker) dies, the kernel kills every process in it, setsid()'d or not.
    net, pid, ns_why = namespaces.unshare(network != "python", True)
    limits = {"contained": "", "processes": "", "scratch": "", "file size": ""}
    if pid:
        proc_why = namespaces.enter_pid_namespace(launcher_closes)
        if proc_why:
            why["signals"] = f"{proc_why}: the worker kills every process of its namespace after each item"
        limits["contained"] = "a PID namespace: every process the reward starts dies with the worker"
        limits.update(namespaces.contain(scratch, scratch_mb, max_processes))
    if namespaces.in_user_namespace and os.geteuid() != 0:   # root's processes are never counted
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
        limits["processes"] = limits["processes"] or f"RLIMIT_NPROC {max_processes} in its user namespace"
    file_limit = scratch_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # a write past it fails with EFBIG instead of killing
    limits["file size"] = f"RLIMIT_FSIZE {scratch_mb} MiB"
    if not net:
        why["network"] = ns_why or "network='python' was asked for"
    rules = readable_rules(scratch, reward_files, search_path, protected, reward_folder)
    scoped = False
    if version:
        try:
            scoped = landlock.restrict(rules, version)["scoped"] and scope
            _landlock_scratch = scratch
        except OSError as error:
            no_landlock = f"Landlock could not be set up ({error.strerror})"
    if not _landlock_scratch:
        why["filesystem"] = no_landlock
    if not scoped and not pid:
        why["signals"] = "; ".join(filter(None, [
            f"this kernel's Landlock (ABI {version}) has no signal scope (ABI {landlock.SCOPE_ABI}, Linux 6.12)"
            if version else no_landlock,
            ns_why if signals != "landlock" else "",
            f"signals={signals!r} was asked for" if signals != "auto" else "",
        ]))
    try:
        landlock.no_new_privs()  # set already where Landlock is in force
        no_seccomp = seccomp.install()
    except OSError as error:
        no_seccomp = str(error)
    _seccomp_on = not no_seccomp
    if no_seccomp:
        why["seccomp"] = no_seccomp
    sys.addaudithook(_Refusals(scratch, rules))
    sys.dont_write_bytecode = True  # a __pycache__ next to the user's module would be refused
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # nor by the Python programs it runs
    for var in ("TMPDIR", "TEMP", "TMP", "HOME"):
        os.environ[var] = scratch
    os.chdir(scratch)
    _become_subreaper()
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    mode = {
        "network": "netns" if net else "python",
        "filesystem": "landlock" if _landlock_scratch else "python",
        "signals": "landlock" if scoped else "pidns" if pid else "none",
        "seccomp": "on" if _seccomp_on else "off",
    }
    return mode, why, limits
