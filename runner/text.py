"""What a user is shown, at the bottom of runner/: one-line errors, and text from storage made safe
for a terminal. Every module that prints imports these from here (the commands, the views, the
queue, the preflight), so none of them needs the commands' own module."""

from __future__ import annotations

import json
import sys
import unicodedata
from typing import Any


def error(message: str) -> None:
    """`error: MESSAGE` on stderr: the one line a refusal or a failure gets."""
    print(f"error: {message}", file=sys.stderr)


def dump(doc: Any, fmt: str) -> str:
    """A job (or any document) as `-o yaml|json` prints it."""
    if fmt == "json":
        return json.dumps(doc, indent=2)
    import yaml

    return yaml.safe_dump(doc, sort_keys=False)


def printable(text: Any) -> str:
    """`text` as it may reach a terminal when storage (or a reward) wrote it: every control or
    format character (ESC and the rest of ANSI's sequences, CR, newlines, backspace, Unicode's
    direction overrides) shown as its escape, so the line cannot rewrite the screen, fake
    another line or hide what follows. Use it wherever text from a job's storage is printed:
    a lease holder, a job's or an attempt's message, a node or job name from a record."""
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN else c for c in str(text))


def printable_lines(text: Any, indent: str = "    ") -> str:
    """`text` with its own line breaks kept (a traceback reads as one), every other control
    character escaped as printable() does, and each line after the first indented by `indent`:
    a line the text brings cannot pass for one of grpo-run's own."""
    return f"\n{indent}".join(printable(line) for line in str(text).rstrip("\n").split("\n"))


_HIDDEN = ("Cc", "Cf", "Cs", "Zl", "Zp")     # controls, format (bidi), lone surrogates, line/paragraph separators


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
