"""Copies a node no longer trusts are set aside, not deleted, and only the newest few are kept: a
node that sets one aside at every restart must not fill its disk with them."""

from __future__ import annotations

from pathlib import Path

from grpo_run.checkpoint.manifest import checkpoint_dir, finalize_checkpoint
from grpo_run.checkpoint.storage.fsio import KEEP_SET_ASIDE, set_aside
from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import Uploader, restore_latest


def sealed(root: Path, step: int, marker: int | None = None) -> Path:
    """A sealed checkpoint; with `marker`, its adapter then damaged on this disk (same size, bytes
    that tell the copies apart)."""
    staging = root.parent / f"staging-{step}-{marker}"
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
    final = checkpoint_dir(root, step)
    finalize_checkpoint(staging, final, step=step)
    if marker is not None:
        (final / "adapter" / "adapter_model.safetensors").write_bytes(bytes([marker]) * 1024)
    return final


def test_a_node_that_sets_damaged_checkpoints_aside_again_and_again_keeps_the_newest_few(tmp_path):
    store, root = Store(str(tmp_path / "store")), tmp_path / "node" / "checkpoints"
    with Uploader(store) as up:
        up.submit(sealed(root, 2))
        assert up.wait()
    for marker in range(1, 7):                       # six restarts, each finding step 4 damaged
        sealed(root, 4, marker)
        assert restore_latest(store, root)[0] == 2
    kept = sorted(root.glob(".set-aside-ckpt-*"))
    assert len(kept) == KEEP_SET_ASIDE
    markers = sorted((p / "adapter" / "adapter_model.safetensors").read_bytes()[0] for p in kept)
    assert markers == [4, 5, 6]                     # the newest ones


def test_set_aside_prunes_only_its_own_family_oldest_first(tmp_path):
    other = tmp_path / ".set-aside-state.db-old"
    other.write_text("another family")
    names = []
    for i in range(5):
        (tmp_path / "ckpt-00000004").mkdir()
        (tmp_path / "ckpt-00000004" / "i").write_text(str(i))
        names.append(set_aside(tmp_path / "ckpt-00000004", "ckpt-", keep=2).name)
    assert sorted(p.name for p in tmp_path.glob(".set-aside-ckpt-*")) == sorted(names[-2:])
    assert other.exists()
