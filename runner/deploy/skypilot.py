"""A SkyPilot managed job on spot capacity (`grpo-run deploy skypilot`) that resumes the job from its
storage at every relaunch."""

from __future__ import annotations

from dataclasses import replace

import yaml

from grpo_run.runner.deploy.node import NodeSettings, install_script
from grpo_run.runner.spec.gpus import ALIASES
from grpo_run.trainer.protocol import TORCH_MASTER_PORT


def skypilot_task(s: NodeSettings, *, accelerators: str, cloud: str | None = None, all_jobs: bool = False,
                  wait: bool = False, nodes: int = 1) -> str:
    """A SkyPilot task for `sky jobs launch`: a managed job on spot capacity that SkyPilot relaunches
    when the node is taken (strategy EAGER_NEXT_REGION; a failed run is not restarted, since
    grpo-run restarts its own trainer), and whose `run:` resumes the job from its storage, so each
    relaunch continues from the newest durable checkpoint. `accelerators`: SkyPilot's name for the
    GPU (e.g. H100:1); required, since a task without it runs on a CPU node.

    The run ends when there is nothing to do: `resume NAME` exits 2 for a job that was never
    submitted, `resume --all` (`all_jobs`: every job under the prefix, runner/jobs/queue.py) exits once
    none is left. Only with `wait` does it wait for submissions, on a GPU paid meanwhile.
    With all_jobs, s.job is not used. The store's settings are envs (S3's region and endpoint,
    Azure's account; GCS needs none). `nodes` > 1: a cluster of that many (num_nodes), each running
    the same `resume`, which takes its rank and rank 0's address from SkyPilot's own variables
    (runner.jobs.nodes); SkyPilot relaunches the whole cluster when one node is taken. ValueError
    without accelerators, for az:// storage without an account, or for several nodes with all_jobs."""
    if nodes > 1 and all_jobs:
        raise ValueError(f"--nodes {nodes} and --all: a queue is served one job at a time on one node; give the "
                         f"job that trains on {nodes} nodes (--job or -f)")
    if not accelerators:
        raise ValueError("skypilot: give --accelerators GPU:N (e.g. H100:1), or -f JOB with spec.gpu: "
                         "a task without accelerators runs on a CPU node")
    s.require_account()
    envs = {"GRPO_RUN_STORAGE": s.storage, "GRPO_RUN_SANDBOX": "strict"}
    if s.job and not all_jobs:
        envs["GRPO_RUN_JOB"] = s.job
    envs.update((k, v) for k, v in s.env() if v)
    resources: dict = {"use_spot": True, "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0},
                       "accelerators": accelerators}
    if cloud:
        resources["cloud"] = cloud
    task = {
        "name": f"grpo-run-{s.job}" if s.job and not all_jobs else "grpo-run",
        **({"num_nodes": nodes} if nodes > 1 else {}),
        "resources": resources,
        "envs": envs,
        "setup": skypilot_setup(s),
        "run": (f'{SKYPILOT_PREFIX}/.venv/bin/grpo-run resume '
                + ('--storage "$GRPO_RUN_STORAGE" --all' if all_jobs else '$GRPO_RUN_JOB --storage "$GRPO_RUN_STORAGE"')
                + (' --wait' if wait else '') + '\n'
                'status=$?\n'
                '# 3: stopped with the checkpoint durable. After a spot notice (on this node or, for a job of several\n'
                '# nodes, another of them) the cluster is going away: wait for it to go, so SkyPilot sees a preemption\n'
                '# and relaunches, not a failed run (which it would not retry). A lost peer or a rendezvous timeout\n'
                '# also exits 3, on nodes that stay: the record says so (its newest attempt Crashed, not Preempted),\n'
                '# and the task ends now instead of 15 paid minutes later. A record that cannot be read: wait.\n'
                f'if [ "$status" -eq 3 ] && ! {SKYPILOT_PREFIX}/.venv/bin/grpo-run get tj '
                + ('-o json' if all_jobs else '$GRPO_RUN_JOB --storage "$GRPO_RUN_STORAGE" -o json')
                + f' 2>/dev/null | {SKYPILOT_PREFIX}/.venv/bin/python -c \'import json, sys\n'
                'try:\n'
                '    doc = json.load(sys.stdin)\n'
                '    ended = [(j["status"].get("attempts") or [{}])[-1].get("reason") for j in doc.get("items", [doc])\n'
                '             if j["status"].get("phase") == "Preempted"]\n'
                'except Exception:\n'
                '    sys.exit(1)\n'
                'sys.exit(0 if ended and all(r == "Crashed" for r in ended) else 1)\'; then sleep 900; fi\n'
                'exit "$status"\n'),
    }
    text = yaml.dump(task, Dumper=_BlockDumper, sort_keys=False)
    return SKYPILOT_NODES_NOTE + text if nodes > 1 else text


# Several nodes: who may reach rank 0's rendezvous port (docs/security.md, "Several nodes").
SKYPILOT_NODES_NOTE = (
    f"# {TORCH_MASTER_PORT} on the first node is rank 0's rendezvous store: no authentication, and gloo/NCCL between\n"
    "# the nodes is not encrypted. Only the cluster's own nodes may reach it: SkyPilot's security group admits\n"
    "# them and SSH alone, so never list the port under `ports:`. Give every node one secret, which proves\n"
    "# membership before rank 0 sends its plan or a checkpoint and signs a node's failure:\n"
    "#   sky launch task.yaml --env GRPO_RUN_NODES_SECRET=$(openssl rand -hex 32)\n")


# On a SkyPilot node grpo-run goes into the home folder of SkyPilot's user (not root).
SKYPILOT_PREFIX = "$HOME/grpo-run"


def skypilot_setup(s: NodeSettings) -> str:
    """SkyPilot's `setup:`: python3-venv where the image lacks it (Ubuntu's python3 comes without),
    then install_script into SKYPILOT_PREFIX, run with the task's envs (the store's settings)."""
    script = install_script(replace(s, prefix=SKYPILOT_PREFIX))
    return ('python3 -c "import ensurepip" 2>/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q python3-venv; }\n'
            f"cat > install-node.sh <<'INSTALL'\n{script}INSTALL\n"
            "bash install-node.sh\n")


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a task's setup and run scripts) as YAML literal blocks."""


_BlockDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


# spec.gpu as SkyPilot's accelerators: the GPU table's names are SkyPilot's own (runner.spec.gpus), and
# the earlier names are aliases of them.
SKYPILOT_GPUS = {name: f"{table_name}:1" for name, table_name in ALIASES.items()}


def skypilot_accelerators(given: str | None, gpu: str | None, job_file: str | None) -> str:
    """The task's accelerators: --accelerators, else the job file's spec.gpu as SkyPilot names it.
    ValueError naming both when neither gives one: a task without accelerators would run, and
    wait, on a CPU node."""
    if given:
        return given
    if gpu and gpu in SKYPILOT_GPUS:
        return SKYPILOT_GPUS[gpu]
    if gpu:
        raise ValueError(f"skypilot: spec.gpu {gpu!r} of {job_file} is not a GPU SkyPilot names; give --accelerators "
                         f"GPU:N (e.g. H100:1)")
    where = f"{job_file} has no spec.gpu" if job_file else "no job file (-f) with spec.gpu"
    raise ValueError(f"skypilot: give --accelerators GPU:N (e.g. H100:1): {where}, and a task without "
                     f"accelerators runs on a CPU node")
