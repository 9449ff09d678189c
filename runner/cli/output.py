"""`grpo-run`'s output helpers, shared by runner.cli and runner.view."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import yaml

# -h as well as --help (as argparse had); help up to 100 columns wide, as the examples are
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
FORMAT = click.Choice(["yaml", "json"])


def dump(doc: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2)
    return yaml.safe_dump(doc, sort_keys=False)


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
