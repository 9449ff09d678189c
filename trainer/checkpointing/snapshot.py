"""The trainer's state as a checkpoint's files, and back.

A checkpoint holds (paths relative to its folder):

    adapter/adapter_config.json          LoRA / QLoRA: the adapter in standard PEFT files
    adapter/adapter_model.safetensors
    model/config.json                    Full: the model in transformers' format
    model/model.safetensors
    training_state.safetensors           the optimizer's moments (one flat tensor per kind, in
                                         parameter order), the RNG states and, staleness N > 0,
                                         the adapters of the policy versions drawing the steps in
                                         flight (`inflight.V.NAME`, trainer.ahead)
    trainer_state.json                   step, seed, method, the optimizer's hyper-parameters,
                                         the scheduler, the RNGs' small parts
    metrics.json                         each step's metrics so far (written beside these by the
                                         Checkpointer: trainer.protocol.STEP_METRICS)

With several processes (data parallel: every rank holds the same adapter and optimizer state),
rank 0 writes these files once, and every other rank's RNG states go into the same two files
under rank-indexed names (`rng.rank1.torch`, ...; `rng.ranks` and `worldSize` in
trainer_state.json). A resume on M processes restores rank k's states where the checkpoint has
them (k < N) and leaves the others as seeded: nothing a step draws depends on them, since every
step re-seeds its prompts' generators from (seed, step, prompt) and torch's RNG from (seed, step,
rank).

`state_files` describes them with the trainer's *live* tensors (its `state_dict()`: weights,
optimizer, scheduler; the RNGs are this module's), at a step boundary. `pack`
copies those tensors into one buffer -- the only pause of the training thread -- and returns
the layout from which `checkpoint.writer.write_files` writes the files, in this process (the
final weights) or in the checkpoint writer's (every saveSteps). `load_state` reads them back into
the trainer's `load_state_dict()`.

The data position and the sampling generator are derived from (seed, step): the step is all a
resumed run needs to see the same prompts and draw the same completions.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from grpo_run.checkpoint.writer import Layout
from grpo_run.trainer.protocol import TRAINER_STATE  # noqa: F401  (the supervisor reads its step too)

TRAINING_STATE = "training_state.safetensors"
_ALIGN = 64     # every tensor's offset in the buffer: any dtype can be viewed there


@dataclass
class TensorFile:
    """A safetensors file: each entry one tensor, or a list of tensors stored flattened and
    concatenated (the optimizer's moments)."""
    tensors: dict[str, torch.Tensor | list[torch.Tensor]]
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (torch's CPU generator, numpy's, Python's, its GPU's)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """`rng_state()`'s JSON form, as ranks send it to rank 0 (never a pickle: trainer.distributed)."""
    numpy_state, python_state = state["numpy"], state["python"]
    return {"torch": state["torch"].tolist(),
            "numpy": [numpy_state[0], numpy_state[1].tolist(), int(numpy_state[2]), int(numpy_state[3]),
                      float(numpy_state[4])],
            "python": [python_state[0], list(python_state[1]), python_state[2]],
            "cuda": None if state["cuda"] is None else state["cuda"].tolist()}


def rng_from_json(doc: Any) -> dict[str, Any]:
    """`rng_state()` from `rng_to_json`'s form, checked (it comes from another rank). ValueError
    when it is not one."""
    try:
        numpy_keys = np.array(doc["numpy"][1], dtype=np.uint32)
        python = doc["python"]
        out = {"torch": torch.tensor(doc["torch"], dtype=torch.uint8),
               "numpy": (str(doc["numpy"][0]), numpy_keys, int(doc["numpy"][2]), int(doc["numpy"][3]),
                         float(doc["numpy"][4])),
               "python": (int(python[0]), tuple(int(x) for x in python[1]),
                          None if python[2] is None else float(python[2])),
               "cuda": None if doc["cuda"] is None else torch.tensor(doc["cuda"], dtype=torch.uint8)}
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise ValueError(f"a rank's RNG state is not one ({type(e).__name__}: {e})") from None
    if out["numpy"][0] != "MT19937" or numpy_keys.shape != (624,) or len(out["python"][1]) != 625:
        raise ValueError("a rank's RNG state is not one (its generator's shape)")
    return out


def state_files(trainer, step: int, *, state: dict[str, Any] | None = None, weights_only: bool = False,
                other_ranks: list[dict[str, Any]] | None = None) -> dict[str, TensorFile | str]:
    """The checkpoint of `trainer` after `step` completed steps, by relative path: text, or a
    TensorFile of live tensors (copy them before the next step changes them: `pack`). `state`:
    the trainer's `state_dict()` when the caller already took it (with FSDP every rank takes it
    together, and rank 0 writes). `weights_only`: the adapter or model alone (the final weights, an
    export). `other_ranks`: ranks 1..N-1's `rng_state()`s, with several processes."""
    state = trainer_state = trainer.state_dict() if state is None else state
    files: dict[str, TensorFile | str] = {}
    if trainer.params.method == "Full":
        files["model/config.json"] = trainer.model.config.to_json_string(use_diff=True)
        files["model/model.safetensors"] = TensorFile(dict(state["weights"]))
    else:
        files["adapter/adapter_config.json"] = adapter_config_json(trainer.model.peft_config["default"])
        files["adapter/adapter_model.safetensors"] = TensorFile(dict(state["weights"]))
    if weights_only:
        return files

    states = state["optimizer"]["state"]
    tensors: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    stacked = []
    for kind in sorted(states[0]) if states and states[0] else []:
        tensors[f"optimizer.{kind}"] = [s[kind] for s in states]     # [sum of numel], or [n_params] for 0-d
        if states[0][kind].dim() == 0:
            stacked.append(kind)
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.numpy"] = torch.from_numpy(numpy_state[1].astype(np.int64))
    tensors["rng.python"] = torch.tensor(python_state[1], dtype=torch.int64)
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for i, t in enumerate(cuda):
        tensors[f"rng.cuda.{i}"] = t
    rng: dict[str, Any] = {"numpy": [int(numpy_state[2]), int(numpy_state[3]), float(numpy_state[4])],
                           "python": [python_state[0], python_state[2]], "cuda": len(cuda)}
    state: dict[str, Any] = {
        "step": step, "seed": trainer.params.seed, "method": trainer.params.method,
        "optimizer": {"param_groups": state["optimizer"]["param_groups"], "stacked": stacked},
        "scheduler": state["scheduler"], "rng": rng}
    if other_ranks:
        rng["ranks"] = {}
        for k, st in enumerate(other_ranks, start=1):
            tensors[f"rng.rank{k}.torch"] = st["torch"]
            tensors[f"rng.rank{k}.numpy"] = torch.from_numpy(st["numpy"][1].astype(np.int64))
            tensors[f"rng.rank{k}.python"] = torch.tensor(st["python"][1], dtype=torch.int64)
            if st["cuda"] is not None:
                tensors[f"rng.rank{k}.cuda"] = st["cuda"]
            rng["ranks"][str(k)] = {"numpy": [int(st["numpy"][2]), int(st["numpy"][3]), float(st["numpy"][4])],
                                    "python": [st["python"][0], st["python"][2]]}
        state["worldSize"] = 1 + len(other_ranks)
    if "inflight" in trainer_state:            # staleness: the versions the resume draws steps again with
        state["inflight"] = sorted(trainer_state["inflight"])
        for version, weights in trainer_state["inflight"].items():
            tensors.update({f"inflight.{version}.{name}": t for name, t in weights.items()})
    files[TRAINING_STATE] = TensorFile(tensors)
    files[TRAINER_STATE] = json.dumps(state, indent=2)
    return files


def adapter_config_json(config) -> str:
    """adapter_config.json as PEFT writes it, with sets sorted: `target_modules` resolved from
    "all-linear" is a set, which serialises in hash order, different in every process; sorted,
    the same adapter gives the same bytes on every node."""
    doc = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.to_dict().items()}
    return json.dumps(doc, indent=2, sort_keys=True, default=str)


