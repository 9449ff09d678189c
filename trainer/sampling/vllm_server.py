"""vLLM as a server: the engine in a process of its own, on another GPU or node (TRL's server mode).

The server (`grpo-run vllm-server --model MODEL`, or `python -m grpo_run.trainer.sampling.vllm_server`)
holds one engine over the base model and answers, on HTTP/JSON:

    GET  /health     {engine, version, model, method, maxLoraRank, token}: open to anyone (no secret in it)
    POST /adapter    a run's LoRA adapter: body adapter_model.safetensors, headers X-Run (the run's id)
                     and X-Adapter-Config (adapter_config.json, base64) -> {loaded, sha256}
    POST /weights    a run's full fine-tune weights: body a safetensors file of the state dict, header
                     X-Run -> {loaded, sha256}
    POST /sample     {run, sha256, prompts: [[ids]], seeds: [...], settings: {...}} -> {completions:
                     [{tokenIds, logprobs, truncated}]}: the engine's draws with that run's adapter (or
                     weights), seeded per request as colocated; 409 when the server does not hold what
                     the run last sent (sha256: of the adapter's, or the weights', safetensors file)
    POST /abort      {run}: that run's sampling in progress aborted (its /sample answers 409)

Who may call it: with GRPO_RUN_VLLM_TOKEN in the server's environment, every route but /health
asks for `Authorization: Bearer TOKEN` (401 without it, 403 with another); the trainer sends
its node's GRPO_RUN_VLLM_TOKEN. Never from the job file or storage: whoever writes those is not
whoever runs the nodes. Without a token the server listens on a loopback address only.

Each run (one trainer process: a fresh random id each start) has its own adapter, so two jobs on
one server never sample each other's policy, and its own abort. A full fine-tune's weights are
the engine's own: the server samples only for the run that loaded them last. Request bodies are
capped before they are read (Content-Length; 413): an upload at the size of the model's whole
state dict in float32, a /sample at MAX_SAMPLE_BYTES. Adapters and weights travel as
safetensors, never pickle.

The trainer's client for it: trainer.sampling.vllm_client.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from grpo_run.trainer.sampling.engines import SampleSettings

log = logging.getLogger(__name__)

TOKEN_ENV = "GRPO_RUN_VLLM_TOKEN"   # the node's: the server's and the trainer's alike (SPEC §6)
# A /sample's JSON at most: 256 MiB holds some 36 million prompt tokens (about 7 bytes each), far
# past a step's prompts (promptsPerStep x numGenerations rows of the model's context at most).
MAX_SAMPLE_BYTES = 256 << 20
MAX_SMALL_BYTES = 64 << 10    # /abort's {run}
# An upload's header (names, shapes, offsets) besides the tensors' bytes.
UPLOAD_HEADER_BYTES = 64 << 20
# Runs whose adapters the server keeps (the least recently used beyond this is dropped; that run's
# next /sample answers 409 and its attempt restarts, sending its adapter again): a server serves a
# few jobs at once, and each restarted trainer is a new run.
MAX_RUNS_HELD = 8
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def node_token() -> str | None:
    """This node's GRPO_RUN_VLLM_TOKEN (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV, "").strip() or None


def served_name(model: str) -> str:
    """A model as a server reports it and a job compares it: a folder by its absolute path (on
    every node alike: put it at the same path), anything else (a hub id) as written."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def listen_problem(host: str, token: str | None) -> str | None:
    """Why the server may not listen on `host` (None when it may): beyond a loopback address,
    only with a token."""
    if token:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:                           # a host name, or "" (every address)
        loopback = False
    if loopback:
        return None
    return (f"--host {host or '(every address)'}: a vLLM server that other machines can reach needs a token: set "
            f"{TOKEN_ENV} in this server's environment and the same on every trainer node (for example "
            f"`export {TOKEN_ENV}=$(openssl rand -hex 32)`), or listen on 127.0.0.1")


# --- the server -----------------------------------------------------------------------------------

class Refusal(Exception):
    """A request the server answers with `status` and `message` (nothing of it done)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Held:
    """What a run last sent: its adapter's folder (LoRA; None for weights) and the file's sha256."""
    folder: Path | None
    sha256: str


