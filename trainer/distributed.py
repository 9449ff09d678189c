"""Data parallelism: one trainer process per GPU (a rank), started by accelerate's launcher
(torchrun's elastic agent underneath, see trainer.launch), talking through torch.distributed.

What is split and what is agreed, per training step (B prompts, G completions each):

    prompts      the step's B prompts (trainer.loop.batch_indices, from (seed, step) alone) in
                 contiguous shards, one per rank: a group never spans ranks, so each rank
                 scores its own groups and computes their advantages
    sampling     one generator per prompt, seeded from (seed, step, prompt's place in the step):
                 a prompt draws from the same random stream on any number of ranks
    after sampling   one all-reduce: was any rank interrupted by a stop request (then every rank
                 abandons the step), and the step's unmasked tokens (DAPO's normaliser)
    update       DistributedDataParallel averages the gradients; each rank's loss is normalised
                 by the whole step's completions or tokens and multiplied by the world size, so
                 the average is the gradient of the step's loss over all B x G completions
    metrics      all-gathered, rank 0 reports them
    step boundary    one all-reduce of (stop requested, past the deadline, checkpoint asked):
                 all ranks stop, or checkpoint, at the same step
    evaluation   batches dealt round-robin to the ranks, gathered at the end

Rank 0 alone reports events and seals checkpoints (every rank's RNG state gathered into it).
On several nodes (GROUP_RANK, LOCAL_WORLD_SIZE) rank 0's plan and the checkpoint it resumes from
are broadcast at the start (trainer.child.shared_plan, Checkpointer.load_latest): only rank 0's
node holds the job's checkpoints.
A single process (WORLD_SIZE unset or 1) initialises nothing and calls no collective.

A rank that dies makes its peers' next collective fail (gloo and NCCL see the closed
connection); the agent stops the rest of the group within its shutdown timeout anyway, and the
process group's timeout (GRPO_RUN_COLLECTIVE_TIMEOUT_S, default 1,800 s) bounds a rank that
hangs alive.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

TIMEOUT_ENV = "GRPO_RUN_COLLECTIVE_TIMEOUT_S"
FAILED_KEY = "grpo-run/failed"     # tell_failure's key in the rendezvous store
STORE_TIMEOUT_S = 10.0
SHARE_PIECE_BYTES = 64 << 20      # share_files: a checkpoint goes to the other nodes in pieces of this size
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    node: int = 0           # this process's node among the job's (torchrun's GROUP_RANK)
    nodes: int = 1          # the job's nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)

    @property
    def main(self) -> bool:
        """Rank 0: reports events, seals checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_environment(cls) -> World:
        """The world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), with
        its process group initialised: NCCL on GPUs, gloo on CPUs. One process: nothing is
        initialised."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or size)
        world = cls(rank=int(os.environ["RANK"]), size=size, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    node=int(os.environ.get("GROUP_RANK", "0")), nodes=max(1, size // max(1, local_size)))
        import torch.distributed as dist

        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(world.local_rank)
            timeout = dt.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        return world

    def device(self) -> torch.device:
        """This rank's device: its own GPU (LOCAL_RANK), else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def shard(self, n: int) -> range:
        """This rank's contiguous share of range(n): sizes differ by at most one, earlier ranks
        the larger (numpy's array_split)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank, the same answer on every rank (one all-reduce)."""
        if not self.distributed:
            return tuple(bool(f) for f in flags)
        return tuple(v > 0 for v in self.total(*(float(bool(f)) for f in flags)))

    def total(self, *values: float) -> tuple[float, ...]:
        """Each value summed over the ranks (one all-reduce, float64)."""
        if not self.distributed:
            return tuple(float(v) for v in values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return tuple(t.tolist())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable), on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, device=self.device() if self.device().type == "cuda" else None)
        return box[0]

    def share_files(self, folder: Path | None, into: Path | None) -> None:
        """Rank 0's files under `folder` (rank 0 names it; None on the others) written under `into`
        by the ranks that pass one (None: received and dropped). A collective: every rank calls
        it; each file goes out in pieces of SHARE_PIECE_BYTES (one broadcast each)."""
        import torch.distributed as dist

        names = self.broadcast(None if folder is None else
                               [(p.relative_to(folder).as_posix(), p.stat().st_size)
                                for p in sorted(folder.rglob("*")) if p.is_file()])
        device = self.device()
        for name, size in names:
            out = None
            if into is not None:
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                out = open(into / name, "wb")
            source = open(folder / name, "rb") if folder is not None else None
            try:
                for start in range(0, size, SHARE_PIECE_BYTES):
                    n = min(SHARE_PIECE_BYTES, size - start)
                    piece = torch.empty(n, dtype=torch.uint8)
                    if source is not None:
                        piece = torch.frombuffer(bytearray(source.read(n)), dtype=torch.uint8)
                    sent = piece.to(device)
                    dist.broadcast(sent, src=0)
                    if out is not None:
                        out.write(sent.cpu().numpy().tobytes())
            finally:
                if source is not None:
                    source.close()
                if out is not None:
                    out.flush()
                    os.fsync(out.fileno())
                    out.close()

    def tell_failure(self, message: str) -> None:
        """Several nodes: the job's own failure on this rank (a reward function's), left for rank 0 in
        the rendezvous store (rank 0's node hosts it) before this rank exits. Its supervisor is not
        rank 0's: without this, rank 0 would see only a lost peer."""
        try:
            self._store().set(FAILED_KEY, message)
        except Exception:           # the store gone too: rank 0 sees a lost rank, as it would anyway
            pass

    def failure_told(self) -> str | None:
        """What another node's rank told with tell_failure (None: nothing)."""
        try:
            store = self._store()
            return store.get(FAILED_KEY).decode() if store.check([FAILED_KEY]) else None
        except Exception:
            return None

    @staticmethod
    def _store():
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=dt.timedelta(seconds=STORE_TIMEOUT_S))

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def wrap_ddp(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """The model under DistributedDataParallel for the update (sampling and evaluation use the
    model itself). Every rank loaded the same weights (the same checkpoint, the same seeded
    adapter), so they are not broadcast again; buffers are never trained, so not synced."""
    from torch.nn.parallel import DistributedDataParallel

    device = world.device()
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False, init_sync=False)


