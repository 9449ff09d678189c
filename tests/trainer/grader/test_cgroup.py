"""Finding the cgroup a reward's tree goes in. The kernel's side is tested for real where this
node has one (tests/trainer/grader/test_hostile_reward.py: cgroup v1 here); cgroup v2, which this node
does not hand out, is tested on a folder laid out as the kernel lays out a systemd unit's
delegated cgroup, so the decisions (delegated or not, the controllers handed down, the limits
written, the supervisor's own leaf) are checked even here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpo_run.trainer.grader import cgroup


@pytest.fixture
def v2_node(tmp_path: Path, monkeypatch) -> Path:
    """A cgroup2 mount at tmp/cg with the unit's cgroup grpo-run.service, this process in its
    `supervisor` leaf (as `leave_delegated_root` leaves it)."""
    mount = tmp_path / "cg"
    unit = mount / "system.slice" / "grpo-run.service"
    (unit / "supervisor").mkdir(parents=True)
    (unit / "cgroup.controllers").write_text("cpu memory pids\n")
    (unit / "cgroup.subtree_control").write_text("")
    (unit / "cgroup.procs").write_text("")
    (tmp_path / "cgroup").write_text("0::/system.slice/grpo-run.service/supervisor\n")
    (tmp_path / "mountinfo").write_text(
        f"30 1 0:26 / {mount} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n")
    monkeypatch.setattr(cgroup, "_OWN", str(tmp_path / "cgroup"))
    monkeypatch.setattr(cgroup, "_MOUNTINFO", str(tmp_path / "mountinfo"))
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777):      # the kernel makes a new cgroup's files with the folder
        real_mkdir(path, mode)
        for name in ("cgroup.procs", "memory.max", "memory.swap.max", "memory.oom.group", "pids.max"):
            Path(path, name).write_text("")

    monkeypatch.setattr(cgroup.os, "mkdir", mkdir)
    return unit


def delegate(folder: Path) -> None:
    try:
        os.setxattr(folder, "user.delegate", b"1")
    except OSError as error:
        pytest.skip(f"this file system keeps no user.* attributes ({error.strerror})")


def test_v2_a_delegated_units_cgroup_gets_the_trees_beside_the_supervisors_leaf(v2_node):
    delegate(v2_node)
    tree, why = cgroup.make(256, 301)
    assert tree is not None, why
    (folder,) = tree.folders
    assert Path(folder).parent == v2_node and Path(folder).name.startswith(f"{cgroup.PREFIX}{os.getpid()}-")
    assert (v2_node / "cgroup.subtree_control").read_text() == "+memory +pids"    # handed down to the tree
    assert Path(folder, "memory.max").read_text() == str(256 << 20)
    assert Path(folder, "memory.swap.max").read_text() == "0"
    assert Path(folder, "memory.oom.group").read_text() == "1"
    assert Path(folder, "pids.max").read_text() == "301"
    assert tree.words == "a cgroup (v2) of 256 MiB for all its processes and its scratch together, at most 301 processes"
    assert tree.join_settings()["procs"] == [os.path.join(folder, "cgroup.procs")]
    Path(folder, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert tree.oom_kills() == 1


def test_v2_a_cgroup_not_delegated_is_left_alone_and_says_why(v2_node):
    tree, why = cgroup.make(256, 301)
    assert tree is None
    assert f"cgroup v2: {v2_node} is not delegated to grpo-run" in why
    assert (v2_node / "cgroup.subtree_control").read_text() == ""                 # nothing written
    assert [p.name for p in v2_node.iterdir() if p.is_dir()] == ["supervisor"]


def test_the_supervisor_moves_into_a_leaf_of_its_delegated_cgroup(v2_node, tmp_path):
    (tmp_path / "cgroup").write_text("0::/system.slice/grpo-run.service\n")       # as systemd starts it
    assert cgroup.leave_delegated_root() == ""                                     # not delegated: stays
    delegate(v2_node)
    leaf = cgroup.leave_delegated_root()
    assert leaf == str(v2_node / "supervisor")
    assert Path(leaf, "cgroup.procs").read_text() == str(os.getpid())


def test_a_containers_own_cgroup_mounted_as_the_root_is_found_under_the_mount():
    assert cgroup._join_path("/sys/fs/cgroup/memory|/", "/process_api/x") == "/sys/fs/cgroup/memory/process_api/x"
    assert cgroup._join_path("/sys/fs/cgroup|/kubepods/pod1", "/kubepods/pod1/c2") == "/sys/fs/cgroup/c2"
    assert cgroup._join_path("/sys/fs/cgroup|/kubepods/pod1", "/kubepods/pod1") == "/sys/fs/cgroup/"
