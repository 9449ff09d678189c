"""What each object store asks of a job's nodes (`grpo-run deploy`): which store a storage URL
names, the settings a node's environment carries for it, the install extra its client library
comes in, and what fetches the wheel from it before anything else is installed.

A node reaches its store with its own identity, never with keys in a launch file:
- s3://bucket/prefix: the instance role (or the keys of an S3-compatible store put on the node
  another way); AWS_DEFAULT_REGION and AWS_ENDPOINT_URL (--region, --endpoint) are its settings.
- gs://bucket/prefix: the VM's service account, through Application Default Credentials; nothing
  to set (STORAGE_EMULATOR_HOST is for emulators, not nodes).
- az://container/prefix: the VM's managed identity (DefaultAzureCredential) for the account in
  AZURE_STORAGE_ACCOUNT (--account); the container's URL is https://ACCOUNT.blob.core.windows.net.
- file:///path or /path: a folder every node mounts; none of the above.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

FORMS = "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///path or /path"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
# Azure's rule for storage account names: 3 to 24 characters, digits and lower-case letters only.
# Checked here because the name goes into the node's environment and into `deploy iam`'s commands.
_ACCOUNT = re.compile(r"[a-z0-9]{3,24}")

# The extra of grpo-run each store's client library comes in (pyproject's optional dependencies):
# boto3 and s3fs are grpo-run's own dependencies, so S3 and folders need none.
EXTRAS = {"gs": "gcs", "az": "azure"}
# The distributions that fetch the wheel and its constraints from storage (deploy/install-node.sh),
# installed into the node's new venv first, each pinned as the constraints pin it where they do.
FETCHERS = {"s3": ("boto3",), "gs": ("google-cloud-storage",), "az": ("azure-storage-blob", "azure-identity")}


def scheme(storage: str) -> str:
    """Which store `storage` names: "s3", "gs", "az" or "file" (a folder). ValueError naming
    --storage and the forms it takes for anything else: an unknown scheme, a URL with no bucket or
    container, credentials in the URL, or an Azure account where the container goes."""
    if storage.startswith("/"):
        return "file"
    url = urlparse(storage)
    kind = url.scheme.lower()
    if kind == "file":
        return "file"
    if kind not in ("s3", "gs", "az"):
        raise ValueError(f"--storage {storage!r}: expected {FORMS} (the job's spec.storage)")
    holder = "container" if kind == "az" else "bucket"
    if not url.netloc:
        raise ValueError(f"--storage {storage!r}: names no {holder}; expected {kind}://{holder}/prefix")
    if "@" in url.netloc:
        raise ValueError(f"--storage: a {kind}:// URL carries no credentials; the nodes reach the {holder} "
                         f"with their own identity (deploy iam prints what it may do)")
    if kind == "az" and "." in url.netloc:
        raise ValueError(f"--storage {storage!r}: give the container alone, az://container/prefix, and the "
                         f"storage account with --account NAME (or {ACCOUNT_ENV})")
    return kind


def split(storage: str) -> tuple[str, str]:
    """(bucket or container, prefix without its slashes) of a cloud storage URL."""
    url = urlparse(storage)
    return url.netloc, url.path.strip("/")


def check_account(account: str) -> str:
    """`account` if it is an Azure storage account name, else ValueError naming --account."""
    if not _ACCOUNT.fullmatch(account):
        raise ValueError(f"--account {account!r}: an Azure storage account's name is 3 to 24 digits and "
                         f"lower-case letters (the name alone, not its URL)")
    return account


def check_settings(storage: str, *, region: str | None, endpoint: str | None, account: str | None) -> str:
    """The store `storage` names (scheme), after refusing the settings that mean nothing for it:
    --region and --endpoint are S3's, --account is Azure's. ValueError naming the option and the fix."""
    kind = scheme(storage)
    if kind in ("gs", "az"):
        reaches = ("Google Cloud Storage with the VM's service account" if kind == "gs"
                   else "https://ACCOUNT.blob.core.windows.net with the VM's managed identity")
        for option, value in (("--region", region), ("--endpoint", endpoint)):
            if value:
                raise ValueError(f"{option} {value}: an S3 setting; a node reaches {reaches}, so {kind}:// "
                                 f"storage takes no {option}: leave it out")
    if account and kind != "az":
        raise ValueError(f"--account {account}: the Azure storage account of az://container/prefix storage; "
                         f"{storage} needs none: leave it out")
    if account:
        check_account(account)
    return kind


def node_env(storage: str, *, region: str | None = None, endpoint: str | None = None,
             account: str | None = None) -> list[tuple[str, str]]:
    """The store's settings in a node's environment, in order, values possibly empty (a launch
    file drops those): S3's region and endpoint (for a folder too, as the launch files always
    wrote them: --region and --endpoint are accepted there), Azure's account, nothing for GCS."""
    kind = scheme(storage)
    if kind == "gs":
        return []
    if kind == "az":
        return [(ACCOUNT_ENV, account or "")]
    return [("AWS_DEFAULT_REGION", region or ""), ("AWS_ENDPOINT_URL", endpoint or "")]


def fetcher(url: str, constraints: str) -> str:
    """What install-node.sh installs to fetch `url` (the wheel's place in storage), space-separated,
    each pinned as `constraints` pins it ("" for a local path: nothing to fetch with)."""
    kind = scheme(url)
    names = FETCHERS.get(kind, ())
    return " ".join(_pinned(name, constraints) for name in names)


def _pinned(name: str, constraints: str) -> str:
    """`name==VERSION` as `constraints` pins it (pip's names compare with - _ . alike, any case),
    else `name` alone (a constraints file that lacks it, from before the store's extra existed)."""
    spelled = re.escape(name).replace(r"\-", "[-_.]")
    pin = re.search(rf"(?mi)^{spelled}==(\S+)\s*$", constraints)
    return f"{name}=={pin.group(1)}" if pin else name
