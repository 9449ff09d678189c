"""The trainer's checkpoints, behind one object in the style of torchtitan's checkpoint manager:
interval, keep-K, staging, the manifest, the writer process and pruning sit behind
`save(step, force=...)` and `load_latest() -> step`.

    checkpoints = Checkpointer(work / "checkpoints", interval=25, keep=3, meta={"job": name})
    checkpoints.attach(trainer)
    start = checkpoints.load_latest()            # 0 when there is none
    ...
    checkpoints.add_metrics(step, metrics)       # each step's, so that every checkpoint holds them so far
    checkpoints.save(step)                       # every `interval` steps; force=True at a stop
    for step in checkpoints.sealed(): ...        # sealed on the local disk since the last call

With several processes every rank has a Checkpointer and calls it at the same steps, but only
rank 0 owns a writer and seals: `save` gathers the other ranks' RNG states into rank 0's
checkpoint, and `sealed` and `close` report nothing on the others.

Everything is local: the trainer knows nothing of object storage. The supervisor restores the
newest durable checkpoint into this folder before the trainer starts, and uploads each one the
trainer reports sealed. A checkpoint is hashed once, by the writer process, when it is sealed;
`load_latest` trusts that manifest (sizes checked, no hashing).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from grpo_run.checkpoint.manifest import (FINITE_META, KEEP_CHECKPOINTS, checkpoint_dir, finalize_checkpoint,
                                          newest_sealed, staging_dir, step_of)
from grpo_run.checkpoint.writer import CheckpointWriter, Failed, Sealed, weights_finite, write_files
from grpo_run.trainer.distributed import UnsafeName, World
from grpo_run.trainer.checkpointing.snapshot import (load_state, pack, rng_from_json, rng_state, rng_to_json,
                                                     state_files)
from grpo_run.trainer.protocol import CHECKPOINT_SAMPLE_STEPS, STEP_METRICS, STEP_SAMPLES

log = logging.getLogger(__name__)


class CheckpointFailed(RuntimeError):
    """The writer could not write a checkpoint (disk full, a bad layout): the run must stop.
    `errno`: the OSError's, when that was the cause (errno.ENOSPC: the local disk is full)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class Checkpointer:
    """Owns the checkpoint writer process for one trainer and the local checkpoints folder."""

    def __init__(self, root: Path, *, interval: int, keep: int = KEEP_CHECKPOINTS, meta: dict[str, Any] | None = None,
                 log_file: Path | None = None, world: World | None = None) -> None:
        self.root = Path(root)
        self.interval = interval
        self.world = world or World()
        # Started before the model loads: its imports overlap the model's.
        self._writer = CheckpointWriter(self.root, keep=keep, meta=meta, log_file=log_file) \
            if self.world.main else None
        self._trainer: Any = None
        self._last_saved: int | None = None
        self._metrics: dict[int, dict[str, Any]] = {}     # by step: what each step reported, since the first
        self._samples: dict[int, list[dict[str, Any]]] = {}   # by step: its kept groups, the newest steps'

    def attach(self, trainer: Any) -> None:
        self._trainer = trainer

    def load_latest(self) -> int:
        """Restore the newest sealed local checkpoint into the trainer; its step (0: none)."""
        found = newest_sealed(self.root)
        if self.world.nodes > 1:
            found = self._from_node_zero(found)
        if found is None:
            return 0
        step, folder, _ = found
        loaded = load_state(self._trainer, folder, self.world.rank)
        if loaded != step:            # the supervisor refuses such a checkpoint first; never trained from
            raise ValueError(f"checkpoint {folder.name}: its trainer state says step {loaded}, its manifest step "
                             f"{step}; refusing it (a damaged or planted checkpoint)")
        self._last_saved = step
        metrics = folder / STEP_METRICS                 # absent from checkpoints written before it
        steps = json.loads(metrics.read_text()) if metrics.exists() else []
        self._metrics = {s["step"]: {k: v for k, v in s.items() if k != "step"} for s in steps if s["step"] <= loaded}
        samples = folder / STEP_SAMPLES                 # likewise
        kept = json.loads(samples.read_text()) if samples.exists() else {}
        self._samples = {int(s): groups for s, groups in kept.items() if int(s) <= loaded}
        return loaded

    def _from_node_zero(self, found: tuple[int, Path, Any] | None) -> tuple[int, Path, Any] | None:
        """Several nodes: rank 0's checkpoint on every node. Only rank 0's node holds the job's
        checkpoints (its supervisor restored the newest durable one, or kept a newer one sealed
        there); the first rank of each other node receives that folder's files over the process
        group and writes them under this folder (the other ranks of its node wait), so every rank
        loads the same bytes. None on every rank when rank 0 starts from the beginning."""
        world = self.world
        name = world.broadcast(found[1].name if world.main and found is not None else None)
        if name is None:
            return None
        if not isinstance(name, str) or "/" in name or name.startswith(".") or step_of(Path(name)) is None:
            raise UnsafeName(f"rank 0 named the checkpoint to resume from {name!r}, not a checkpoint folder's name: "
                             f"refused, nothing removed or written (is rank 0 the job's node?)")
        if world.node == 0:                    # rank 0's disk: the same folder newest_sealed found
            world.share_files(found[1] if world.main else None, None)
            world.barrier()
            return found
        folder = self.root / name
        receiving = world.local_rank == 0
        incoming = self.root / f".{name}.receiving"
        if receiving:
            shutil.rmtree(incoming, ignore_errors=True)
            incoming.mkdir(parents=True)
        world.share_files(None, incoming if receiving else None)
        if receiving:
            shutil.rmtree(folder, ignore_errors=True)
            incoming.rename(folder)
        world.barrier()                        # the node's other ranks read what its first rank wrote
        return step_of(folder), folder, None

    def add_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Step `step`'s metrics, for the checkpoints from here on (a step redone after a resume
        replaces what it reported before)."""
        self._metrics[step] = dict(metrics)

    def add_samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        """Step `step`'s kept groups (trainer.kept_samples), for the checkpoints from here on; only the
        newest CHECKPOINT_SAMPLE_STEPS steps' are kept."""
        self._samples[step] = groups
        for old in sorted(self._samples)[:-CHECKPOINT_SAMPLE_STEPS]:
            del self._samples[old]

    def save(self, step: int, *, force: bool = False) -> bool:
        """Checkpoint the trainer after `step` completed steps when the interval says so (or
        `force`). The training thread only copies the state into the writer's shared buffer
        (waiting while the writer still reads the previous one); files, fsync, hashing, the
        manifest and pruning happen in the writer process. True when a checkpoint was started."""
        due = force or (step > 0 and step % self.interval == 0)
        if not due or step == self._last_saved:
            return False
        # as JSON, checked on rank 0 (another rank's bytes are never unpickled: trainer.distributed)
        ranks = [rng_from_json(r) for r in self.world.gather(rng_to_json(rng_state(self._trainer.device)))] \
            if self.world.distributed else [None]
        state = self._trainer.state_dict()        # FSDP: every rank gathers, rank 0 gets the whole state
        if self._writer is None:          # not rank 0: its RNG states are in rank 0's checkpoint
            self._last_saved = step
            return True
        files = state_files(self._trainer, step, state=state, other_ranks=ranks[1:] or None)
        files[STEP_METRICS] = json.dumps([{"step": s, **m} for s, m in sorted(self._metrics.items()) if s <= step])
        files[STEP_SAMPLES] = json.dumps({str(s): g for s, g in sorted(self._samples.items()) if s <= step})
        layout, _ = pack(files, self._writer.buffer)
        self._writer.submit(step, layout)
        self._last_saved = step
        return True

    def sealed(self, wait_for: int | None = None) -> list[int]:
        """Steps sealed on the local disk since the last call; with `wait_for`, first wait until
        that step is sealed. Raises CheckpointFailed when one could not be written."""
        if self._writer is None:
            return []
        events = self._writer.poll() if wait_for is None else self._writer.wait_sealed(wait_for)
        for event in events:
            if isinstance(event, Failed):
                raise CheckpointFailed(f"checkpoint {event.failed} could not be written: {event.error}", event.errno)
        return [event.sealed for event in events if isinstance(event, Sealed)]

    @property
    def last_saved(self) -> int | None:
        return self._last_saved

    def save_final(self, root: Path, step: int, meta: dict[str, Any]) -> Path | None:
        """The final weights (adapter or model alone), sealed like a checkpoint under `root`
        in this process (the writer's buffer is not needed for a one-off). Several processes:
        every rank calls it (a sharded model is gathered), rank 0 writes; None on the others."""
        state = self._trainer.state_dict()        # FSDP: every rank gathers, rank 0 gets the whole state
        if not self.world.main:
            return None
        staging = staging_dir(root, step)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        layout, buffer = pack(state_files(self._trainer, -1, state=state, weights_only=True), bytearray)
        write_files(staging, layout, buffer)
        finite = weights_finite(layout, buffer)
        final = checkpoint_dir(root, step)
        if final.exists():
            shutil.rmtree(final)
        finalize_checkpoint(staging, final, step=step, meta=meta if finite is None else {**meta, FINITE_META: finite})
        return final

    def close(self) -> list[int]:
        """End the writer after what is queued; the steps it sealed since the last call."""
        if self._writer is None:
            return []
        return [e.sealed for e in self._writer.close() if isinstance(e, Sealed)]
