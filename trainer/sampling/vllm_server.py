"""vLLM as a server: the engine in a process of its own, on another GPU or node (TRL's server mode),
and the trainer's client for it.

The server (`grpo-run vllm-server --model MODEL`, or `python -m grpo_run.trainer.sampling.vllm_server`)
holds one engine over the base model and answers, on HTTP/JSON:

    GET  /health     {engine, version, model, method, maxLoraRank}
    POST /adapter    the policy's LoRA adapter: body adapter_model.safetensors, header
                     X-Adapter-Config the adapter_config.json (base64); sampled with from then on
    POST /weights    a full fine-tune's weights: body a safetensors file of the state dict
    POST /sample     {prompts: [[ids]], seeds: [...], settings: {...}} -> {completions: [{tokenIds,
                     logprobs, truncated}]}: the engine's draws, seeded per request as colocated
    POST /abort      every request of the sampling in progress aborted (its /sample answers 409)

Adapters and weights travel as safetensors, never pickle. It binds 127.0.0.1 unless told
otherwise: anyone who reaches it can replace the weights it samples with; put it on a private
network and not on a public address.

The client (VllmServerSampler) is a Sampler like the colocated engine. A server that does not
answer, answers an error or takes longer than `vllm.serverTimeoutSeconds` raises EngineUnavailable:
an infrastructure failure (the attempt ends and the supervisor's restart policy takes it), never a
score. A stop request while it samples sends /abort and raises GenerationInterrupted at once.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo_run.trainer.sampling.engines import EngineRefused, EngineUnavailable, SampleSettings

log = logging.getLogger(__name__)

POLL_S = 0.05                 # how often the client asks the stop request while the server samples
# How long a trainer starting waits for its server to answer /health: one started at the same time
# (a launcher starting both), or one its operator is bringing back after it died, is waited for.
SERVER_START_WAIT_S = 120.0


# --- the server -----------------------------------------------------------------------------------

class _Engine:
    """The server's one engine; /sample calls are served one at a time (the engine is not thread-safe)."""

    def __init__(self, args: "ServerSettings") -> None:
        import tempfile

        import torch

        from grpo_run.trainer.sampling.vllm_engine import VllmSampler

        gpu = torch.cuda.is_available()
        dtype = torch.bfloat16 if gpu and torch.cuda.is_bf16_supported() else torch.float16 if gpu else torch.float32
        self.work = Path(tempfile.mkdtemp(prefix="grpo-run-vllm-server-"))
        self.engine = VllmSampler(args.model, method=args.method, lora_rank=args.max_lora_rank, dtype=dtype,
                                  device=torch.device("cuda" if gpu else "cpu"),
                                  gpu_memory_utilization=args.gpu_memory_utilization, work=self.work, seed=args.seed)
        self.health = {"engine": "vllm", "version": self.engine.version, "model": args.model, "method": args.method,
                       "maxLoraRank": args.max_lora_rank}
        self.lock = threading.Lock()
        self.abort = threading.Event()

    def adapter(self, config: bytes, weights: bytes) -> None:
        folder = self.work / f"adapter-{time.monotonic_ns()}"
        folder.mkdir()
        (folder / "adapter_config.json").write_bytes(config)
        (folder / "adapter_model.safetensors").write_bytes(weights)
        with self.lock:
            old = self.engine._lora
            self.engine.use_adapter_folder(folder)
        if old is not None:
            import shutil

            shutil.rmtree(old.lora_path, ignore_errors=True)

    def weights(self, body: bytes) -> None:
        from safetensors.torch import load

        tensors = load(body)
        with self.lock:
            self.engine.load_weights(list(tensors.items()))

    def sample(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        settings = SampleSettings(**request["settings"])
        with self.lock:
            self.abort.clear()
            outs = self.engine.generate(request["prompts"], request["seeds"], settings, self.abort.is_set)
        return [{"tokenIds": o.token_ids, "logprobs": o.logprobs, "truncated": o.truncated} for o in outs]


def _handler(engine: _Engine) -> type[BaseHTTPRequestHandler]:
    from grpo_run.trainer.sampling.sampler import GenerationInterrupted

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:       # the engine's own log is enough
            log.debug(fmt, *args)

        def _reply(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self) -> None:                                    # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._reply(200, engine.health)
            else:
                self._reply(404, {"error": f"no such path: {self.path}"})

        def do_POST(self) -> None:                                   # noqa: N802
            try:
                if self.path == "/abort":
                    engine.abort.set()
                    self._body()
                    self._reply(200, {"aborted": True})
                elif self.path == "/adapter":
                    config = base64.b64decode(self.headers.get("X-Adapter-Config", ""))
                    engine.adapter(config, self._body())
                    self._reply(200, {"loaded": "adapter"})
                elif self.path == "/weights":
                    engine.weights(self._body())
                    self._reply(200, {"loaded": "weights"})
                elif self.path == "/sample":
                    self._reply(200, {"completions": engine.sample(json.loads(self._body()))})
                else:
                    self._reply(404, {"error": f"no such path: {self.path}"})
            except GenerationInterrupted:
                self._reply(409, {"error": "aborted"})
            except Exception as e:                                   # said to the client, which fails the attempt
                log.exception("request %s failed", self.path)
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


def serve(settings: ServerSettings) -> int:
    """Serve until interrupted (SIGINT, SIGTERM). Prints one line with the address once it answers."""
    import signal

    engine = _Engine(settings)
    server = ThreadingHTTPServer((settings.host, settings.port), _handler(engine))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"vLLM {engine.health['version']} serving {settings.model} ({settings.method}) at "
          f"http://{settings.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# --- the client ------------------------------------------------------------------------------------

class VllmServerSampler:
    """The trainer's side: a Sampler whose engine is a vLLM server (`url`)."""
    engine = "vllm"

    def __init__(self, url: str, settings: "SampleSettings", *, method: str, lora_rank: int, timeout_s: float,
                 pad_id: int, work: Path) -> None:
        self.url, self.method, self.timeout_s = url.rstrip("/"), method, timeout_s
        self.pad_id, self.work, self.settings = pad_id, Path(work), settings
        t0 = time.perf_counter()
        health = self._health()
        self.version = health.get("version", "")
        if health.get("method") != method:
            raise EngineRefused(f"spec.parameters.vllm.server: the vLLM server at {self.url} serves method "
                                f"{health.get('method')}, and this job trains {method}: start it with --method {method}")
        if method == "LoRA" and lora_rank > int(health.get("maxLoraRank") or 0):
            raise EngineRefused(f"spec.parameters.vllm.server: the vLLM server at {self.url} serves LoRA ranks up to "
                                f"{health.get('maxLoraRank')}, and this job's lora.r is {lora_rank}: start it with "
                                f"--max-lora-rank {lora_rank} or more")
        self.start_seconds = time.perf_counter() - t0       # the server's own start-up is not this trainer's

    def _health(self) -> dict[str, Any]:
        """The server's /health, waiting up to SERVER_START_WAIT_S for it to answer."""
        deadline = time.monotonic() + SERVER_START_WAIT_S
        while True:
            try:
                return json.loads(self._call("GET", "/health", timeout=10))
            except EngineUnavailable as e:
                if time.monotonic() >= deadline:
                    raise EngineUnavailable(f"{e} (waited {SERVER_START_WAIT_S:.0f} s)") from None
                log.warning("waiting for the vLLM server: %s", e)
                time.sleep(2.0)

    def _call(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
              timeout: float | None = None) -> bytes:
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as e:
            if e.code == 409:
                raise _Aborted() from None
            detail = e.read().decode(errors="replace")[:500]
            raise EngineUnavailable(f"the vLLM server at {self.url} answered {path} with {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:        # refused, reset, timed out
            reason = getattr(e, "reason", e)
            raise EngineUnavailable(f"the vLLM server at {self.url} did not answer {path} ({reason}); is "
                                    f"`grpo-run vllm-server` running there?") from None

    def load_policy(self, model) -> float:
        t0 = time.perf_counter()
        if self.method == "LoRA":
            import shutil

            folder = self.work / "vllm-adapter"
            if folder.exists():
                shutil.rmtree(folder)
            model.save_pretrained(str(folder))
            config = base64.b64encode((folder / "adapter_config.json").read_bytes()).decode()
            self._call("POST", "/adapter", (folder / "adapter_model.safetensors").read_bytes(),
                       {"X-Adapter-Config": config, "Content-Type": "application/octet-stream"})
        else:
            from safetensors.torch import save

            state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
            self._call("POST", "/weights", save(state), {"Content-Type": "application/octet-stream"})
        return time.perf_counter() - t0

    def sample(self, prompt_ids, prompt_mask, seeds: Sequence[int], *, temperature: float,
               should_stop: Callable[[], bool]):
        from grpo_run.trainer.sampling.sampler import GenerationInterrupted
        from grpo_run.trainer.sampling.vllm_engine import Drawn, completions

        prompts = [prompt_ids[row][prompt_mask[row].bool()].tolist() for row in range(prompt_ids.size(0))]
        body = json.dumps({"prompts": prompts, "seeds": list(seeds),
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
                    self._call("POST", "/abort", b"{}", {"Content-Type": "application/json"}, timeout=5)
                except EngineUnavailable:
                    pass                          # stopping anyway
                raise GenerationInterrupted()
            worker.join(POLL_S)
        if "error" in answer:
            if isinstance(answer["error"], _Aborted):
                raise GenerationInterrupted()
            raise answer["error"]
        outs = [Drawn(c["tokenIds"], c["logprobs"], c["truncated"]) for c in json.loads(answer["body"])["completions"]]
        return completions(outs, self.pad_id, prompt_ids.device)

    def release(self) -> None:
        pass                                      # the server's memory is on its own card

    def status(self) -> dict[str, str | float]:
        return {"engine": self.engine, "version": self.version, "mode": "server",
                "startSeconds": round(self.start_seconds, 2), "server": self.url}

    def close(self) -> None:
        pass                                      # the server is its operator's


class _Aborted(Exception):
    """/sample answered 409: another caller aborted it."""


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
    sys.exit(serve(ServerSettings(**vars(ap.parse_args()))))