def pack(files: dict[str, TensorFile | str], buffer_for: Callable[[int], Any]) -> tuple[Layout, Any]:
    """Copy every tensor of `files` into the buffer `buffer_for(nbytes)` returns (writable:
    `bytearray`, the checkpoint writer's shared mmap). Returns (the layout
    `checkpoint.writer.write_files` takes, the buffer)."""
    layout: Layout = {}
    copies: list[tuple[list[torch.Tensor], bool, torch.dtype, int, int]] = []
    offset = 0
    for path, f in files.items():
        if isinstance(f, str):
            layout[path] = {"text": f}
            continue
        entries = []
        for name, source in f.tensors.items():
            flat = isinstance(source, list)
            parts = source if flat else [source]
            dtype = parts[0].dtype
            for t in parts[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
            numel = sum(t.numel() for t in parts)
            nbytes = numel * dtype.itemsize
            offset = -(-offset // _ALIGN) * _ALIGN
            shape = [numel] if flat else list(source.shape)
            entries.append([name, str(dtype).removeprefix("torch."), shape, offset, nbytes])
            copies.append((parts, flat, dtype, offset, nbytes))
            offset += nbytes
        layout[path] = {"tensors": entries, "metadata": f.metadata}
    buffer = buffer_for(offset)
    dest = None
    if offset:
        base = torch.frombuffer(buffer, dtype=torch.uint8, count=offset)
        for parts, flat, dtype, start, nbytes in copies:
            if not nbytes:
                continue
            dest = base[start:start + nbytes].view(dtype)
            if flat:
                torch.cat([t.detach().reshape(-1) for t in parts], out=dest)
            else:
                dest.view(parts[0].shape).copy_(parts[0].detach())
        del base, dest   # the buffer may be resized or closed only once no tensor views it
    return layout, buffer


def load_state(trainer, folder: Path, rank: int = 0) -> int:
    """Restore a checkpoint folder written from `state_files` into `trainer` (its
    `load_state_dict`; rank `rank` of several processes: the same weights and optimizer, that
    rank's RNG states if it has them); returns the number of completed steps. ValueError when it
    was written for other trainable parameters (the job's lora settings or method changed since)."""
    from safetensors.torch import load_file

    if not (folder / TRAINING_STATE).exists() and (folder / "optimizer.pt").exists():
        raise ValueError(f"checkpoint {folder} was written by an earlier grpo-run (optimizer.pt, rng.pt), whose "
                         "format this version does not read; run the job again under a new metadata.name")
    if trainer.params.method == "Full":
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted((folder / "model").glob("*.safetensors")):   # one file, or shards
            weights.update(load_file(shard, device=str(trainer.device)))
    else:
        weights = load_file(folder / "adapter" / "adapter_model.safetensors", device=str(trainer.device))
    meta = json.loads((folder / TRAINER_STATE).read_text())
    tensors = load_file(folder / TRAINING_STATE)
    optimizer = {"param_groups": meta["optimizer"]["param_groups"],
                 "state": _moments(trainer.optimizer, tensors, meta["optimizer"]["stacked"], folder)}
    try:
        trainer.load_state_dict({"weights": weights, "optimizer": optimizer, "scheduler": meta["scheduler"],
                                 "inflight": _inflight(tensors, meta.get("inflight", []), trainer.device)})
    except ValueError as exc:
        raise ValueError(f"checkpoint {folder}: its {exc}; {_CHANGED}") from None
    rng = meta["rng"]
    if rank:
        _load_rank_rng(tensors, rng.get("ranks", {}).get(str(rank)), rank, trainer.device)
        return int(meta["step"])
    torch.set_rng_state(tensors["rng.torch"])
    np.random.set_state(("MT19937", tensors["rng.numpy"].numpy().astype(np.uint32), *rng["numpy"]))
    random.setstate((rng["python"][0], tuple(tensors["rng.python"].tolist()), rng["python"][1]))
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(rng["cuda"])]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return int(meta["step"])


def _inflight(tensors: dict[str, torch.Tensor], versions: list[int], device: torch.device) -> dict[int, dict]:
    """The in-flight policy versions' adapters a checkpoint holds ({} for a synchronous run's)."""
    out: dict[int, dict[str, torch.Tensor]] = {v: {} for v in versions}
    for key, tensor in tensors.items():
        if key.startswith("inflight."):
            version, name = key[len("inflight."):].split(".", 1)
            out[int(version)][name] = tensor.to(device)
    return out


def _load_rank_rng(tensors: dict[str, torch.Tensor], small: dict | None, rank: int, device: torch.device) -> None:
    """Rank `rank`'s RNG states, where the checkpoint was written with that rank (else as seeded)."""
    if small is None:
        return
    torch.set_rng_state(tensors[f"rng.rank{rank}.torch"])
    np.random.set_state(("MT19937", tensors[f"rng.rank{rank}.numpy"].numpy().astype(np.uint32), *small["numpy"]))
    random.setstate((small["python"][0], tuple(tensors[f"rng.rank{rank}.python"].tolist()), small["python"][1]))
    if f"rng.rank{rank}.cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors[f"rng.rank{rank}.cuda"], device)


_CHANGED = ("the job's lora settings or method changed since it was written (resume with the settings it was "
            "written with)")


def _moments(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], stacked: list[str],
             folder: Path) -> list[dict[str, torch.Tensor]]:
    """The optimizer's moments per trainable parameter, in its order, from their flat tensors in a
    checkpoint. ValueError naming the checkpoint when their sizes do not fit this optimizer's
    parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sizes = [p.numel() for p in params]
    state: list[dict[str, torch.Tensor]] = [{} for _ in params]
    for name, flat in tensors.items():
        if not name.startswith("optimizer."):
            continue
        kind = name.removeprefix("optimizer.")
        if flat.numel() != (len(params) if kind in stacked else sum(sizes)):
            raise ValueError(f"checkpoint {folder}: its optimizer state does not fit this run's trainable "
                             f"parameters; {_CHANGED}")
        parts = flat.unbind() if kind in stacked else torch.split(flat, sizes)
        for i, part in enumerate(parts):
            state[i][kind] = part.clone() if kind in stacked else part.view(params[i].shape)
    return state
