"""A corrupt newest checkpoint in object storage is skipped, said so, and the run resumes from the
one before it on a fresh node, ending byte for byte where an uninterrupted run ends.

Node A trains the small job on S3 (one case on GCS and Azure Blob too) and is hard-killed while uploading checkpoint 6
(GRPO_RUN_FAULT=upload@6: uploads go in order, so checkpoints 2 and 4 are durable whatever the
speed of the steps; a kill at a training step left fewer once steps got faster than uploads). The newest durable one is then damaged in the bucket, as a bad
disk, a botched copy or an interrupted manual cleanup would: flipped bytes in the adapter, a
deleted manifest, a truncated optimizer file. `grpo-run resume` on empty node B must name it on
stderr with the reason, resume from the one before it, and finish the job.
"""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import checkpoint_name
from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.state.record import Record
from tests.campaign import full_campaign_only
from tests.cloud_stores import STORE_NAMES
from tests.runner.jobs.test_resume import SAVE, STEPS, exported_bytes, grpo_run, uninterrupted, write_job  # noqa: F401

JOB = "resumable"                 # write_job's metadata.name


def job_store(env) -> ObjectStore:
    """The job's folder in `env`'s store (S3, GCS or Azure Blob): `env.url` is SCHEME://BUCKET/run,
    the job goes under it."""
    return open_store(f"{env.url}/{JOB}")


def durable_folders(env) -> list[str]:
    """The key (in job_store) of every checkpoint folder whose manifest.json is in storage, of any
    run (each run's lie under checkpoints/<run id>/)."""
    keys = job_store(env).list("checkpoints")
    return [k.rsplit("/", 1)[0] for k in keys if k.endswith("/manifest.json")]


def durable_steps(env) -> list[int]:
    """Steps whose manifest.json is in storage, newest first."""
    return sorted({int(folder.rsplit("/", 1)[1][len("ckpt-"):]) for folder in durable_folders(env)}, reverse=True)