# --- full fine-tunes: FSDP ------------------------------------------------------------------------
#
# Method Full on several processes shards the model with FSDP (torch's fully_shard, FSDP2): each
# decoder layer is a unit, the rest of the model the root unit. At rest every rank holds 1/N of
# the weights, of their gradients and of Adam's moments. Sampling, evaluation and the update run
# inside `unsharded`: every unit is all-gathered once at the start (all ranks there together) and
# kept whole until the end, so what happens inside -- different numbers of tokens or micro-batches
# on different ranks -- calls no collective; the update's last micro-batch (one per rank, as under
# DDP) reduce-scatters the accumulated gradients, averaged like DDP's. So FSDP here saves the
# optimizer state and the gradients at rest (12 of the 16 bytes per parameter), not the weights
# while sampling or updating. Checkpoints hold the whole model and optimizer, gathered on rank 0:
# the same files one process writes.


def shard_fsdp(model: torch.nn.Module, world: World) -> None:
    """Shard `model` in place over the world (before its optimizer is made: the parameters
    become sharded DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device().type, (world.size,))
    core = getattr(getattr(model, "model", None), "layers", None)
    for layer in core if core is not None else []:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class unsharded:
    """Every FSDP unit of `model` whole for the block (see above); a no-op for a model without
    any. Entering it is a collective: every rank enters it at the same point."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.units = fsdp_units(model)

    def __enter__(self) -> None:
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        for unit in self.units:
            unit.unshard()

    def __exit__(self, *exc) -> None:
        for i, unit in enumerate(self.units):
            unit.reshard()
            unit.set_reshard_after_forward(i != 0, recurse=False)     # the root unit's default is False
            unit.set_reshard_after_backward(True, recurse=False)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The whole model's state dict (tied duplicates left out, as model.state_dict() has them
    once) and the optimizer's state per trainable parameter in its order, on the CPU of rank 0
    (empty on the others). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    moments = get_optimizer_state_dict(model, optimizer, options=options)
    if not weights:
        return {}, []
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    kept = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    weights = {k: v for k, v in weights.items() if k in kept}
    return weights, [moments["state"].get(n, {}) for n in names]


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict,
                    states: list[dict], param_groups: list[dict]) -> None:
    """Shard whole weights and optimizer state (every rank passes the same) into `model` and
    `optimizer`: the inverse of `full_state`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in param_groups]
    state = {n: s for n, s in zip(names, states) if s}
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=options)


def concat(parts: Sequence[Sequence[float]]) -> list[float]:
    return [x for part in parts for x in part]
