"""`grpo-run`'s output helpers, shared by runner.cli and runner.view."""

from __future__ import annotations

import json
import sys
import unicodedata
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


def printable(text: Any) -> str:
    """`text` as it may reach a terminal when storage (or a reward) wrote it: every control or
    format character (ESC and the rest of ANSI's sequences, CR, newlines, backspace, Unicode's
    direction overrides) shown as its escape, so the line cannot rewrite the screen, fake
    another line or hide what follows. Use it wherever text from a job's storage is printed:
    a lease holder, a job's or an attempt's message, a node or job name from a record."""
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN else c for c in str(text))


_HIDDEN = ("Cc", "Cf", "Cs", "Zl", "Zp")     # controls, format (bidi), lone surrogates, line/paragraph separators


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def job_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for a NAME on the command line: the rule metadata.name follows (it becomes
    a folder in storage and on the node, and a word in generated launch files)."""
    from grpo_run.runner.spec.job import name_problem

    trouble = None if value is None else name_problem(value)
    if trouble:
        raise click.BadParameter(trouble)
    return value
