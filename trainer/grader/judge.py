"""An LLM judge over HTTP: each completion goes to an OpenAI-compatible chat completions endpoint
(`POST {url}/chat/completions`) from the trainer's process, never from user code (the reward
sandbox stays closed), and the first number of the reply is the reward.

    judge = Judge("quality", settings, calls=0, usd=0.0)   # what earlier attempts of the run made and spent
    judge.score(completions, tasks)               # one answered call per completion, `concurrency` at a time
    judge.calls, judge.usd                        # the run's answered calls and their price so far

The message is the job's prompt with `{prompt}` replaced by the task's prompt (chat messages:
their contents, one per line) and `{completion}` by the completion; one user message, temperature
0. The reward is the first number in the reply's text (7, -2, 8.5), clipped to [low, high].

An answered call costs `usd_per_call` plus its reply's `usage` (prompt_tokens, completion_tokens)
at `usd_per_mtok`; a judge priced per token whose server replies without usage cannot be priced,
and fails the run (JudgeError) rather than count the call as free.

A call the server does not answer (refused connection, timeout, HTTP 408, 429 or 5xx) is tried
again, up to `retries` more times with exponential waits, then raises JudgeUnavailable: an
infrastructure failure, never a score. Everything else raises JudgeError at once (a refusal such
as HTTP 401, a reply without a number, the call budget spent): the same call would fail again.

Never imported by the grader's worker.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from grpo_run.trainer.envs.catalog import JudgeSettings
from grpo_run.trainer.grader.redact import scrub

PLACEHOLDER = re.compile(r"\{prompt\}|\{completion\}")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)
REPLY_SHOWN = 200                 # characters of a reply quoted in an error


class JudgeError(RuntimeError):
    """The judge cannot score (refused, replied without a number, call budget spent, key unset):
    the run fails, naming the judge; trying again would fail the same way."""


class JudgeUnavailable(RuntimeError):
    """The judge's server did not answer on any try: an infrastructure failure, never a score."""


class _NoAnswer(Exception):
    """One try the server did not answer (retried)."""


