"""Text that leaves the grader's sandbox, scrubbed of the trainer's secrets and capped.

Everything the worker sends back is written by the reward function or can be: its exception's
message and traceback, what it prints, faulthandler's crash dumps. That text goes into
RewardFunctionError, which the trainer puts into its failed event, the supervisor into the run's
record, and the record goes up to the bucket; and into the logs. So, in the parent:
  * every value (8 characters or more) of the trainer's secret-looking environment variables
    (`secret_names`) is replaced by `[redacted $NAME]`;
  * so is every secret found in the node's credential files (`file_secrets`): the AWS shared
    credentials and config files, the Hugging Face token files, Google's application-default
    and GOOGLE_APPLICATION_CREDENTIALS files, ~/.netrc and ~/.git-credentials, the web-identity
    token files a role names (AWS_WEB_IDENTITY_TOKEN_FILE, AZURE_FEDERATED_TOKEN_FILE) and the
    mounted service-account tokens (/var/run/secrets/**/token): replaced by `[redacted FILE]`;
  * so is every Azure account key and SAS signature, by its shape (`AccountKey=`, `sig=`...);
  * error text is cut to _MAX_TEXT_CHARS (its head and its tail, saying how much went): `cap`, which
    the grader applies to a failure's text and the crash log only; an episode's prompt or
    observation is scrubbed, never cut (the episode loop bounds it in tokens).

This is a second line. The worker starts without these variables and cannot read the files or
processes that hold them (`sandbox`); a reward function that gets hold of a secret some other way
can encode it past any scrubbing. Scrubbing catches the honest leak (a library's error message that
quotes a token, an environment dump in a crash report) and the plain copy of a file the sandbox
should have kept out of reach. Other files (a job's plan with its evaluation answers) are not
scrubbed: the sandbox alone keeps them out of reach (`reach`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterator, Mapping

# A traceback of a dozen frames, or a chained one of two: enough to find the bug, small enough for
# a phase message in the record and one log line.
_MAX_TEXT_CHARS = 4_000
_MIN_SECRET_CHARS = 8  # shorter values ("1", "true", "us-east") would redact ordinary words
# CONNECTION_STRING and SAS: Azure's AZURE_STORAGE_CONNECTION_STRING holds `AccountKey=` and its SAS
# variables a signature, and neither name says KEY or TOKEN.
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|CONNECTION_?STRING|CONN_?STR|(^|_)SAS(_|$)"
                          r"|^AWS_|^HF_TOKEN$|^WANDB_API_KEY$|^MLFLOW_TRACKING_(TOKEN|PASSWORD|USERNAME)$",
                          re.IGNORECASE)
# The secret parts of an Azure connection string (`AccountKey=...;`, `SharedAccessSignature=...`) and
# of a SAS token or a URL that carries one (`sig=...`), found by their shape wherever they appear: an
# error may quote the key alone, or a URL signed with a SAS the node never had in a variable.
_AZURE_SECRETS = (
    re.compile(r"(?P<name>SharedAccessSignature)=(?P<value>[^;\s\"'<>]{8,2048})", re.IGNORECASE),  # sv=..&sig=..
    re.compile(r"(?P<name>AccountKey|SharedAccessKey|(?<![\w-])sig)=(?P<value>[^;&\s\"'<>]{8,2048})", re.IGNORECASE),
)


def secret_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, value) of the secrets to scrub, longest value first (so a secret that contains
    another goes whole): the secret-looking variables of `environ` (default os.environ) whose value
    is long enough, labelled $NAME, and the secrets in the node's credential files
    (`file_secrets`), labelled by the file."""
    env = os.environ if environ is None else environ
    found = [(f"${name}", value) for name, value in env.items()
             if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_CHARS]
    found += file_secrets(env)
    # a connection string's key (or a SAS token's signature) alone, as an error may quote it
    found += [(label, match.group("value")) for label, value in list(found)
              for pattern in _AZURE_SECRETS for match in pattern.finditer(value)]
    return sorted(set(found), key=lambda item: (-len(item[1]), item[0]))


