"""What a job's nodes may do in its storage (`grpo-run deploy iam`), for each cloud: read, write,
list and delete under the job's storage prefix, nothing else, and never a write or delete under
its _dist/ (the wheel nodes install: only the submitting user's own credentials put it there).

- s3://bucket/prefix: an AWS IAM policy (JSON) to attach to the nodes' role.
- gs://bucket/prefix: a shell script of gcloud commands: two custom roles bound on the bucket
  with IAM conditions on the object's name (gcs_grant).
- az://container/prefix: a shell script of az commands: a custom data role assigned on the
  container with an ABAC condition on the blob's path (azure_grant).

AWS has one document to attach; GCP and Azure have roles and bindings made by commands, so
those are printed as the commands, for the user to read and run. Names that go into them (the
bucket or container, the prefix, the account) are checked to need no quoting in a shell, in
Google's CEL or in Azure's condition language.

Spot notices need no grant on any cloud: AWS's, GCP's and Azure's (Scheduled Events) come from
the instance's own metadata service, which answers without a role.
"""

from __future__ import annotations

import json
import re

import yaml

from grpo_run.runner.deploy import stores
from grpo_run.runner.deploy.wheel import DIST_PREFIX

# A prefix's path components: letters, digits, '.', '_' and '-' (nothing a shell, CEL or Azure's
# condition language would need escaped).
_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
# Cloud Storage bucket names: digits, lower-case letters, '-', '_' and '.', starting and ending
# with a letter or digit, 3 to 222 characters.
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
# Azure container names: 3 to 63 digits, lower-case letters and single hyphens, starting and
# ending with a letter or digit.
_AZ_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}")


def iam_policy(storage: str, *, account: str | None = None) -> str:
    """What the nodes of the jobs under `storage` need, for its cloud (see the module): the AWS
    policy for s3://, the gcloud script for gs://, the az script for az:// (`account`: the
    container's storage account, required there). ValueError naming the option and the fix for
    a folder, a malformed URL, a name that would need escaping, or az:// without an account."""
    kind = stores.scheme(storage)
    if kind == "s3":
        return aws_policy(storage)
    if kind == "file":
        raise ValueError(f"--storage {storage!r}: a folder has no cloud identity to grant; deploy iam is for "
                         f"s3://bucket/prefix, gs://bucket/prefix or az://container/prefix storage")
    holder, prefix = stores.split(storage)
    if prefix and not _PREFIX.fullmatch(prefix):
        raise ValueError(f"--storage {storage!r}: the prefix {prefix!r} has characters a policy condition would "
                         f"have to escape; use letters, digits, '.', '_', '-' and '/'")
    if kind == "gs":
        if not _GCS_BUCKET.fullmatch(holder):
            raise ValueError(f"--storage {storage!r}: {holder!r} is not a Cloud Storage bucket name (3 to 222 "
                             f"digits, lower-case letters, '-', '_' and '.')")
        return gcs_grant(holder, prefix)
    if not _AZ_CONTAINER.fullmatch(holder):
        raise ValueError(f"--storage {storage!r}: {holder!r} is not an Azure container name (3 to 63 digits, "
                         f"lower-case letters and single hyphens)")
    if not account:
        raise ValueError(f"--storage {storage}: give --account NAME, the storage account that holds container "
                         f"{holder!r} (or set {stores.ACCOUNT_ENV}): the role is assigned on the container, "
                         f"whose scope names its account")
    return azure_grant(stores.check_account(account), holder, prefix)


def aws_policy(storage: str) -> str:
    """The AWS IAM policy a node needs for the jobs under `storage` (s3://bucket/prefix): list the
    prefix; get, put and delete its objects (the lease's conditional writes are puts); abort its
    multipart uploads; but never write or delete under PREFIX/_dist/ (the wheel and constraints
    nodes install: only the submitting user's own credentials put them there). Nothing outside
    the prefix, no bucket-level changes."""
    bucket, prefix = stores.split(storage)
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


# --- Google Cloud Storage -------------------------------------------------------------------------

# Two custom roles, because one IAM condition applies to all of a binding's permissions alike and
# the nodes must read PREFIX/_dist/ (the wheel they install) but not write it. Cloud Storage's
# permission tables: reading an object is storage.objects.get; an upload is storage.objects.create,
# plus storage.objects.delete when it replaces an object (the lease's conditional replace on a
# generation, a record uploaded again); listing is storage.objects.list, checked on the bucket.
GCS_READ = ("grpoRunNodeRead", "grpo-run node: read", ("storage.objects.get", "storage.objects.list"))
GCS_WRITE = ("grpoRunNodeWrite", "grpo-run node: write", ("storage.objects.create", "storage.objects.delete"))


