"""Text that leaves the grader's sandbox, scrubbed of the trainer's secrets and capped.

Everything the worker sends back is written by the reward function or can be: its exception's
message and traceback, what it prints, faulthandler's crash dumps. That text goes into
RewardFunctionError, which the trainer puts into its failed event, the supervisor into the run's
record, and the record goes up to the bucket; and into the logs. So, in the parent:
  * every value (8 characters or more) of the trainer's secret-looking environment variables
    (`secret_names`) is replaced by `[redacted NAME]`;
  * the text is cut to _MAX_TEXT_CHARS (its head and its tail, saying how much went).

This is a second line. The worker starts without these variables and cannot read the files or
processes that hold them (`sandbox`); a reward function that gets hold of a secret some other way
can encode it past any scrubbing. Scrubbing catches the honest leak: a library's error message that
quotes a token, an environment dump in a crash report.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

# A traceback of a dozen frames, or a chained one of two: enough to find the bug, small enough for
# a phase message in the record and one log line.
_MAX_TEXT_CHARS = 4_000
_MIN_SECRET_CHARS = 8  # shorter values ("1", "true", "us-east") would redact ordinary words
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|^AWS_|^HF_TOKEN$|^WANDB_API_KEY$"
                          r"|^MLFLOW_TRACKING_(TOKEN|PASSWORD|USERNAME)$", re.IGNORECASE)


def secret_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, value) of the secret-looking variables in `environ` (default os.environ) whose value
    is long enough to scrub, longest value first (so a secret that contains another goes whole)."""
    env = os.environ if environ is None else environ
    found = [(name, value) for name, value in env.items()
             if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_CHARS]
    return sorted(found, key=lambda item: (-len(item[1]), item[0]))


def scrub(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value replaced by `[redacted NAME]`."""
    for name, value in secret_names(environ):
        if value in text:
            text = text.replace(value, f"[redacted ${name}]")
    return text


def cap(text: str, limit: int = _MAX_TEXT_CHARS) -> str:
    """`text` if it is short enough, else its head and tail around a line saying how much was cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return (f"{text[:half]}\n[... {len(text) - 2 * half:,} characters cut: text from the reward function's "
            f"sandbox is capped at {limit:,} ...]\n{text[-half:]}")


def clean(text: str) -> str:
    """Scrubbed, then capped (so the cut cannot leave half a secret behind)."""
    return cap(scrub(text))


class StreamScrubber:
    """Scrubs a byte stream (the worker's stdout and stderr) that arrives in arbitrary chunks: a
    secret split across two chunks is caught by holding back, until the next chunk, what follows the
    last newline, up to one byte less than the longest secret. Whole lines pass at once."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._secrets = [(value.encode(errors="surrogateescape"), f"[redacted ${name}]".encode())
                         for name, value in secret_names(environ)]
        self._hold = max((len(value) for value, _ in self._secrets), default=1) - 1
        self._multiline = any(b"\n" in value for value, _ in self._secrets)  # then lines do not bound them
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """What can be passed on now, scrubbed."""
        data = self._replace(self._buffer + chunk)
        tail = len(data) - (data.rfind(b"\n") + 1)
        keep = min(len(data), self._hold if self._multiline else min(tail, self._hold))
        self._buffer = data[len(data) - keep:] if keep else b""
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        """The rest, at the end of the stream."""
        data, self._buffer = self._replace(self._buffer), b""
        return data

    def _replace(self, data: bytes) -> bytes:
        for value, marker in self._secrets:
            data = data.replace(value, marker)
        return data