def credential_files(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where this node keeps credentials in files, as the tools that write them look for them."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    hf_home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "huggingface")
    gcloud = env.get("CLOUDSDK_CONFIG") or os.path.join(home, ".config", "gcloud")
    paths = [
        env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
        env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
        env.get("HF_TOKEN_PATH") or os.path.join(hf_home, "token"),
        os.path.join(hf_home, "stored_tokens"),
        os.path.join(gcloud, "application_default_credentials.json"),
        os.path.join(gcloud, "credentials.db"),
        os.path.join(home, ".netrc"),
        os.path.join(home, ".git-credentials"),
        *(env.get(name, "") for name in ("GOOGLE_APPLICATION_CREDENTIALS", "AWS_WEB_IDENTITY_TOKEN_FILE",
                                         "AZURE_FEDERATED_TOKEN_FILE", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")),
        *glob.glob("/var/run/secrets/**/token", recursive=True),
        *glob.glob("/run/secrets/**/token", recursive=True),
    ]
    return list(dict.fromkeys(p for p in paths if p))


_MAX_CREDENTIAL_FILE_BYTES = 1 << 20
_file_cache: dict[tuple, list[tuple[str, str]]] = {}


def file_secrets(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(file, secret) for every secret in the node's credential files (`credential_files`): a JSON
    file's secret-looking fields, an INI or netrc file's secret-looking values, a token file's whole
    text. Read again only when a file changed (its size or time)."""
    stamp = []
    for path in credential_files(environ):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_size <= _MAX_CREDENTIAL_FILE_BYTES and os.path.isfile(path):
            stamp.append((path, st.st_mtime_ns, st.st_size))
    key = tuple(stamp)
    if key not in _file_cache:
        found = []
        for path, _, _ in stamp:
            try:
                with open(path, "rb") as f:
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            found += [(path, value) for value in _secrets_in(text) if len(value) >= _MIN_SECRET_CHARS]
        _file_cache.clear()
        _file_cache[key] = found
    return _file_cache[key]


_ASSIGNMENT = re.compile(r"^\s*([\w.-]+)\s*[=:]\s*(.+?)\s*$")
_JSON_SECRET = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)


def _secrets_in(text: str) -> Iterator[str]:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if data is not None:
        yield from _json_secrets(data, "")
        return
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("#", ";", "["))]
    if len(lines) == 1 and len(lines[0].split()) == 1 and not _ASSIGNMENT.match(lines[0]):
        yield lines[0].strip()                  # a token file: the whole of it
        return
    for line in lines:
        match = _ASSIGNMENT.match(line)
        if match and _SECRET_NAME.search(match.group(1)):
            yield match.group(2).strip("'\"")
        words = line.split()
        for word, value in zip(words, words[1:]):      # netrc: machine M login L password P
            if word == "password":
                yield value
        if "://" in line and "@" in line:               # git-credentials: https://user:token@host
            yield line.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[-1]


def _json_secrets(data: object, key: str) -> Iterator[str]:
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _json_secrets(v, str(k))
    elif isinstance(data, list):
        for v in data:
            yield from _json_secrets(v, key)
    elif isinstance(data, str) and _JSON_SECRET.search(key):
        yield data
        yield from (line for line in data.splitlines() if len(line) >= _MIN_SECRET_CHARS)   # a PEM key's lines


def scrub(text: str, environ: Mapping[str, str] | None = None,
          secrets: list[tuple[str, str]] | None = None) -> str:
    """`text` with every secret value replaced by `[redacted LABEL]`, and every Azure account key and
    SAS signature (`AccountKey=...`, `sig=...`) by `[redacted]`. `secrets`: `secret_names(environ)`,
    when the caller scrubs many texts at once (it costs a glob and a dozen stat calls)."""
    for label, value in secret_names(environ) if secrets is None else secrets:
        if value in text:
            text = text.replace(value, f"[redacted {label}]")
    if "=" in text:
        for pattern in _AZURE_SECRETS:
            text = pattern.sub(lambda m: f"{m.group('name')}=[redacted]", text)
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
        self._secrets = [(value.encode(errors="surrogateescape"), f"[redacted {label}]".encode())
                         for label, value in secret_names(environ)]
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