def gcs_conditions(bucket: str, prefix: str) -> dict[str, dict[str, str]]:
    """The IAM conditions (gcloud's --condition-from-file: title, description, expression) of the
    read and the write binding, by role id.

    Objects are `projects/_/buckets/BUCKET/objects/NAME` to a condition, the bucket itself
    `projects/_/buckets/BUCKET`. Listing is checked on the bucket, not on object names, so a
    condition on names alone would refuse every listing: the read condition also admits the
    bucket, which lets the nodes list the whole bucket's object names (never read an object
    outside PREFIX/, which is checked on the object). That is the choice made here, over the
    request attribute for a listing's prefix, which this generator cannot check is honoured in
    allow policies: a node that cannot list cannot find its checkpoints. Keep objects whose
    names the nodes must not see in another bucket."""
    under = f"projects/_/buckets/{bucket}/objects/{prefix}/" if prefix else f"projects/_/buckets/{bucket}/objects/"
    where = f"gs://{bucket}/{prefix + '/' if prefix else ''}"
    return {
        GCS_READ[0]: {
            "title": "grpo-run nodes: read the jobs",
            "description": f"Get objects under {where} (the jobs and {DIST_PREFIX}/); list the bucket",
            "expression": f'resource.name == "projects/_/buckets/{bucket}" || resource.name.startsWith("{under}")',
        },
        GCS_WRITE[0]: {
            "title": "grpo-run nodes: write the jobs",
            "description": f"Create, replace and delete objects under {where}, never under {where}{DIST_PREFIX}/",
            "expression": f'resource.name.startsWith("{under}") && !resource.name.startsWith("{under}{DIST_PREFIX}/")',
        },
    }


def gcs_grant(bucket: str, prefix: str) -> str:
    """A POSIX shell script of the gcloud commands that let the nodes' principal (NODES, set when
    it runs) work on gs://BUCKET/PREFIX: create or update the two custom roles in PROJECT, then
    bind each on the bucket with its condition (gcs_conditions)."""
    where = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"
    conditions = gcs_conditions(bucket, prefix)
    files = "".join(
        f"cat > \"$conditions/{role}.yaml\" <<'CONDITION'\n"
        f"{yaml.safe_dump(conditions[role], sort_keys=False, width=1000)}CONDITION\n"
        for role, _, _ in (GCS_READ, GCS_WRITE))
    roles = "".join(f"role {role} '{title}' {','.join(permissions)}\n" for role, title, permissions in (GCS_READ, GCS_WRITE))
    binds = "".join(
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --member=\"$NODES\" \\\n"
        f"    --role=\"projects/$PROJECT/roles/{role}\" --condition-from-file=\"$conditions/{role}.yaml\"\n"
        for role, _, _ in (GCS_READ, GCS_WRITE))
    return f"""#!/bin/sh
# grpo-run deploy iam --storage {where}: what the nodes' service account may do on Google Cloud
# Storage, as the gcloud commands that grant it. Read and list everything under {where}/ (the
# jobs, and {DIST_PREFIX}/, the wheel every new node installs); create, replace and delete objects
# under it except under {DIST_PREFIX}/; nothing else in the bucket, no bucket-level changes.
#
# Review it, then run it where gcloud is signed in as someone who may create roles in PROJECT and
# set the bucket's IAM policy (IAM conditions need the bucket's uniform bucket-level access):
#   grpo-run deploy iam --storage {where} > grant-nodes.sh
#   PROJECT=my-project NODES=serviceAccount:NAME@my-project.iam.gserviceaccount.com sh grant-nodes.sh
# NODES is the principal of the nodes: a VM's service account, or GKE's workload identity.
#
# Two custom roles, each bound on the bucket with an IAM condition on the object's name:
#   {GCS_READ[0]}  {', '.join(GCS_READ[2])}: under {where}/, and the bucket itself
#   {GCS_WRITE[0]} {', '.join(GCS_WRITE[2])}: under {where}/ but not {DIST_PREFIX}/
# Replacing an object needs storage.objects.delete as well as create, so the write role has both.
# Listing is checked on the bucket, not on object names: the read condition admits the bucket,
# which lets the nodes list every object name in it (never read one outside {where}/). Keep
# objects whose names the nodes must not see in another bucket.
# Spot notices need no role: a node reads them from its own metadata server.
set -eu
: "${{PROJECT:?set PROJECT to the id of the project the roles are made in (the bucket's)}}"
: "${{NODES:?set NODES to the nodes principal, e.g. serviceAccount:NAME@PROJECT.iam.gserviceaccount.com}}"
conditions=$(mktemp -d)
trap 'rm -rf "$conditions"' EXIT
{files}
role() {{  # ROLE_ID TITLE PERMISSIONS: made in PROJECT, or set to exactly these permissions
  if gcloud iam roles describe "$1" --project="$PROJECT" >/dev/null 2>&1; then
    gcloud iam roles update "$1" --project="$PROJECT" --permissions="$3" --quiet
  else
    gcloud iam roles create "$1" --project="$PROJECT" --title="$2" --permissions="$3" --stage=GA
  fi
}}
{roles}{binds}"""


# --- Azure Blob Storage ---------------------------------------------------------------------------

AZ_ROLE = "grpo-run node (blob data)"
_BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
# Data actions only (no Actions: nothing on the account or the container themselves): read covers
# reading a blob and its properties and listing blobs (suboperation Blob.List); write, add/action
# (create a blob) and delete are the writes; a conditional write (If-Match, If-None-Match) is a write.
AZ_DATA_ACTIONS = (f"{_BLOBS}/read", f"{_BLOBS}/write", f"{_BLOBS}/add/action", f"{_BLOBS}/delete")


