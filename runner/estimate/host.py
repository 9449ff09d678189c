"""The host memory (RAM) one node of a job needs beside its GPUs: what `grpo-run deploy k8s`
requests for the pod and limits it to. The limit is a protection as much as a reservation: where a
node gives the reward sandbox no cgroup of its own (a pod's cgroupfs is read-only), the pod's
cgroup still bounds a reward's processes, and the kernel's OOM killer takes the reward's worker
(oom_score_adj 1000) instead of the kubelet evicting the whole job.

    pod_memory(job, estimate(job)["memory"], processes=1)   # PodMemory(gib=25, parts=[...])

Decimal gigabytes (1e9 bytes) as the rest of the estimate counts them; the sum is rounded up to
whole GiB, Kubernetes' unit. Per trainer process (one per GPU):
  - PROCESS_BASE_GB: Python, torch and the CUDA libraries' host side, the tokenizer and the task
    data. An allowance, not a measurement on a GPU node: importing the trainer takes 0.3 GB on a
    CPU-only node, and CUDA's libraries and context add a few GB of host memory where they load;
  - the model's weights in 16 bits (2 bytes a parameter): loading reads them into host memory on
    their way to the GPU;
  - colocated vLLM: the engine's weights (engineWeightsGB), which it keeps in host memory while it
    sleeps through the update;
  - each sandboxed grader (a reward function's, an episodes environment's): rewardMemoryMB for its
    processes and as much again for its scratch tmpfs, which is memory too.
Once per node: NODE_BASE_GB for the supervisor and the checkpoint writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from grpo_run.runner.spec.job import TrainingJob

PROCESS_BASE_GB = 4.0
NODE_BASE_GB = 1.0


@dataclass(frozen=True)
class PodMemory:
    gib: int                      # the pod's request and limit, in GiB
    parts: tuple[str, ...]        # what it is made of, for the manifest's comment

    @property
    def quantity(self) -> str:
        return f"{self.gib}Gi"


def graders(job: TrainingJob) -> int:
    """Sandboxed grader processes one trainer process keeps: one per reward function (a reward model
    or a judge runs in the trainer's own process) and one for an episodes environment."""
    from grpo_run.runner.environments import rewards_of

    env = job.environment
    functions = sum(1 for r in rewards_of(env) if not r.model and r.judge is None)
    return functions + (1 if env.plays_episodes else 0)


def pod_memory(job: TrainingJob, memory: Mapping[str, Any], *, processes: int = 1) -> PodMemory:
    """The host memory a node of `job` needs, from its estimate's `memory` (estimate(job)["memory"])
    and the trainer processes on the node (`processes`, one per GPU)."""
    p = job.parameters
    weights = memory["parameters"] * 2 / 1e9
    engine = float((memory.get("engine") or {}).get("engineWeightsGB") or 0.0)
    sandbox = graders(job) * 2 * p.rewardMemoryMB / 1000
    each = PROCESS_BASE_GB + weights + engine + sandbox
    total = NODE_BASE_GB + max(1, processes) * each
    parts = [f"{max(1, processes)} trainer process{'es' if processes > 1 else ''} x ({PROCESS_BASE_GB:g} GB base",
             f"{weights:.1f} GB of 16-bit weights",
             *([f"{engine:.1f} GB of the sleeping vLLM engine's weights"] if engine else []),
             f"{graders(job)} sandboxed grader(s) x 2 x rewardMemoryMB {p.rewardMemoryMB})",
             f"{NODE_BASE_GB:g} GB for the supervisor and the checkpoint writer"]
    return PodMemory(max(1, math.ceil(total * 1e9 / (1 << 30))), tuple(parts))
