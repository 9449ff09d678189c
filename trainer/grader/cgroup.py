"""A cgroup for a reward's whole process tree: its memory (the scratch tmpfs included, whose pages
are charged to it) and its number of processes bounded together, not per process.

Made by the trainer for each worker it starts, where the node gives it one:
  * cgroup v2: the trainer's cgroup is a leaf of one delegated to grpo-run (the systemd unit's
    `Delegate=` with `DelegateSubgroup=supervisor`; systemd marks a delegated cgroup with the
    `user.delegate` or `trusted.delegate` attribute). The reward's cgroup is a sibling of the
    trainer's: memory.max, memory.swap.max 0, memory.oom.group (the tree goes as one), pids.max.
  * cgroup v1: the memory (and pids) hierarchies are mounted and the trainer's own cgroup there is
    writable (a root process on such a node): a child of it with memory.limit_in_bytes (and
    memory.memsw.limit_in_bytes where swap is accounted) and pids.max.
Elsewhere (a read-only /sys/fs/cgroup, as in most containers) there is none and the per-process
limits alone hold: `made` says why, in words.

The worker puts itself in (`join`) before anything else, so every process it or the reward
starts is born inside. The trainer removes the cgroup once the worker is gone, and removes those
a trainer killed before it could (their pid no longer alive) the next time it makes one.

Stdlib only: `join` runs in the worker.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

PREFIX = "grpo-run-reward-"
_MOUNTINFO = "/proc/self/mountinfo"
_OWN = "/proc/self/cgroup"
_DELEGATE_MARKS = ("user.delegate", "trusted.delegate")
_count = 0   # cgroups made by this process so far: part of each one's name


@dataclass
class TreeCgroup:
    """The cgroup folders made for one worker (a memory and a pids folder on v1, one on v2)."""

    version: int
    folders: list[str]
    memory_bytes: int
    words: str

    def join_settings(self) -> dict:
        """What the worker's config carries to `join` itself."""
        return {"procs": [os.path.join(f, "cgroup.procs") for f in self.folders], "words": self.words}

    def oom_kills(self) -> int:
        """How many of the tree's processes the kernel killed at the memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.folders[0], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, wait_s: float = 2.0) -> bool:
        """Remove the folders once the worker's processes are gone (the last ones of a PID
        namespace may take a moment to be reaped); False where one stays."""
        deadline = time.monotonic() + wait_s
        while not all([_rmdir(f) for f in self.folders]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return not any(os.path.exists(f) for f in self.folders)


def make(memory_mb: int, max_processes: int) -> tuple[TreeCgroup | None, str]:
    """A cgroup bounding a tree to `memory_mb` MiB and `max_processes` processes, or (None, why
    there is none, in words)."""
    global _count
    try:
        own = _own_cgroups()
        mounts = _mounts()
    except OSError as error:
        return None, f"this node's cgroups cannot be read ({error.strerror})"
    _count += 1
    name = f"{PREFIX}{os.getpid()}-{_count}"
    limit = memory_mb * 1024 * 1024
    made, why_v2 = _make_v2(own, mounts, name, limit, max_processes)
    if made:
        return made, ""
    made, why_v1 = _make_v1(own, mounts, name, limit, max_processes)
    if made:
        return made, ""
    return None, "; ".join(filter(None, [why_v2, why_v1]))


def join(settings: dict | None) -> str:
    """In the worker, first thing: move this process into its cgroup. The limit in words, or ""
    where there is none (or it could not be joined: the reward then runs under the per-process
    limits alone, and the sandbox frame says so)."""
    if not settings:
        return ""
    pid = str(os.getpid())
    try:
        for procs in settings["procs"]:
            with open(procs, "w") as f:
                f.write(pid)
    except OSError:
        return ""
    return str(settings["words"])


# v2 ---------------------------------------------------------------------------------------------


def _make_v2(own: dict[str, str], mounts: dict[str, str], name: str, limit: int,
             max_processes: int) -> tuple[TreeCgroup | None, str]:
    if "" not in own or "cgroup2" not in mounts:
        return None, ""
    mine = _join_path(mounts["cgroup2"], own[""])
    delegated = os.path.dirname(mine)
    if not _delegated(delegated):
        return None, (f"cgroup v2: {delegated} is not delegated to grpo-run (the systemd unit's Delegate= "
                      f"with DelegateSubgroup=)")
    try:
        controllers = _read(os.path.join(delegated, "cgroup.controllers")).split()
        if "memory" not in controllers:
            return None, f"cgroup v2: {delegated} has no memory controller"
        wanted = [c for c in ("memory", "pids") if c in controllers]
        enabled = _read(os.path.join(delegated, "cgroup.subtree_control")).split()
        if any(c not in enabled for c in wanted):
            _write(os.path.join(delegated, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))
        _sweep(delegated)
        folder = os.path.join(delegated, name)
        os.mkdir(folder)
    except OSError as error:
        return None, f"cgroup v2: {delegated}: {error.strerror}"
    try:
        _write(os.path.join(folder, "memory.max"), str(limit))
        for optional, value in (("memory.swap.max", "0"), ("memory.oom.group", "1"), ("pids.max", str(max_processes))):
            if os.path.exists(os.path.join(folder, optional)):
                _write(os.path.join(folder, optional), value)
    except OSError as error:
        _rmdir(folder)
        return None, f"cgroup v2: {folder}: {error.strerror}"
    pids = f", at most {max_processes} processes" if "pids" in wanted else ""
    words = f"a cgroup (v2) of {limit >> 20} MiB for all its processes and its scratch together{pids}"
    return TreeCgroup(2, [folder], limit, words), ""


def _delegated(folder: str) -> bool:
    for mark in _DELEGATE_MARKS:
        try:
            if os.getxattr(folder, mark) == b"1":
                return True
        except OSError:
            continue
    return False


# v1 ---------------------------------------------------------------------------------------------


def _make_v1(own: dict[str, str], mounts: dict[str, str], name: str, limit: int,
             max_processes: int) -> tuple[TreeCgroup | None, str]:
    if "memory" not in own or "memory" not in mounts:
        return None, "" if "" in own else "no cgroup memory controller is mounted"
    made: list[str] = []

    def child(controller: str) -> str:
        """A new cgroup `name` under this process's own in the `controller` hierarchy."""
        parent = _join_path(mounts[controller], own[controller])
        _sweep(parent)
        folder = os.path.join(parent, name)
        os.mkdir(folder)
        made.append(folder)
        return folder

    try:
        folder = child("memory")
        _write(os.path.join(folder, "memory.limit_in_bytes"), str(limit))
        memsw = os.path.join(folder, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            _write(memsw, str(limit))          # swap counted too: no room past the limit on swap
        if "pids" in own and "pids" in mounts:
            _write(os.path.join(child("pids"), "pids.max"), str(max_processes))
    except OSError as error:
        for folder in reversed(made):
            _rmdir(folder)
        return None, f"cgroup v1: {error.filename or 'memory'}: {error.strerror}"
    pids = f", at most {max_processes} processes" if len(made) == 2 else ""
    words = f"a cgroup (v1) of {limit >> 20} MiB for all its processes and its scratch together{pids}"
    return TreeCgroup(1, made, limit, words), ""


# the node's cgroups -----------------------------------------------------------------------------


def _own_cgroups() -> dict[str, str]:
    """{controller: this process's cgroup path}; "" for cgroup v2's unified hierarchy."""
    own: dict[str, str] = {}
    for line in _read(_OWN).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _mounts() -> dict[str, str]:
    """{controller: "mount point|root in its hierarchy"} for v1 hierarchies, "cgroup2" for v2."""
    mounts: dict[str, str] = {}
    for line in _read(_MOUNTINFO).splitlines():
        before, _, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, point = fields[3], fields[4]
        if rest[0] == "cgroup2":
            mounts.setdefault("cgroup2", f"{point}|{root}")
        elif rest[0] == "cgroup":
            for option in rest[2].split(","):
                mounts.setdefault(option, f"{point}|{root}")
    return mounts


def _join_path(mount: str, path: str) -> str:
    """The folder of cgroup `path` under a mount ("point|root": a container mounts its own cgroup
    as the hierarchy's root)."""
    point, root = mount.split("|", 1)
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _sweep(parent: str) -> None:
    """Remove the reward cgroups of trainers that were killed before they could."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _rmdir(os.path.join(parent, name))


def _rmdir(folder: str) -> bool:
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError:
        return False       # EBUSY: processes still in it
    return True


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def leave_delegated_root() -> str:
    """On a node whose service manager delegated this process's cgroup v2 to grpo-run (the systemd
    unit's `Delegate=yes`): move this process into a leaf `supervisor` of it, so that the delegated
    cgroup holds no process of its own and the reward cgroups can be made beside the leaf (cgroup
    v2 hands controllers to children only from a cgroup without processes). The trainers started
    afterwards are born in the leaf. The leaf, or "" where nothing was moved."""
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError:
        return ""
    if "" not in own or "cgroup2" not in mounts:
        return ""
    mine = _join_path(mounts["cgroup2"], own[""])
    if not _delegated(mine):
        return ""
    leaf = os.path.join(mine, "supervisor")
    try:
        os.makedirs(leaf, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
    except OSError:
        return ""
    return leaf