class _Server:
    """The server's one engine (`sampler`: a VllmSampler) and who may sample with what on it.
    /sample calls are served one at a time (the engine is not thread-safe)."""

    def __init__(self, sampler: Any, *, health: dict[str, Any], token: str | None, upload_bytes: int,
                 work: Path) -> None:
        self.engine, self.work = sampler, Path(work)
        self.token = token.encode() if token else None
        self.health = {**health, "token": self.token is not None}
        self.upload_bytes = upload_bytes
        self.method = health["method"]
        self.lock = threading.Lock()             # the engine
        self.books = threading.Lock()            # held and running
        self.held: OrderedDict[str, _Held] = OrderedDict()
        self.weights_of: str | None = None       # Full: the run whose weights the engine holds
        self.running: dict[str, list[threading.Event]] = {}     # run -> the abort of each /sample of it

    def authorized(self, header: str | None) -> None:
        """Raises Refusal (401 without a token, 403 with another) unless the server has none."""
        if self.token is None:
            return
        scheme, _, value = (header or "").strip().partition(" ")
        if not header or scheme.lower() != "bearer":
            raise Refusal(401, f"this server needs `Authorization: Bearer TOKEN` ({TOKEN_ENV})")
        if not hmac.compare_digest(value.strip().encode(), self.token):      # constant time
            raise Refusal(403, f"the token is not this server's ({TOKEN_ENV})")

    def _keep(self, run: str, held: _Held) -> None:
        with self.books:
            old = self.held.pop(run, None)
            self.held[run] = held
            dropped = [old] if old else []
            while len(self.held) > MAX_RUNS_HELD:
                gone, h = self.held.popitem(last=False)
                log.info("run %s: its adapter dropped (the least recently used of %d)", gone, MAX_RUNS_HELD)
                dropped.append(h)
        for h in dropped:
            if h.folder is not None:
                shutil.rmtree(h.folder, ignore_errors=True)

    def adapter(self, run: str, config: bytes, weights: bytes) -> str:
        if self.method != "LoRA":
            raise Refusal(400, "this server serves full fine-tunes (--method Full): send /weights")
        sha = hashlib.sha256(weights).hexdigest()
        folder = self.work / f"adapter-{run}-{time.monotonic_ns()}"   # a new path: vLLM's prefix cache keys on it
        folder.mkdir()
        (folder / "adapter_config.json").write_bytes(config)
        (folder / "adapter_model.safetensors").write_bytes(weights)
        self._keep(run, _Held(folder, sha))
        return sha

    def weights(self, run: str, body: bytes) -> str:
        from safetensors.torch import load

        if self.method != "Full":
            raise Refusal(400, "this server serves LoRA adapters (--method LoRA): send /adapter")
        sha = hashlib.sha256(body).hexdigest()
        tensors = load(body)
        with self.lock:
            self.engine.load_weights(list(tensors.items()))
            self.weights_of = run
        self._keep(run, _Held(None, sha))
        return sha

    def abort(self, run: str) -> None:
        with self.books:
            for event in self.running.get(run, ()):
                event.set()

    def sample(self, request: Any) -> list[dict[str, Any]]:
        run, sha, prompts, seeds, settings = _sample_request(request)
        try:
            settings = SampleSettings(**settings)
        except TypeError as e:
            raise Refusal(400, f"settings: {e}") from None
        aborted = threading.Event()
        with self.books:
            self.running.setdefault(run, []).append(aborted)
        try:
            with self.lock:
                with self.books:
                    held = self.held.get(run)
                    if held is not None:
                        self.held.move_to_end(run)
                if (held.sha256 if held else None) != sha:      # a server restarted, or one that dropped the run
                    holds = "nothing" if held is None else f"sha256 {held.sha256}"
                    raise Refusal(409, f"run {run}: this server holds {holds} for it, not sha256 {sha}")
                if self.method == "Full" and self.weights_of != (None if sha is None else run):
                    raise Refusal(409, f"run {run}: the engine holds weights another run sent")
                if self.method == "LoRA":
                    self.engine.use_adapter(held.folder if held else None)
                outs = self.engine.generate(prompts, seeds, settings, aborted.is_set)
        finally:
            with self.books:
                events = self.running.get(run, [])
                events.remove(aborted)
                if not events:
                    self.running.pop(run, None)
        return [{"tokenIds": o.token_ids, "logprobs": o.logprobs, "truncated": o.truncated} for o in outs]


