"""`judge:` in one of `spec.environment.rewards`: an LLM judge over HTTP (an OpenAI-compatible chat
completions endpoint) called from the trainer's process, and whether this node allows one.

    rewards:
      - judge: {url: http://127.0.0.1:8000/v1, model: Qwen/Qwen3-8B, prompt: "Rate 0-10: {completion}",
                apiKeyEnv: OPENAI_API_KEY, timeoutSeconds: 30, retries: 3, maxCalls: 20000,
                usdPerMillionTokens: {input: 0.15, output: 0.60}}
        name: quality
        weight: 0.5

A judge makes the trainer talk to the network, so a node runs it only with ALLOW_JUDGES_ENV=1
in its own environment, and sends as its key only a variable the node lists in JUDGE_KEYS_ENV; a
job cannot allow itself (on `resume` the job comes from storage).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from grpo_run.trainer.config import Strict, fmt, problem
from grpo_run.trainer.envs.catalog import JudgeSettings

ALLOW_JUDGES_ENV = "GRPO_RUN_ALLOW_JUDGES"   # "1": this node lets a job's judges reach their URLs
# NAME,NAME: the node's variables a judge may send as its key (apiKeyEnv); none unless listed, for a
# stored spec (resume) chooses apiKeyEnv too, and could name AWS_SECRET_ACCESS_KEY or HF_TOKEN
JUDGE_KEYS_ENV = "GRPO_RUN_JUDGE_KEYS"


def allowed_judge_keys() -> set[str]:
    return {name.strip() for name in os.environ.get(JUDGE_KEYS_ENV, "").split(",") if name.strip()}
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TokenPrices(Strict):
    """What the judge's API charges per million tokens, read from each reply's `usage`."""
    input: float = Field(ge=0)          # prompt tokens
    output: float = Field(ge=0)         # completion tokens


class JudgeSpec(Strict):
    """The judge's endpoint, prompt, how its reply becomes a number, and its limits."""
    url: str = Field(min_length=1)      # the API's base, as OpenAI clients take it: https://HOST/v1
    model: str = Field(min_length=1)    # the model name the server knows
    prompt: str = Field(min_length=1)   # {prompt} and {completion} are replaced; ask for a number
    range: tuple[float, float] = (0.0, 10.0)   # the reply's first number is clipped to [low, high]
    apiKeyEnv: str | None = None        # the NAME of the node's variable holding the key, never the key
    timeoutSeconds: float = Field(30.0, gt=0)  # one call's
    retries: int = Field(3, ge=0)       # further tries of a call the server did not answer
    maxCalls: int | None = Field(None, ge=1)   # answered calls the whole run may make
    maxTokens: int | None = Field(None, ge=1)  # the reply's length limit (unset: the server's default)
    concurrency: int = Field(1, ge=1, le=64)   # calls in flight at once (a step's completions, an evaluation batch)
    # The calls' price, for the cost ledger and maxCostUSD (unset: the calls cost nothing there).
    # Both may be given; they add up.
    usdPerCall: float | None = Field(None, ge=0)          # an answered call's price
    usdPerMillionTokens: TokenPrices | None = None        # what a metered API charges (the replies' usage)

    @field_validator("range", mode="before")
    @classmethod
    def _pair(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value       # YAML's [0, 10]

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise problem(f"must be an http:// or https:// URL, the API's base such as https://api.openai.com/v1 "
                          f"(got {fmt(url)})")
        if url.rstrip("/").endswith("/chat/completions"):
            raise problem(f"give the API's base, without /chat/completions (got {fmt(url)})")
        return url

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str) -> str:
        if "{completion}" not in prompt:
            raise problem("must contain {completion} (replaced by the completion to judge; {prompt} by the task's "
                          "prompt) and ask for a number")
        return prompt

    @field_validator("apiKeyEnv")
    @classmethod
    def _key_name(cls, name: str | None) -> str | None:
        if name is not None and not ENV_NAME_RE.match(name):
            raise problem("must be the name of an environment variable such as OPENAI_API_KEY (the key itself "
                          "never goes in the job)")
        return name

    @model_validator(mode="after")
    def _range(self) -> JudgeSpec:
        low, high = self.range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise problem(f"range: must be [low, high] with low < high, both finite (got {list(self.range)})")
        return self

    def settings(self) -> JudgeSettings:
        return JudgeSettings(url=self.url, model=self.model, prompt=self.prompt, low=self.range[0],
                             high=self.range[1], timeout_s=self.timeoutSeconds, retries=self.retries,
                             max_calls=self.maxCalls, max_tokens=self.maxTokens, api_key_env=self.apiKeyEnv,
                             concurrency=self.concurrency, usd_per_call=self.usdPerCall,
                             usd_per_mtok=(None if self.usdPerMillionTokens is None else
                                           (self.usdPerMillionTokens.input, self.usdPerMillionTokens.output)))


def judges_refused(env: Any, processes: int = 1) -> list[str]:
    """Why this node will not run the job's judges ([] when it will): it must allow them
    (ALLOW_JUDGES_ENV=1) and each apiKeyEnv (JUDGE_KEYS_ENV), and a judge's call budget is counted
    by one trainer process."""
    judged = [i for i, r in enumerate(getattr(env, "rewards", ())) if r.judge is not None]
    if not judged:
        return []
    where = f"spec.environment.rewards.{judged[0]}.judge"
    found = []
    if os.environ.get(ALLOW_JUDGES_ENV) != "1":
        found.append(f"{where}: this node does not allow LLM judges (the trainer would call "
                     f"{env.rewards[judged[0]].judge.url}): set {ALLOW_JUDGES_ENV}=1 where grpo-run runs to allow it")
    allowed = allowed_judge_keys()
    for i in judged:
        name = env.rewards[i].judge.apiKeyEnv
        if name is not None and name not in allowed:
            found.append(f"spec.environment.rewards.{i}.judge.apiKeyEnv: this node does not let a judge send its variable "
                         f"{name} (it lets: {', '.join(sorted(allowed)) or 'none'}): add {name} to {JUDGE_KEYS_ENV} "
                         f"(NAME,NAME) where grpo-run runs, and give that variable only the judge's key")
    if processes > 1:
        found.append(f"{where}: a judge runs with one trainer process (got resources.processes {processes}): "
                     "its call budget is counted there")
    return found