def azure_condition(prefix: str) -> str:
    """The role assignment's condition (version 2.0): reads only under PREFIX/ (the blob's path),
    listings only of a prefix inside it (a listing has no blob path: its request's prefix is
    checked), writes, creates and deletes only under PREFIX/ and never under PREFIX/_dist/.
    Every data action the role has is named: an action a condition does not name is allowed
    unconditionally."""
    path = f"@Resource[{_BLOBS}:path]"
    listed = f"@Request[{_BLOBS}:prefix]"
    if prefix:
        reads = f"{path} StringStartsWith '{prefix}/'"
        lists = f"{listed} StringStartsWith '{prefix}/' OR {listed} StringEquals '{prefix}'"
        writes = (f"{path} StringStartsWith '{prefix}/' AND "
                  f"{path} StringNotStartsWith '{prefix}/{DIST_PREFIX}/'")
    else:                                   # the whole container is the jobs' storage
        reads = lists = None
        writes = f"{path} StringNotStartsWith '{DIST_PREFIX}/'"
    blocks = []
    if reads:
        blocks.append((f"!(ActionMatches{{'{_BLOBS}/read'}} AND NOT SubOperationMatches{{'Blob.List'}})", reads))
        blocks.append((f"!(ActionMatches{{'{_BLOBS}/read'}} AND SubOperationMatches{{'Blob.List'}})", lists))
    blocks.append((f"!(ActionMatches{{'{_BLOBS}/write'}}) AND !(ActionMatches{{'{_BLOBS}/add/action'}}) "
                   f"AND !(ActionMatches{{'{_BLOBS}/delete'}})", writes))
    return " AND ".join(f"(({actions}) OR ({test}))" for actions, test in blocks)


def azure_role(assignable_scope: str) -> dict:
    """The custom role's definition, for `az role definition create`."""
    return {"Name": AZ_ROLE, "IsCustom": True,
            "Description": "grpo-run nodes: read, write and delete blobs (conditions on the assignment narrow it)",
            "Actions": [], "NotActions": [], "DataActions": list(AZ_DATA_ACTIONS), "NotDataActions": [],
            "AssignableScopes": [assignable_scope]}


def azure_grant(account: str, container: str, prefix: str) -> str:
    """A POSIX shell script of the az commands that let the nodes' managed identity (NODES, its
    principal id, set when it runs) work on az://CONTAINER/PREFIX in `account`: create the custom
    data role (azure_role) where it is missing, then assign it on the container with the
    condition (azure_condition)."""
    where = f"az://{container}/{prefix}" if prefix else f"az://{container}"
    role = json.dumps(azure_role("SUBSCRIPTION"), indent=2).replace('"SUBSCRIPTION"', '"$subscription"')
    return f"""#!/bin/sh
# grpo-run deploy iam --storage {where} --account {account}: what the nodes' managed identity may
# do in Azure Blob Storage, as the az commands that grant it. Read and list everything under
# {where}/ (the jobs, and {DIST_PREFIX}/, the wheel every new node installs); write and delete
# blobs under it except under {DIST_PREFIX}/; nothing else, nothing on the account or the container.
#
# Review it, then run it where az is signed in as someone who may create roles and assign them on
# the storage account (Owner, or User Access Administrator):
#   grpo-run deploy iam --storage {where} --account {account} > grant-nodes.sh
#   NODES=$(az identity show --name NAME --resource-group GROUP --query principalId --output tsv) sh grant-nodes.sh
# NODES is the principal (object) id of the nodes' managed identity: a VM's, a scale set's, or
# AKS workload identity's. The nodes then need AZURE_STORAGE_ACCOUNT={account} (grpo-run deploy
# --account {account} writes it into their launch files).
#
# A custom role with the blob data actions read, write, add/action and delete, and nothing else;
# assigned on the container with a condition on the blob's path (reads and writes) and on a
# listing's prefix (a listing has no blob path). A new role can take a minute to be seen: if the
# assignment says the role does not exist, run this again.
# Spot notices need no role: Azure's Scheduled Events come from the instance metadata service.
set -eu
: "${{NODES:?set NODES to the principal id of the nodes managed identity (az identity show ... --query principalId)}}"
account=$(az storage account show --name {account} --query id --output tsv)
subscription=$(printf '%s\\n' "$account" | cut -d/ -f1-3)
role='{AZ_ROLE}'
if [ -z "$(az role definition list --name "$role" --query '[].id' --output tsv)" ]; then
  az role definition create --role-definition "$(cat <<JSON
{role}
JSON
)"
fi
az role assignment create --assignee-object-id "$NODES" --assignee-principal-type ServicePrincipal \\
    --role "$role" --scope "$account/blobServices/default/containers/{container}" \\
    --condition-version 2.0 --condition "$(cat <<'CONDITION'
{azure_condition(prefix)}
CONDITION
)"
"""