class Judge:
    """Owns the settings and the run's count of answered calls of one judge reward. Raises
    JudgeError when `api_key_env` names a variable this process does not have."""

    def __init__(self, name: str, settings: JudgeSettings, *, calls: int = 0, usd: float = 0.0,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.name, self.settings, self.calls, self.usd = name, settings, calls, usd
        self._sleep = sleep               # tenacity's own (time.sleep) when None; tests pass their own
        self._lock = threading.Lock()
        self._key = None
        if settings.api_key_env is not None:
            self._key = os.environ.get(settings.api_key_env)
            if not self._key:
                raise JudgeError(f"judge {name!r}: apiKeyEnv {settings.api_key_env} is not set in this node's "
                                 "environment: set it where grpo-run runs (the key never goes in the job)")

    @property
    def priced(self) -> bool:
        """Whether its calls have a price (usd_per_call or usd_per_mtok set)."""
        return self.settings.usd_per_call is not None or self.settings.usd_per_mtok is not None

    def score(self, completions: Sequence[str], tasks: Sequence[Mapping[str, Any]]) -> list[float]:
        """One answered call per completion, `concurrency` at a time, the scores in the completions'
        order. Raises JudgeError before any call when the
        batch would pass max_calls, JudgeUnavailable, JudgeError (see the module)."""
        limit = self.settings.max_calls
        if limit is not None and self.calls + len(completions) > limit:
            raise JudgeError(f"judge {self.name!r}: maxCalls {limit} reached: {self.calls} calls made, the next "
                             f"{len(completions)} completions need {self.calls + len(completions) - limit} more; "
                             "raise maxCalls and resume")
        jobs = [(c, t, i, len(completions)) for i, (c, t) in enumerate(zip(completions, tasks))]
        if self.settings.concurrency == 1 or len(jobs) < 2:
            return [self._score_one(*job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(jobs)),
                                thread_name_prefix=f"judge-{self.name}") as pool:
            futures = [pool.submit(self._score_one, *job) for job in jobs]
            try:
                return [f.result() for f in futures]
            except BaseException:         # no new call after a failure; those in flight end (answered: counted)
                for f in futures:
                    f.cancel()
                raise

    def _score_one(self, completion: str, task: Mapping[str, Any], index: int, total: int) -> float:
        s = self.settings
        reply = self._ask(judge_message(s.prompt, task, completion))
        text = self._text(reply)
        with self._lock:                  # concurrent calls: one count
            self.calls += 1               # answered: counted even when it cannot be priced (that fails the run)
        usd = self._price(reply)
        with self._lock:
            self.usd += usd
        value = reply_number(text, s.low, s.high)
        if value is None:
            raise JudgeError(f"judge {self.name!r} ({s.model} at {s.url}) replied without a number on completion "
                             f"{index} of {total}: {self._quote(text)!r}; its prompt must ask for a number")
        return value

    def _ask(self, message: str) -> Any:
        """The reply (parsed JSON), the server asked up to 1 + retries times."""
        s = self.settings
        body = json.dumps({"model": s.model, "messages": [{"role": "user", "content": message}],
                           "temperature": 0, **({"max_tokens": s.max_tokens} if s.max_tokens else {})}).encode()
        headers = {"Content-Type": "application/json",
                   **({"Authorization": f"Bearer {self._key}"} if self._key else {})}
        retrying = Retrying(stop=stop_after_attempt(1 + s.retries), wait=wait_exponential(multiplier=0.5, max=8),
                            retry=retry_if_exception_type(_NoAnswer),
                            **({"sleep": self._sleep} if self._sleep else {}))
        try:
            reply = retrying(self._post, body, headers)
        except RetryError as e:
            raise JudgeUnavailable(f"judge {self.name!r} ({s.model} at {s.url}) did not answer on all "
                                   f"{1 + s.retries} tries (retries={s.retries}, timeoutSeconds={s.timeout_s:g}): "
                                   f"{e.last_attempt.exception()}") from None
        return reply

    def _text(self, reply: Any) -> str:
        try:
            return str(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"judge {self.name!r}: {self.settings.url} did not reply as an OpenAI-compatible chat "
                             f"completions endpoint: {self._quote(json.dumps(reply))}") from None

    def _price(self, reply: Any) -> float:
        usd = call_usd(self.settings, reply)
        if usd is None:
            raise JudgeError(f"judge {self.name!r}: {self.settings.url} replied without usage.prompt_tokens and "
                             "usage.completion_tokens, so usdPerMillionTokens cannot price its calls: price them "
                             "with usdPerCall instead")
        return usd

    def _post(self, body: bytes, headers: dict[str, str]) -> Any:
        s = self.settings
        request = urllib.request.Request(s.url.rstrip("/") + "/chat/completions", data=body, headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=s.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            if e.code in RETRIED_STATUS:
                raise _NoAnswer(f"HTTP {e.code}") from None
            raise JudgeError(f"judge {self.name!r}: {s.url} refused the call with HTTP {e.code} "
                             f"{self._quote(e.read().decode(errors='replace'))!r}: check url, model and "
                             "apiKeyEnv") from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as e:
            raise _NoAnswer(str(getattr(e, "reason", e)) or type(e).__name__) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise JudgeError(f"judge {self.name!r}: {s.url} replied with something other than JSON: "
                             f"{self._quote(raw.decode(errors='replace'))!r}") from None

    def _quote(self, text: str) -> str:
        return quoted(text, self._key)

    def close(self) -> None:
        """Nothing to release: no connection is kept between calls."""


def quoted(text: str, key: str | None) -> str:
    """A server's text as an error quotes it (the record keeps it): the key and the node's secrets
    (redact.scrub) replaced, at most REPLY_SHOWN characters."""
    if key:
        text = text.replace(key, "[redacted apiKeyEnv]")
    return scrub(text)[:REPLY_SHOWN]


def call_usd(settings: JudgeSettings, reply: Any) -> float | None:
    """What one answered call cost: usd_per_call, plus the reply's usage (prompt_tokens,
    completion_tokens) at usd_per_mtok; None when it is priced per token and the reply has no usage."""
    usd = settings.usd_per_call or 0.0
    if settings.usd_per_mtok is None:
        return usd
    usage = reply.get("usage") if isinstance(reply, dict) else None
    tokens = [usage.get(k) if isinstance(usage, dict) else None for k in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in tokens):
        return None
    return usd + (tokens[0] * settings.usd_per_mtok[0] + tokens[1] * settings.usd_per_mtok[1]) / 1e6


def judge_message(template: str, task: Mapping[str, Any], completion: str) -> str:
    """The job's prompt with {prompt} and {completion} filled in, in one pass (a placeholder
    inside the task's prompt or the completion stays as written)."""
    fill = {"{prompt}": prompt_text(task.get("prompt", "")), "{completion}": completion}
    return PLACEHOLDER.sub(lambda m: fill[m.group()], template)


def reply_number(text: str, low: float, high: float) -> float | None:
    """The first number in `text` (7, -2, 8.5) clipped to [low, high]; None when it has none. A
    number too long for a float is infinite, and clipped too."""
    found = NUMBER.search(text)
    return None if found is None else min(max(float(found.group()), low), high)


def prompt_text(prompt: Any) -> str:
    """A task's prompt as the judge reads it: the text, or chat messages' contents one per line."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, Mapping))
    return str(prompt)
