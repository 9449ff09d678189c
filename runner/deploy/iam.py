"""The AWS IAM policy a job's nodes need (`grpo-run deploy iam`): read, write, list and delete under
the job's storage prefix, nothing else, and never a write under its _dist/ (the wheel nodes install)."""

from __future__ import annotations

import json
from urllib.parse import urlparse

from grpo_run.runner.deploy.wheel import DIST_PREFIX


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
