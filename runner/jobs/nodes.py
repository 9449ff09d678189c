"""Which node of a job's nodes this one is: from `--nnodes/--node-rank/--master`, else from what the
launcher that started it says in the environment, checked against the job's spec.nodes before
anything is taken (no lease, no download).

    flags        --nnodes N --node-rank R --master HOST:PORT
    grpo-run     GRPO_RUN_NODES, GRPO_RUN_NODE_RANK, GRPO_RUN_MASTER (the generated Kubernetes
                 files set them, with the rank from the indexed Job's JOB_COMPLETION_INDEX)
    SkyPilot     SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, the first of SKYPILOT_NODE_IPS (rank 0's
                 node), port GRPO_RUN_MASTER_PORT or torch's 29500
    torchrun     PET_NNODES, PET_NODE_RANK, MASTER_ADDR and MASTER_PORT (what a PyTorchJob or a
                 torchrun wrapper sets)
"""

from __future__ import annotations

import os
from typing import Mapping

from grpo_run.runner.supervisor.runspec import Nodes
from grpo_run.trainer.protocol import MASTER_ENV, NODE_RANK_ENV, NODES_ENV, TORCH_MASTER_PORT

MASTER_PORT_ENV = "GRPO_RUN_MASTER_PORT"


class NodesError(ValueError):
    """This node's place among the job's nodes is missing or wrong: the message names the flag or
    variable and the fix."""


def from_environment(env: Mapping[str, str]) -> tuple[int | None, int | None, str | None, str]:
    """(nodes, rank, master, where they came from) as the first launcher that says so has it."""
    if env.get(NODES_ENV):
        rank = env.get(NODE_RANK_ENV) or env.get("JOB_COMPLETION_INDEX")
        return _int(env[NODES_ENV], NODES_ENV), _int(rank, NODE_RANK_ENV) if rank else None, env.get(MASTER_ENV), \
            f"{NODES_ENV}"
    if env.get("SKYPILOT_NUM_NODES"):
        ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
        port = env.get(MASTER_PORT_ENV) or str(TORCH_MASTER_PORT)
        rank = env.get("SKYPILOT_NODE_RANK")
        return _int(env["SKYPILOT_NUM_NODES"], "SKYPILOT_NUM_NODES"), \
            _int(rank, "SKYPILOT_NODE_RANK") if rank else None, f"{ips[0]}:{port}" if ips else None, "SkyPilot"
    if env.get("PET_NNODES"):
        rank = env.get("PET_NODE_RANK")
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT") or str(TORCH_MASTER_PORT)
        return _int(env["PET_NNODES"], "PET_NNODES"), _int(rank, "PET_NODE_RANK") if rank else None, \
            f"{addr}:{port}" if addr else None, "torchrun's PET_*"
    return None, None, None, ""


def resolve(job, nnodes: int | None, node_rank: int | None, master: str | None,
            env: Mapping[str, str] | None = None) -> Nodes | None:
    """This node's Nodes for `job` (None: the job trains on this node alone). Raises NodesError."""
    env = os.environ if env is None else env
    count, rank, addr, source = from_environment(env)
    flags = nnodes is not None or node_rank is not None or master is not None
    if flags:
        count, rank, addr, source = nnodes if nnodes is not None else count, \
            node_rank if node_rank is not None else rank, master or addr, "--nnodes"
    want = job.nodes or 1
    if count is None:
        if want > 1:
            raise NodesError(f"{job.name}: spec.nodes is {want}: start each of its {want} nodes with --nnodes {want} "
                             f"--node-rank R --master HOST:PORT (R = 0 on the node that holds the job, whose address "
                             f"HOST is), or from SkyPilot or a Kubernetes indexed Job (docs/multi-gpu.md)")
        return None
    if count < 1:
        raise NodesError(f"--nnodes {count}: a job runs on 1 node or more")
    if count != want:
        raise NodesError(f"{job.name}: this node was started as one of {count} nodes ({source}) but spec.nodes is "
                         f"{want}: start {want} node{'s' if want > 1 else ''} (--nnodes {want}), or set spec.nodes: "
                         f"{count} in the job and apply it again")
    if count == 1:
        return None
    if rank is None:
        raise NodesError(f"--node-rank: missing; give each of the {count} nodes its rank, 0 to {count - 1} (0: the "
                         f"node that holds the job)")
    if not 0 <= rank < count:
        raise NodesError(f"--node-rank {rank}: out of range for {count} nodes; use 0 to {count - 1}")
    if not addr:
        raise NodesError("--master: missing; give HOST:PORT of the node of rank 0 (the address the other nodes "
                         "reach it at, and a free port there)")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodesError(f"--master {addr!r}: expected HOST:PORT, e.g. 10.0.0.5:{TORCH_MASTER_PORT} (the node of "
                         f"rank 0, and a free port there)")
    return Nodes(count=count, rank=rank, master=addr)


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise NodesError(f"{name}={value!r} in this node's environment: expected a whole number") from None