def _run_id(value: Any) -> str:
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        raise Refusal(400, "run: a run's id (1-64 letters, digits, _ or -) is required")
    return value


def _sample_request(request: Any) -> tuple[str, str | None, list[list[int]], list[int], dict[str, Any]]:
    """/sample's body, checked (Refusal 400 for anything else)."""
    if not isinstance(request, dict):
        raise Refusal(400, "the body must be a JSON object")
    run = _run_id(request.get("run"))
    sha = request.get("sha256")
    prompts, seeds, settings = request.get("prompts"), request.get("seeds"), request.get("settings")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise Refusal(400, "sha256: the hex sha256 of the adapter (or weights) the run sent, or null for the base")
    ints = lambda xs: isinstance(xs, list) and all(type(x) is int for x in xs)       # noqa: E731
    if not (isinstance(prompts, list) and prompts and all(ints(p) and p for p in prompts)):
        raise Refusal(400, "prompts: a non-empty list of non-empty lists of token ids")
    if not (ints(seeds) and seeds and len(prompts) % len(seeds) == 0):
        raise Refusal(400, "seeds: one per equal block of prompts")
    if not isinstance(settings, dict):
        raise Refusal(400, "settings: an object")
    return run, sha, prompts, seeds, settings


def _handler(server: _Server) -> type[BaseHTTPRequestHandler]:
    from grpo_run.trainer.sampling.sampler import GenerationInterrupted

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:       # the engine's own log is enough
            log.debug(fmt, *args)

        def _reply(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self, cap: int) -> bytes:
            """The body, its length checked against `cap` before a byte of it is read."""
            if self.headers.get("Transfer-Encoding"):
                raise Refusal(411, "send the body with a Content-Length (no chunked encoding)")
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise Refusal(411, "a Content-Length is required")
            try:
                n = int(raw)
            except ValueError:
                raise Refusal(400, f"Content-Length {raw[:40]!r} is not a number") from None
            if n < 0:
                raise Refusal(400, "Content-Length is negative")
            if n > cap:
                raise Refusal(413, f"the body is {n} bytes, more than this route takes ({cap})")
            body = self.rfile.read(n)
            self._read = True
            return body

        def do_GET(self) -> None:                                    # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._reply(200, server.health)
                return
            try:
                server.authorized(self.headers.get("Authorization"))
                self._reply(404, {"error": f"no such path: {self.path}"})
            except Refusal as e:
                self._reply(e.status, {"error": str(e)})

        def do_POST(self) -> None:                                   # noqa: N802
            self._read = False
            try:
                server.authorized(self.headers.get("Authorization"))     # before any of the body is read
                if self.path == "/abort":
                    try:
                        request = json.loads(self._body(MAX_SMALL_BYTES))
                    except ValueError:
                        raise Refusal(400, "the body must be JSON: {\"run\": ID}") from None
                    server.abort(_run_id(request.get("run") if isinstance(request, dict) else None))
                    self._reply(200, {"aborted": True})
                elif self.path == "/adapter":
                    run = _run_id(self.headers.get("X-Run"))
                    try:
                        config = base64.b64decode(self.headers.get("X-Adapter-Config", ""), validate=True)
                    except ValueError:
                        raise Refusal(400, "X-Adapter-Config: adapter_config.json in base64") from None
                    sha = server.adapter(run, config, self._body(server.upload_bytes))
                    self._reply(200, {"loaded": "adapter", "sha256": sha})
                elif self.path == "/weights":
                    run = _run_id(self.headers.get("X-Run"))
                    sha = server.weights(run, self._body(server.upload_bytes))
                    self._reply(200, {"loaded": "weights", "sha256": sha})
                elif self.path == "/sample":
                    try:
                        request = json.loads(self._body(MAX_SAMPLE_BYTES))
                    except ValueError:
                        raise Refusal(400, "the body must be JSON") from None
                    self._reply(200, {"completions": server.sample(request)})
                else:
                    raise Refusal(404, f"no such path: {self.path}")
            except Refusal as e:
                if not self._read:               # the body was left unread: the connection cannot go on
                    self.close_connection = True
                self._reply(e.status, {"error": str(e)})
            except GenerationInterrupted:
                self._reply(409, {"error": "aborted (/abort for this run)"})
            except Exception as e:                                   # said to the client, which fails the attempt
                log.exception("request %s failed", self.path)
                if not self._read:
                    self.close_connection = True
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


