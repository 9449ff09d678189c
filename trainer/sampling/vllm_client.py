"""The trainer's side of a vLLM server (trainer.sampling.vllm_server): a Sampler like the colocated
engine, over HTTP/JSON.

The client (VllmServerSampler) is a Sampler like the colocated engine. A server that does not
answer, answers an error (a 409 the trainer did not ask for included), answers completions that
are not the ones asked for (their count, a token outside the vocabulary, more than max_tokens), or
takes longer than `vllm.serverTimeoutSeconds` raises EngineUnavailable: an infrastructure failure
(the attempt ends and the supervisor's restart policy takes it), never a score. A server of
another model, or one that refuses this node's token, raises EngineRefused. A stop request while
it samples sends /abort and raises GenerationInterrupted at once.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import math
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo_run.trainer.sampling.engines import EngineRefused, EngineUnavailable, SampleSettings
from grpo_run.trainer.sampling.vllm_server import TOKEN_ENV, node_token, served_name

log = logging.getLogger(__name__)

POLL_S = 0.05                 # how often the client asks the stop request while the server samples
# How long a trainer starting waits for its server to answer /health: one started at the same time
# (a launcher starting both), or one its operator is bringing back after it died, is waited for.
SERVER_START_WAIT_S = 120.0


class VllmServerSampler:
    """The trainer's side: a Sampler whose engine is a vLLM server (`url`), serving `model`."""
    engine = "vllm"

    def __init__(self, url: str, settings: SampleSettings, *, model: str, method: str, lora_rank: int,
                 timeout_s: float, pad_id: int, work: Path) -> None:
        from transformers import AutoConfig

        self.url, self.method, self.timeout_s = url.rstrip("/"), method, timeout_s
        self.pad_id, self.work, self.settings = pad_id, Path(work), settings
        self.token = node_token()
        self.run = uuid.uuid4().hex             # this trainer's: its adapter and its aborts on the server
        self.sha256: str | None = None          # of the adapter (or weights) last sent; None: the base
        # the ids a reply may hold: the model's embedding rows (the tokenizer may have fewer)
        self.vocab_size = int(AutoConfig.from_pretrained(model).get_text_config().vocab_size)
        t0 = time.perf_counter()
        health = self._health()
        self.version = health.get("version", "")
        if health.get("model") != served_name(model):
            raise EngineRefused(f"spec.parameters.vllm.server: the vLLM server at {self.url} serves "
                                f"{health.get('model')!r}, and this job's model is {served_name(model)!r}: point the "
                                f"job at a server of its model, or start one with `grpo-run vllm-server --model "
                                f"{served_name(model)}`")
        if health.get("method") != method:
            raise EngineRefused(f"spec.parameters.vllm.server: the vLLM server at {self.url} serves method "
                                f"{health.get('method')}, and this job trains {method}: start it with --method {method}")
        if method == "LoRA" and lora_rank > int(health.get("maxLoraRank") or 0):
            raise EngineRefused(f"spec.parameters.vllm.server: the vLLM server at {self.url} serves LoRA ranks up to "
                                f"{health.get('maxLoraRank')}, and this job's lora.r is {lora_rank}: start it with "
                                f"--max-lora-rank {lora_rank} or more")
        if health.get("token") and not self.token:
            raise EngineRefused(f"the vLLM server at {self.url} asks for a token, and {TOKEN_ENV} is not set on this "
                                f"node: set it to the server's token")
        self.start_seconds = time.perf_counter() - t0       # the server's own start-up is not this trainer's

    def _health(self) -> dict[str, Any]:
        """The server's /health, waiting up to SERVER_START_WAIT_S for it to answer."""
        deadline = time.monotonic() + SERVER_START_WAIT_S
        while True:
            try:
                health = json.loads(self._call("GET", "/health", timeout=10))
                if not isinstance(health, dict):
                    raise ValueError("not an object")
                return health
            except ValueError as e:
                raise EngineUnavailable(f"the vLLM server at {self.url} answered /health with no JSON object "
                                        f"({e})") from None
            except EngineUnavailable as e:
                if time.monotonic() >= deadline:
                    raise EngineUnavailable(f"{e} (waited {SERVER_START_WAIT_S:.0f} s)") from None
                log.warning("waiting for the vLLM server: %s", e)
                time.sleep(2.0)

    def _call(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
              timeout: float | None = None) -> bytes:
        headers = {**(headers or {}), **({"Authorization": f"Bearer {self.token}"} if self.token else {})}
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code in (401, 403):            # restarting cannot help: the node's token must change
                raise EngineRefused(f"the vLLM server at {self.url} refused {path} ({e.code}: {detail}): set "
                                    f"{TOKEN_ENV} on this node to the server's token") from None
            # a 409 here is never a stop this trainer asked for (it stops without waiting for the
            # answer): the server lost the run's adapter, or someone else aborted it
            raise EngineUnavailable(f"the vLLM server at {self.url} answered {path} with {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:        # refused, reset, timed out
            reason = getattr(e, "reason", e)
            raise EngineUnavailable(f"the vLLM server at {self.url} did not answer {path} ({reason}); is "
                                    f"`grpo-run vllm-server` running there?") from None

    def _send(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        sha = hashlib.sha256(body).hexdigest()
        reply = self._call("POST", path, body, {**headers, "X-Run": self.run, "Content-Type": "application/octet-stream"})
        try:
            theirs = json.loads(reply).get("sha256")
        except (ValueError, AttributeError):
            theirs = None
        if theirs != sha:
            raise EngineUnavailable(f"the vLLM server at {self.url} answered {path} with sha256 {theirs}, not "
                                    f"{sha}: it did not receive what was sent")
        self.sha256 = sha

    def load_policy(self, model) -> float:
        t0 = time.perf_counter()
        if self.method == "LoRA":
            folder = self.work / "vllm-adapter"
            if folder.exists():
                shutil.rmtree(folder)
            model.save_pretrained(str(folder), save_embedding_layers=False)
            config = base64.b64encode((folder / "adapter_config.json").read_bytes()).decode()
            self._send("/adapter", (folder / "adapter_model.safetensors").read_bytes(), {"X-Adapter-Config": config})
        else:
            from safetensors.torch import save

            state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
            self._send("/weights", save(state), {})
        return time.perf_counter() - t0

    def sample(self, prompt_ids, prompt_mask, seeds: Sequence[int], *, temperature: float,
               should_stop: Callable[[], bool]):
        from grpo_run.trainer.sampling.sampler import GenerationInterrupted
        from grpo_run.trainer.sampling.vllm_engine import completions

        prompts = [prompt_ids[row][prompt_mask[row].bool()].tolist() for row in range(prompt_ids.size(0))]
        body = json.dumps({"run": self.run, "sha256": self.sha256, "prompts": prompts, "seeds": list(seeds),
                           "settings": dataclasses.asdict(self.settings.at(temperature))}).encode()
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                answer["body"] = self._call("POST", "/sample", body, {"Content-Type": "application/json"})
            except BaseException as e:          # noqa: BLE001 (handed to the caller's thread)
                answer["error"] = e

        worker = threading.Thread(target=call, name="vllm-server-sample", daemon=True)
        worker.start()
        while worker.is_alive():
            if should_stop():                     # a notice: the server aborts, nobody waits for the draws
                try:
                    self._call("POST", "/abort", json.dumps({"run": self.run}).encode(),
                               {"Content-Type": "application/json"}, timeout=5)
                except (EngineUnavailable, EngineRefused):
                    pass                          # stopping anyway
                raise GenerationInterrupted()
            worker.join(POLL_S)
        if "error" in answer:
            raise answer["error"]
        outs = self._drawn(answer["body"], len(prompts))
        return completions(outs, self.pad_id, prompt_ids.device)

    def _drawn(self, body: bytes, rows: int) -> list:
        """The reply's completions, each checked: one per prompt, token ids of the model's
        vocabulary, at most max_tokens of them, a finite log-probability per token (or none).
        Raises EngineUnavailable for any other reply (never trained on)."""
        from grpo_run.trainer.sampling.vllm_engine import Drawn

        def bad(why: str) -> EngineUnavailable:
            return EngineUnavailable(f"the vLLM server at {self.url} answered /sample with {why}: not the "
                                     f"completions asked for")
        try:
            got = json.loads(body)["completions"]
        except (ValueError, KeyError, TypeError):
            raise bad("no completions") from None
        if not isinstance(got, list) or len(got) != rows:
            raise bad(f"{len(got) if isinstance(got, list) else 'no list of'} completions for {rows} prompts")
        outs = []
        for i, c in enumerate(got):
            ids, logps, cut = (c.get("tokenIds"), c.get("logprobs"), c.get("truncated")) if isinstance(c, dict) \
                else (None, None, None)
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
                raise bad(f"completion {i}: token ids outside the model's vocabulary (0..{self.vocab_size - 1})")
            if len(ids) > self.settings.max_tokens:
                raise bad(f"completion {i}: {len(ids)} tokens, more than max_tokens ({self.settings.max_tokens})")
            if not isinstance(logps, list) or len(logps) not in (0, len(ids)) or \
                    not all(isinstance(x, (int, float)) and math.isfinite(x) for x in logps):
                raise bad(f"completion {i}: log-probabilities that are not one finite number per token")
            if not isinstance(cut, bool):
                raise bad(f"completion {i}: no truncated flag")
            outs.append(Drawn(ids, [float(x) for x in logps], cut))
        return outs

    def release(self) -> None:
        pass                                      # the server's memory is on its own card

    def status(self) -> dict[str, str | float]:
        return {"engine": self.engine, "version": self.version, "mode": "server",
                "startSeconds": round(self.start_seconds, 2), "server": self.url}

    def close(self) -> None:
        pass                                      # the server is its operator's


