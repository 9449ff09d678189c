"""A Kubernetes Job that trains a job on spot nodes (`grpo-run deploy k8s`): the spot pools' labels
and taints, the GPU request and selector, and the pod's security settings."""

from __future__ import annotations

import re

import yaml

from grpo_run.runner.deploy import stores
from grpo_run.runner.deploy.node import NodeSettings
from grpo_run.runner.exits import EXIT_BUDGET, EXIT_PREEMPTED, EXIT_USAGE
from grpo_run.trainer.protocol import MASTER_ENV, NODES_ENV, NODES_SECRET_ENV, TORCH_MASTER_PORT
from grpo_run.runner.spec.gpus import ALIASES

# Node labels and taints of the common managed spot pools: Karpenter, EKS managed node groups,
# GKE Spot VMs, AKS spot node pools.
SPOT_POOLS = {
    "karpenter": ({"karpenter.sh/capacity-type": "spot"}, []),
    "eks": ({"eks.amazonaws.com/capacityType": "SPOT"}, []),
    "gke": ({"cloud.google.com/gke-spot": "true"},
            [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]),
    "aks": ({"kubernetes.azure.com/scalesetpriority": "spot"},
            [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
              "effect": "NoSchedule"}]),
}
# spec.gpu as the label each pool's own autoscaler provisions by, so a pod asks for the card the
# job was estimated and priced for (a pod that only asks for nvidia.com/gpu takes whatever GPU node
# comes first). Only labels the provisioner itself sets and documents, known before the node exists:
# - karpenter: karpenter.k8s.aws/instance-gpu-name (Karpenter's well-known AWS labels: the GPU's
#   name in lower case, from EC2's DescribeInstanceTypes); the two A100s differ only in
#   karpenter.k8s.aws/instance-gpu-memory, in MiB per GPU (p4d 40960, p4de 81920);
# - gke: cloud.google.com/gke-accelerator (GKE's GPU node label, Compute Engine's accelerator
#   type), for the cards Compute Engine sells;
# - eks (managed node groups) and aks: none; the node group's instance types decide the card.
#   NVIDIA GPU feature discovery's nvidia.com/gpu.product is set only once a node runs it (the
#   GPU Operator), so no autoscaler can provision for it, and its values spell each board
#   variant (NVIDIA-H100-80GB-HBM3, NVIDIA-H100-PCIe): the manifest says so instead of selecting.
GPU_LABELS: dict[str, tuple[str, dict[str, dict[str, str]]]] = {
    "karpenter": ("Karpenter's well-known labels", {
        "H100": {"karpenter.k8s.aws/instance-gpu-name": "h100"},
        "H200": {"karpenter.k8s.aws/instance-gpu-name": "h200"},
        "B200": {"karpenter.k8s.aws/instance-gpu-name": "b200"},
        "A100-80GB": {"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-memory": "81920"},
        "A100": {"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-memory": "40960"},
        "L40S": {"karpenter.k8s.aws/instance-gpu-name": "l40s"},
        "L4": {"karpenter.k8s.aws/instance-gpu-name": "l4"},
        "A10G": {"karpenter.k8s.aws/instance-gpu-name": "a10g"},
        "T4": {"karpenter.k8s.aws/instance-gpu-name": "t4"},
    }),
    "gke": ("GKE's accelerator label", {
        "H100": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "H200": {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"},
        "B200": {"cloud.google.com/gke-accelerator": "nvidia-b200"},
        "A100-80GB": {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"},
        "A100": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
        "L4": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        "T4": {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"},
    }),
}


def gpu_selector(pool: str, gpu: str | None) -> tuple[dict[str, str], str]:
    """The node labels that pick spec.gpu `gpu` in `pool` ({} when there is none to pick by), and a
    comment line for the manifest saying what was chosen or why nothing was."""
    if gpu is None:
        return {}, "# GPU type: not selected (no job file with spec.gpu): the pod takes any GPU node of the pool"
    card = ALIASES.get(gpu)
    where, labels = GPU_LABELS.get(pool, ("", {}))
    if card in labels:
        return dict(labels[card]), f"# GPU type: spec.gpu {gpu} selected by {where}"
    if pool in GPU_LABELS:
        return {}, (f"# GPU type: spec.gpu {gpu} is not selected: {where} name no such card; the pool's "
                    "instance types decide it")
    return {}, (f"# GPU type: spec.gpu {gpu} is not selected: a {pool} pool's autoscaler has no label for the GPU "
                "type; its node group's instance types decide it (NVIDIA GPU feature discovery's "
                "nvidia.com/gpu.product names it once a node runs it)")


# A notice's emergency checkpoint and its upload, then the supervisor's exit: measured 1.2-1.3 s to
# durable and 2.3-3.6 s to the exit (the demo job, every cloud's notice and SIGTERM, a local S3
# server); 90 s leaves room for a bigger checkpoint over a real network and stays under AWS's
# 120 s notice (GCP and Azure give about 30 s: the node goes first there, whatever this says).
STOP_GRACE_S = 90
# The pod's user and group: any uid but 0 (runAsNonRoot); the image's installed files must be
# readable by it (scripts/setup leaves them world-readable). fsGroup makes the /work volume its.
RUN_AS_UID = 1000
# --seccomp: the container's seccomp profile (see K8S_SECURITY_NOTE for why the default is not
# the runtime's).
SECCOMP_CHOICES = ("unconfined", "runtime-default", "localhost/PATH")

K8S_SECURITY_NOTE = """\
# grpo-run deploy k8s: a Job that trains the job on spot nodes. Its security settings, and what the
# cluster must allow (docs/deploy.md, "Kubernetes: what the pod may do"):
# - uid/gid @UID@, never root (runAsNonRoot); fsGroup makes the /work volume writable; no privilege
#   escalation; every capability dropped; no Kubernetes API token (grpo-run never calls the API;
#   workload identity, IRSA or EKS Pod Identity mount their own token: --service-account-token
#   mounts the API token all the same).
# - seccomp @SECCOMP@ for the container: the reward sandbox's strict mode (spec.sandbox: strict)
#   puts the reward function in user, network and PID namespaces of its own, and the runtime's
#   default profile (RuntimeDefault) refuses unshare() to a container without CAP_SYS_ADMIN. The
#   reward worker runs under grpo-run's own seccomp filter (no sockets) either way. Where Pod
#   Security "baseline" or "restricted" refuses Unconfined, install a profile on the nodes that
#   is the runtime's default plus unshare(), and pass --seccomp localhost/PATH.
# - the nodes must allow unprivileged user namespaces (user.max_user_namespaces > 0; on Ubuntu
#   23.10+ also kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile that
#   allows userns); otherwise a strict job fails at its first reward, naming what is missing.
"""


def seccomp_profile(choice: str) -> dict:
    """--seccomp as a securityContext.seccompProfile: `unconfined`, `runtime-default`, or
    `localhost/PATH` (a profile under the kubelet's seccomp folder on every node). ValueError
    naming the choices for anything else."""
    if choice == "unconfined":
        return {"type": "Unconfined"}
    if choice == "runtime-default":
        return {"type": "RuntimeDefault"}
    path = choice.removeprefix("localhost/")
    if choice.startswith("localhost/") and path and not path.startswith("/") and ".." not in path.split("/"):
        return {"type": "Localhost", "localhostProfile": path}
    raise ValueError(f"--seccomp {choice!r}: expected one of {', '.join(SECCOMP_CHOICES)} (PATH relative to "
                     f"the kubelet's seccomp folder, e.g. localhost/profiles/grpo-run.json)")


_QUANTITY = re.compile(r"^([1-9][0-9]*)(Mi|Gi|Ti)$")


def memory_quantity(text: str) -> str:
    """--memory as a Kubernetes quantity: a whole number of Mi, Gi or Ti, at least 1Gi (the trainer
    alone needs more). ValueError naming the form otherwise."""
    match = _QUANTITY.match(text.strip())
    mib = int(match.group(1)) * {"Mi": 1, "Gi": 1 << 10, "Ti": 1 << 20}[match.group(2)] if match else 0
    if mib < 1024:
        raise ValueError(f"--memory {text!r}: expected the pod's memory as a whole number of Mi, Gi or Ti, at "
                         f"least 1Gi, e.g. 48Gi")
    return text.strip()


def kubernetes_job(s: NodeSettings, *, image: str, pool: str = "karpenter", gpus: int = 1,
                   secret: str | None = None, service_account: str | None = None,
                   seccomp: str = "unconfined", uid: int = RUN_AS_UID,
                   service_account_token: bool = False, all_jobs: bool = False, wait: bool = False,
                   gpu: str | None = None, nodes: int = 1, memory: str | None = None,
                   memory_note: str = "") -> str:
    """A batch/v1 Job that runs the job on a spot node pool and survives losing nodes: a pod that
    exits 3 (preempted) or whose node was taken is replaced without counting against
    backoffLimit; exits 2 (bad input) and 4 (budget) fail the Job at once; other failures are
    retried up to backoffLimit. Credentials come from a Secret (`secret`: its keys become the
    environment, e.g. AWS_ACCESS_KEY_ID) or the service account's workload identity, never from
    the manifest.

    The pod runs as `uid`, not root, with no privilege escalation, no capabilities and no
    Kubernetes API token unless `service_account_token`; its seccomp profile is `seccomp`
    (seccomp_profile; K8S_SECURITY_NOTE, printed at the top, says why Unconfined by default).

    The container runs `grpo-run resume NAME --storage URI --wait` (a replacement pod waits out the
    lost pod's lease), or with `all_jobs` `grpo-run resume --storage URI --all`: the pod serves
    every job under the prefix and ends when none is left (runner/jobs/queue.py), or with `wait` waits
    for new ones (s.job is then not used).

    The pod asks for `gpus` GPUs (nvidia.com/gpu, one per trainer process), tolerates the
    nvidia.com/gpu taint GPU node pools carry, and with `gpu` (spec.gpu) selects that card by the
    pool's own label where it has one (gpu_selector; a comment at the top says which or why not).
    The image must hold the client library of the job's store (`grpo-run deploy image --storage
    gs://... or az://...` puts the extra in): a comment at the top says which.

    `nodes` > 1: an indexed Job of that many pods (completions = parallelism = nodes) and a headless
    Service that names them, each pod `NAME-INDEX.NAME`: every pod runs the same `resume`, its rank
    from JOB_COMPLETION_INDEX, rank 0's pod at GRPO_RUN_MASTER (runner.jobs.nodes). A pod lost or
    preempted makes every pod exit 3 (the group stops together), and each is replaced.

    ValueError for a bad pool, seccomp choice or uid, for az:// storage with neither an account
    nor a Secret (whose keys may carry AZURE_STORAGE_ACCOUNT or AZURE_STORAGE_CONNECTION_STRING),
    or for several nodes with all_jobs or without a job."""
    if nodes > 1 and (all_jobs or not s.job):
        raise ValueError(f"--nodes {nodes}: name the job that trains on {nodes} nodes (--job or -f); a queue (--all) "
                         f"is served one job at a time on one node")
    s.require_account(elsewhere=secret)
    if pool not in SPOT_POOLS:
        raise ValueError(f"--pool {pool!r}: expected one of {', '.join(SPOT_POOLS)}")
    if isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0:
        raise ValueError(f"--uid {uid!r}: expected a user id above 0 (the pod never runs as root)")
    profile = seccomp_profile(seccomp)
    selector, tolerations = SPOT_POOLS[pool]
    by_card, said = gpu_selector(pool, gpu) if gpus else ({}, "# GPU: none asked for (--gpus 0)")
    if gpus:     # GPU pools are commonly tainted so that pods without GPUs stay off them
        tolerations = [*tolerations, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    name = f"grpo-run-{s.job}" if s.job else "grpo-run"
    labels = {"app.kubernetes.io/name": "grpo-run", **({"grpo-run/job": s.job} if s.job else {})}
    # HOME and HF_HOME on the volume: the pod's user has no home folder in the image to write caches to.
    env = [{"name": "GRPO_RUN_HOME", "value": "/work"}, {"name": "GRPO_RUN_NOTICES", "value": "auto"},
           {"name": "GRPO_RUN_SANDBOX", "value": "strict"},      # reward functions only in the full sandbox
           {"name": "HOME", "value": "/work"}, {"name": "HF_HOME", "value": "/work/huggingface"}]
    env += [{"name": k, "value": v} for k, v in s.env() if v]       # the store's settings: S3's, or Azure's account
    if nodes > 1:        # the rank comes from JOB_COMPLETION_INDEX; pod 0 is rank 0's node
        env += [{"name": NODES_ENV, "value": str(nodes)},
                {"name": MASTER_ENV, "value": f"{name}-0.{name}:{TORCH_MASTER_PORT}"},
                # the node secret (trainer.distributed.admit): the Job's uid, which every pod of this Job
                # carries and a host that only reaches the pod network does not know
                {"name": NODES_SECRET_ENV, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.labels['{JOB_UID_LABEL}']"}}}]
    resources: dict = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    if memory:           # request = limit: the pod's cgroup bounds the reward's tree where nothing else does
        resources = {"requests": {"memory": memory}, "limits": {**resources.get("limits", {}), "memory": memory}}
    container = {
        "name": "grpo-run", "image": image,
        "command": ["grpo-run", "resume", "--storage", s.storage, "--all", *(["--wait"] if wait else [])] if all_jobs
        else ["grpo-run", "resume", *([s.job] if s.job else []), "--storage", s.storage, "--wait"],
        "env": env,
        "resources": resources,
        "volumeMounts": [{"name": "work", "mountPath": "/work"}],
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,          # no_new_privs: the sandbox's Landlock and seccomp want it too
            "capabilities": {"drop": ["ALL"]},          # user namespaces need none
            "seccompProfile": profile,
        },
    }
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    pod = {
        "restartPolicy": "Never",                       # required by podFailurePolicy; the Job makes new pods
        # the pause container is PID 1 and reaps orphans; grpo-run, its child, gets the kubelet's
        # SIGTERM and has the grace period for the emergency checkpoint and its upload
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": STOP_GRACE_S,
        "automountServiceAccountToken": service_account_token,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid},
        "nodeSelector": {**selector, **by_card},
        "containers": [container],
        "volumes": [{"name": "work", "emptyDir": {}}],
    }
    if tolerations:
        pod["tolerations"] = tolerations
    if service_account:
        pod["serviceAccountName"] = service_account
    if nodes > 1:
        pod["subdomain"] = name                         # NAME-INDEX.NAME: the headless Service below
        container["ports"] = [{"name": "rendezvous", "containerPort": TORCH_MASTER_PORT}]
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
        "spec": {
            # counted failures: crashes past the supervisor's own restarts (a lost pod's lease that has
            # not expired yet is waited for by --wait, not an exit)
            "backoffLimit": 6,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onExitCodes": {"containerName": "grpo-run", "operator": "In",
                                                     "values": [EXIT_PREEMPTED]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},   # node taken
                {"action": "FailJob", "onExitCodes": {"containerName": "grpo-run", "operator": "In",
                                                      "values": [EXIT_USAGE, EXIT_BUDGET]}},
            ]},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }
    note = K8S_SECURITY_NOTE.replace("@UID@", str(uid)).replace("@SECCOMP@", profile["type"])
    said += "\n" + (memory_note or (f"# memory: {memory} requested and limited (--memory)" if memory else
                     "# memory: not set (no job file to estimate it from, no --memory): the pod is BestEffort, "
                     "and where\n# the node gives the reward sandbox no cgroup only RLIMIT_AS bounds a reward's "
                     "processes; give\n# --memory SIZE (e.g. 48Gi) or -f JOB"))
    if nodes <= 1:
        return note + said + "\n" + _store_note(s) + yaml.safe_dump(job, sort_keys=False)
    job["spec"].update(completionMode="Indexed", completions=nodes, parallelism=nodes)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": dict(labels)},
               "spec": {"clusterIP": "None", "selector": dict(labels), "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": TORCH_MASTER_PORT}]}}
    return (note + said + "\n" + _store_note(s) + f"# {nodes} nodes: an indexed Job of {nodes} pods and the headless "
            f"Service that names them ({name}-0.{name} is rank 0's)\n" + yaml.safe_dump(service, sort_keys=False)
            + "---\n" + NETWORK_POLICY_NOTE + yaml.safe_dump(job_network_policy(name, labels), sort_keys=False)
            + "---\n" + yaml.safe_dump(job, sort_keys=False))


JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"     # set by the Job controller on each of its pods (1.27+)
NETWORK_POLICY_NOTE = (
    "# Only the job's own pods may reach its pods: rank 0's rendezvous store (port "
    f"{TORCH_MASTER_PORT}) has no\n# authentication, and gloo/NCCL between the ranks is not encrypted "
    "(docs/security.md). A NetworkPolicy\n# is enforced only where the cluster's network plugin does it "
    "(Calico, Cilium, GKE Dataplane V2, the\n# EKS VPC CNI with network policies on): check yours.\n")


def job_network_policy(name: str, labels: dict[str, str]) -> dict:
    """A NetworkPolicy that admits to the job's pods only the job's own pods, on any port: the
    rendezvous port, and the ports gloo and NCCL open between the ranks."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-nodes", "labels": dict(labels)},
            "spec": {"podSelector": {"matchLabels": dict(labels)}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": dict(labels)}}]}]}}


def _store_note(s: NodeSettings) -> str:
    """A comment line saying what the image needs for the job's store ("" for S3 and folders,
    whose client is grpo-run's own dependency)."""
    extra = stores.EXTRAS.get(s.store)
    if extra is None:
        return ""
    return (f"# Storage {s.store}://: --image must hold grpo-run[{extra}] (grpo-run deploy image --storage "
            f"{s.storage} puts it in); it signs in with --service-account's workload identity, or --secret's keys\n")
