"""The model across several processes: DDP for adapters (LoRA, QLoRA: replicated, gradients
averaged) and FSDP for a full fine-tune (sharded: each rank holds 1/N of the weights, gradients and
moments), and the whole state a sharded model saves and loads. The processes themselves, and what
they say to each other: trainer.distributed."""

from __future__ import annotations

import torch

from grpo_run.trainer.distributed import World


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