def flip_adapter_bytes(store: ObjectStore, ckpt: str) -> str:
    key = f"{ckpt}/adapter/adapter_model.safetensors"
    data = bytearray(store.get_bytes(key))
    for i in range(len(data) // 2, len(data) // 2 + 16):      # inside the tensor data; same size
        data[i] ^= 0xFF
    store.put_bytes(key, bytes(data))
    return "sha256 mismatch"


def delete_manifest(store: ObjectStore, ckpt: str) -> str:
    store.delete(f"{ckpt}/manifest.json")
    return "manifest.json"


def truncate_optimizer(store: ObjectStore, ckpt: str) -> str:
    key = f"{ckpt}/training_state.safetensors"
    data = store.get_bytes(key)
    store.put_bytes(key, data[: len(data) // 2])
    return f"training_state.safetensors is {len(data) // 2} bytes, manifest says {len(data)}"


def delete_a_listed_file(store: ObjectStore, ckpt: str) -> str:
    store.delete(f"{ckpt}/adapter/adapter_config.json")   # the manifest still lists it
    return "partial upload"


def plant_a_trainer_step_past_the_manifests(store: ObjectStore, ckpt: str) -> str:
    """A bucket writer's checkpoint (N7): its trainer_state.json says a step far past maxSteps and
    the manifest's sha256 and size are updated to match, so every file verifies; the manifest's own
    step stays within maxSteps. Loaded, the trainer would skip to the final evaluation and make these
    weights final."""
    key = f"{ckpt}/trainer_state.json"
    state = json.loads(store.get_bytes(key))
    state["step"] = 1_000_000
    data = json.dumps(state).encode()
    store.put_bytes(key, data)
    manifest = json.loads(store.get_bytes(f"{ckpt}/manifest.json"))
    (entry,) = [f for f in manifest["files"] if f["path"] == "trainer_state.json"]
    entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    store.put_bytes(f"{ckpt}/manifest.json", json.dumps(manifest).encode())
    return "its trainer_state.json says step 1000000, its manifest step"


def resumed_from(env, tmp_path: Path) -> int | None:
    """The checkpoint the newest attempt that resumed one started from, as the job's record in
    storage has it (None: every attempt started from the beginning)."""
    local = tmp_path / "record" / "state.db"
    local.parent.mkdir()
    job_store(env).get_file("state.db", local)
    with Record(local) as record:
        attempts = record.attempts()
    return next((a["from_step"] for a in reversed(attempts) if a["from_step"]), None)


# One case on every edit (~25 s, plus ~13 s for the reference run); in CI two on S3, everything
# (GCS's and Azure's flipped bytes too) in scripts/reliability. Each kind of damage is refused by
# tests/checkpoint/test_manifest.py too.
SAMPLED = "CI resumes past flipped adapter bytes and a manifest naming a missing file (on S3)"


@pytest.mark.fault
@pytest.mark.parametrize("corrupt, store_env", [
    pytest.param(flip_adapter_bytes, "s3", id="flipped-adapter-bytes"),
    pytest.param(flip_adapter_bytes, "gs", id="flipped-adapter-bytes-gs", marks=full_campaign_only(SAMPLED)),
    pytest.param(flip_adapter_bytes, "az", id="flipped-adapter-bytes-az", marks=full_campaign_only(SAMPLED)),
    pytest.param(delete_manifest, "s3", id="deleted-manifest", marks=full_campaign_only(SAMPLED)),
    pytest.param(truncate_optimizer, "s3", id="truncated-optimizer", marks=full_campaign_only(SAMPLED)),
    pytest.param(delete_a_listed_file, "s3", id="manifest-names-a-missing-file", marks=pytest.mark.slow),
    pytest.param(plant_a_trainer_step_past_the_manifests, "s3", id="trainer-step-not-the-manifests",
                 marks=pytest.mark.trust),
], indirect=["store_env"])
def test_a_corrupt_newest_checkpoint_is_skipped_named_and_the_run_resumes_from_the_one_before(
        tmp_path, store_env, uninterrupted, figures, corrupt):
    job = write_job(tmp_path, store_env.url)
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault=f"upload@{3 * SAVE}", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (tmp_path / "job.yaml").unlink()
    durable = durable_steps(store_env)
    print("durable at the kill:", durable)
    # Two are durable unless the uploader, busy on a loaded machine, let checkpoint 6 supersede 4
    # (seen in a clean-clone run): then the one before the corrupt newest is the start itself.
    assert durable, "no checkpoint was durable at the kill"
    newest, before = durable[0], (durable[1] if len(durable) > 1 else None)

    folder = next(f for f in durable_folders(store_env) if f.endswith(f"/{checkpoint_name(newest)}"))
    why = corrupt(job_store(store_env), folder)
    resumed = grpo_run(tmp_path / "node-b", "resume", JOB, "--storage", store_env.url)

    came_from = resumed_from(store_env, tmp_path)
    identical = exported_bytes(tmp_path / "node-c", store_env.url, tmp_path / "export") == uninterrupted
    skipped = [line for line in resumed.stderr.splitlines() if checkpoint_name(newest) in line]
    said = [line for line in skipped if "skipping" in line and why in line]
    figures.add("corrupt", store=STORE_NAMES[store_env.scheme], damage=corrupt.__name__.replace("_", " "),
                refused=came_from == before,
                resumed_from=came_from, said=(said[0].split(": ", 1)[-1][:120] if said else ""), identical=identical)
    assert came_from == before
    assert identical
    assert said, resumed.stderr[-3000:]


@pytest.mark.fault
@pytest.mark.slow
def test_a_checkpoint_left_by_an_earlier_run_of_the_same_name_is_never_resumed_from(
        tmp_path, s3_env, uninterrupted, figures):
    """A job whose record was deleted (to start over) and submitted again under the same name
    finds the earlier run's checkpoints in storage, newer than its record claims: it must start
    from the beginning, end as one never interrupted, and leave the earlier run's checkpoints
    as they were (each run's lie under its own run id)."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    grpo_run(tmp_path / "node-a", "apply", "-f", str(write_job(earlier, s3_env.url, learningRate=0.02)))
    job_store(s3_env).delete("state.db")
    stale = set(durable_folders(s3_env))
    assert stale, "the earlier run left no checkpoint"

    grpo_run(tmp_path / "node-b", "apply", "-f", str(write_job(tmp_path, s3_env.url)))
    came_from = resumed_from(s3_env, tmp_path)
    identical = exported_bytes(tmp_path / "node-c", s3_env.url, tmp_path / "export") == uninterrupted
    left_alone = stale <= set(durable_folders(s3_env))
    figures.add("corrupt", damage="a checkpoint of an earlier run under the same name", refused=came_from is None,
                resumed_from=came_from or 0, said=f"the earlier run's {len(stale)} checkpoints kept apart under "
                f"their run id{'' if left_alone else ' (some were deleted!)'}", identical=identical)
    assert came_from is None                       # started from the beginning
    assert left_alone                              # the earlier run's checkpoints, all still there
    assert identical


def damage_header(path: Path) -> None:
    """Bytes flipped where safetensors keeps its header's length, as a bad disk would: same size,
    so only a checksum tells."""
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def seal(root: Path, step: int) -> Path:
    from grpo_run.checkpoint.manifest import checkpoint_dir, finalize_checkpoint

    staging = root.parent / f"staging-{step}"
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
    final = checkpoint_dir(root, step)
    finalize_checkpoint(staging, final, step=step)
    return final


def test_a_damaged_local_checkpoint_storage_lacks_is_set_aside_instead_of_used_and_uploaded(tmp_path):
    """Sealed here, never uploaded, then damaged on the disk: its upload would send damage with a
    manifest that vouches for it, and the trainer would fail to load it. Storage's newest is used."""
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.checkpoint.sync import Uploader, restore_latest

    store, root = Store(str(tmp_path / "store")), tmp_path / "node" / "checkpoints"
    with Uploader(store) as up:
        up.submit(seal(root, 2))
        assert up.wait()
    damage_header(seal(root, 4) / "adapter" / "adapter_model.safetensors")

    step, folder, _, durable = restore_latest(store, root)
    assert (step, durable) == (2, True)
    assert [p.name.split("-")[3] for p in root.glob(".set-aside-ckpt-*")] == ["00000004"]


@pytest.mark.fault
def test_a_local_checkpoint_damaged_on_the_nodes_disk_is_set_aside_and_storages_copy_restored(
        tmp_path, s3_env, uninterrupted, figures):  # noqa: F811
    """The node comes back with its disk, whose checkpoints no longer load: the trainer that
    crashed loading one is restarted from storage's copy (before, it crashed three more times and
    the job ended Failed)."""
    job = write_job(tmp_path, s3_env.url)
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault=f"upload@{3 * SAVE}", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    durable = durable_steps(s3_env)
    local = sorted((tmp_path / "node-a" / "runs" / JOB / "checkpoints").glob("ckpt-*"))
    assert durable and durable[0] in [int(p.name[len("ckpt-"):]) for p in local], (durable, local)
    for folder in local:
        damage_header(folder / "adapter" / "adapter_model.safetensors")

    resumed = grpo_run(tmp_path / "node-a", "resume", JOB, "--storage", s3_env.url)    # the same node, its disk

    came_from = resumed_from(s3_env, tmp_path)
    identical = exported_bytes(tmp_path / "node-c", s3_env.url, tmp_path / "export") == uninterrupted
    said = [line for line in resumed.stderr.splitlines() if "aside" in line and "does not verify" in line]
    figures.add("corrupt", damage="a local checkpoint damaged on the node's disk", refused=bool(said),
                resumed_from=came_from, said=(said[-1].split(": ", 1)[-1][:120] if said else ""), identical=identical)
    assert came_from == durable[0]
    assert identical
    assert said, resumed.stderr[-3000:]