@dataclass(frozen=True)
class ServerSettings:
    """How `grpo-run vllm-server` was started (its options, with their defaults)."""
    model: str                              # the job's spec.model: the same base weights
    host: str = "127.0.0.1"
    port: int = 8000                        # 0: any free port (printed)
    method: str = "LoRA"                    # LoRA | Full: the jobs' spec.parameters.method
    max_lora_rank: int = 64                 # the largest lora.r it serves
    gpu_memory_utilization: float = 0.9     # the engine's share of its GPU (on a CPU: of memory, for its KV cache)
    seed: int = 0


class _Engine:
    """The VllmSampler a server samples with, as _Server asks it (one adapter folder at a time)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.version = sampler, sampler.version

    def use_adapter(self, folder: Path | None) -> None:
        self.sampler.use_adapter_folder(folder)          # None: the base itself

    def load_weights(self, weights: list) -> None:
        self.sampler.load_weights(weights)

    def generate(self, *args: Any) -> list:
        return self.sampler.generate(*args)


def upload_bytes(model: str) -> int:
    """The largest upload the server takes for `model`: its whole state dict in float32 (tied
    embeddings counted twice, as state_dict() writes them), plus the header. A LoRA adapter of a
    rank below half a layer's width is smaller."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    return sum(t.numel() for t in shell.state_dict().values()) * 4 + UPLOAD_HEADER_BYTES


def start_server(settings: ServerSettings, token: str | None) -> _Server:
    """The engine over settings.model, behind a _Server."""
    import tempfile

    import torch

    from grpo_run.trainer.sampling.vllm_engine import VllmSampler

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu and torch.cuda.is_bf16_supported() else torch.float16 if gpu else torch.float32
    work = Path(tempfile.mkdtemp(prefix="grpo-run-vllm-server-"))          # 0700: nothing in /tmp swaps an adapter
    sampler = VllmSampler(settings.model, method=settings.method, lora_rank=settings.max_lora_rank, dtype=dtype,
                          device=torch.device("cuda" if gpu else "cpu"),
                          gpu_memory_utilization=settings.gpu_memory_utilization, work=work, seed=settings.seed)
    health = {"engine": "vllm", "version": sampler.version, "model": served_name(settings.model),
              "method": settings.method, "maxLoraRank": settings.max_lora_rank}
    return _Server(_Engine(sampler), health=health, token=token, upload_bytes=upload_bytes(settings.model), work=work)


def serve(settings: ServerSettings) -> int:
    """Serve until interrupted (SIGINT, SIGTERM). Prints one line with the address once it answers.
    Raises ValueError for a host it may not listen on (listen_problem)."""
    import signal

    token = node_token()
    problem = listen_problem(settings.host, token)
    if problem:
        raise ValueError(problem)
    engine = start_server(settings, token)
    server = ThreadingHTTPServer((settings.host, settings.port), _handler(engine))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if not token:
        log.info("no %s: listening on loopback only, and asking callers for no token", TOKEN_ENV)
    print(f"vLLM {engine.health['version']} serving {settings.model} ({settings.method}) at "
          f"http://{settings.host}:{server.server_address[1]}", flush=True)     # scripts read the address off it
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="grpo-run's vLLM sampling server (the CLI's `grpo-run vllm-server`)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--method", choices=("LoRA", "Full"), default="LoRA")
    ap.add_argument("--max-lora-rank", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = ServerSettings(**vars(ap.parse_args()))
    refused = listen_problem(options.host, node_token())
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(options))
