"""vLLM as a server (`grpo-run vllm-server`, spec.parameters.vllm.mode: server), for real on
127.0.0.1: a job samples on it and ends byte for byte where the same job colocated ends; a server
that dies mid-run is an infrastructure failure the supervisor restarts, never a score; an
unreachable server is refused before anything starts. And who may use it (docs/security.md): the
node's token on every route but /health, each run its own adapter and abort, bodies capped, the
model compared, the replies checked, and on resume the node's own server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from grpo_run.state.record import Record
from grpo_run.trainer.sampling.engines import EngineRefused, EngineUnavailable
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from grpo_run.trainer.sampling.vllm_client import VllmServerSampler
from grpo_run.trainer.sampling.vllm_server import TOKEN_ENV, _handler, _Server, served_name
from tests.faults.harness import start_node, wait_until
from tests.runner.jobs.test_resume import exported_bytes, grpo_run
from tests.runner.jobs.test_vllm_jobs import tiny64, write_job  # noqa: F401 (the session's model fixture)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
STEPS = 16
TOKEN = "s3cret-token-of-this-node"


def start_server(model: Path, port: int = 0, **env: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "vllm-server", "--model", str(model),
                             "--port", str(port), "--gpu-memory-utilization", "0.1", "--max-lora-rank", "8"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env})
    seen = []
    for line in proc.stdout:                         # vLLM's log, then our line once it answers
        seen.append(line)
        if line.startswith("vLLM ") and " serving " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()    # drained: never blocks the server
            return proc, line.rsplit(" at ", 1)[1].strip()
    proc.wait()
    raise AssertionError(f"the server ended (status {proc.returncode}):\n{''.join(seen)[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def server_job(folder: Path, model: Path, url: str, **params) -> Path:
    path = write_job(folder, model, **params)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["parameters"]["vllm"] = {"mode": "server", "server": url}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tiny64):
    """The same job, sampled by the colocated engine."""
    folder = tmp_path_factory.mktemp("colocated")
    grpo_run(folder / "home", "apply", "-f", str(write_job(folder, tiny64, maxSteps=STEPS, saveSteps=4)))
    return exported_bytes(folder / "home", None, folder / "export")


def test_a_job_sampling_on_a_vllm_server_ends_where_the_colocated_one_ends(tmp_path, tiny64, colocated, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)             # the server's and the trainer node's, as an operator sets them
    server, url = start_server(tiny64)
    try:
        job = server_job(tmp_path, tiny64, url, maxSteps=STEPS, saveSteps=4)
        grpo_run(tmp_path / "home", "apply", "-f", str(job))
        status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "resumable", "-o", "json").stdout)["status"]
        assert status["phase"] == "Succeeded"
        assert status["sampler"]["engine"] == "vllm" and status["sampler"]["mode"] == "server"
        assert status["sampler"]["server"] == url and status["lastStep"]["logprobMismatch"] < 1e-3
        assert exported_bytes(tmp_path / "home", None, tmp_path / "export") == colocated
    finally:
        stop(server)


def test_a_server_that_dies_mid_run_is_an_infrastructure_failure_restarted_never_a_score(tmp_path, tiny64,
                                                                                         colocated):
    server, url = start_server(tiny64)
    port = int(url.rsplit(":", 1)[1])
    node = tmp_path / "home"
    try:
        job = server_job(tmp_path, tiny64, url, maxSteps=STEPS, saveSteps=4)
        proc = start_node(node, "apply", "-f", str(job), GRPO_RUN_NOTICES="none")
        db = node / "runs" / "resumable" / "state.db"

        def steps() -> int:
            if not db.exists():
                return 0
            with Record(db) as record:
                last = record.steps(last=1)
            return last[-1]["step"] if last else 0

        wait_until("step 3 trained on the server", lambda: steps() >= 3, proc)
        stop(server)                                   # the sampling GPU's node is gone

        def attempts() -> list[dict]:
            with Record(db) as record:
                return record.attempts()

        wait_until("the attempt ended by the lost server", lambda: any(
            "vLLM server" in (a.get("message") or "") for a in attempts()), proc)
        server, _ = start_server(tiny64, port)         # the operator brings it back; the restarts go on
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        ended = [a for a in attempts() if "vLLM server" in (a.get("message") or "")]
        assert ended and all("did not answer" in a["message"] for a in ended)
        with Record(db) as record:
            rewards = [s["rewardMean"] for s in record.steps()]
        assert len(rewards) == STEPS and all(r > 0 for r in rewards)    # no step scored as a failure
        assert exported_bytes(node, None, tmp_path / "export") == colocated
    finally:
        stop(server)


def test_an_unreachable_server_is_refused_before_anything_starts(tmp_path, tiny64):
    job = server_job(tmp_path, tiny64, "http://127.0.0.1:9", maxSteps=2)
    done = grpo_run(tmp_path / "home", "apply", "-f", str(job), check=False)
    assert done.returncode == 2
    assert "spec.parameters.vllm.server: no vLLM server answers at http://127.0.0.1:9" in done.stderr
    assert "grpo-run vllm-server --model" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "runs" / "resumable").exists()



# --- who may use the server ----------------------------------------------------------------------

def call(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One request by hand: (status, JSON answer)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def client(url: str, model: Path, work: Path) -> VllmServerSampler:
    from grpo_run.trainer.sampling.engines import SampleSettings

    work.mkdir(parents=True, exist_ok=True)
    return VllmServerSampler(url, SampleSettings(temperature=1.0, max_tokens=6), model=str(model), method="LoRA",
                             lora_rank=8, timeout_s=120, pad_id=0, work=work)


def policy(model: Path, *, changed: bool):
    """The tiny model with a LoRA adapter as a job's first step has it (the identity), or one whose
    every B matrix is random (another policy)."""
    import torch

    from grpo_run.trainer.config import GRPOParams
    from grpo_run.trainer.model.policy import load_policy

    torch.manual_seed(1)
    peft = load_policy(str(model), GRPOParams(), torch.device("cpu"))
    if changed:
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 2)
    return peft


def prompts(n: int = 8):
    import torch

    ids = torch.tensor([[3 + (i * 7 + j) % 15 for j in range(6)] for i in range(n)])   # within the tiny vocabulary
    return ids, torch.ones_like(ids)


def draws(sampler: VllmServerSampler, seed: int = 7) -> list[list[int]]:
    ids, mask = prompts()
    out = sampler.sample(ids, mask, [seed], temperature=1.0, should_stop=lambda: False)
    return [row[m.bool()].tolist() for row, m in zip(out.ids, out.mask)]


@pytest.fixture(scope="module")
def served(tiny64):
    """One real server for this module's trust tests, asking for TOKEN."""
    server, url = start_server(tiny64, **{TOKEN_ENV: TOKEN})
    yield url
    stop(server)


@pytest.mark.trust
def test_every_route_but_health_refuses_a_caller_without_the_nodes_token(figures, served):
    status, health = call(served, "GET", "/health")
    assert status == 200 and health["token"] is True and health["engine"] == "vllm"
    for path in ("/adapter", "/weights", "/sample", "/abort"):
        assert call(served, "POST", path, b"{}", {"X-Run": "stranger"})[0] == 401
        status, answer = call(served, "POST", path, b"{}", {"X-Run": "stranger", **bearer("guessed")})
        assert status == 403 and TOKEN_ENV in answer["error"]
    assert call(served, "POST", "/abort", json.dumps({"run": "r1"}).encode(), bearer(TOKEN))[0] == 200
    figures.add("trust", actor='host on the node network', tried='call /adapter, /weights, /sample, /abort of a vLLM server without its token, or with a guessed one',
                protection="the node's GRPO_RUN_VLLM_TOKEN on every route but /health", outcome='401 / 403, nothing loaded or sampled', held=True)


def headers_only(url: str, path: str, headers: dict) -> tuple[int, dict]:
    """A POST's headers, and no body after them: what the server answers before reading one."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


@pytest.mark.trust
def test_a_body_past_the_routes_cap_is_refused_before_it_is_read(figures, served):
    # a server that read the body first would wait for the terabyte
    status, answer = headers_only(served, "/sample", {**bearer(TOKEN), "Content-Length": str(10**12)})
    assert status == 413 and "more than this route takes" in answer["error"]
    assert headers_only(served, "/adapter", {**bearer(TOKEN), "X-Run": "r1", "Content-Length": str(10**12)})[0] == 413
    assert headers_only(served, "/adapter", {**bearer(TOKEN), "X-Run": "r1"})[0] == 411     # no length: no read
    figures.add("trust", actor='host on the node network', tried='a 1 TB body, or one without a length, to the vLLM server',
                protection="Content-Length checked against the route's cap before reading", outcome='413 / 411, nothing read', held=True)


@pytest.mark.trust
def test_a_server_without_a_token_listens_on_loopback_only(figures, tmp_path, tiny64):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    done = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "vllm-server", "--model", str(tiny64),
                           "--host", "0.0.0.0", "--port", "0"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and TOKEN_ENV in done.stderr and "Traceback" not in done.stderr
    figures.add("trust", actor='host on the node network', tried='a vLLM server on 0.0.0.0 without a token',
                protection='no token: loopback only', outcome='refused at start, exit 2', held=True)


@pytest.mark.trust
def test_two_runs_on_one_server_each_sample_with_their_own_adapter(figures, served, tiny64, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    first, second = client(served, tiny64, tmp_path / "a"), client(served, tiny64, tmp_path / "b")
    first.load_policy(policy(tiny64, changed=False))
    before = draws(first)
    second.load_policy(policy(tiny64, changed=True))        # another job's policy, loaded after
    assert draws(first) == before                           # still its own adapter
    assert draws(second) != before
    # a /sample naming an adapter the server does not hold for the run is refused, never sampled
    ids, _ = prompts(2)
    body = {"run": first.run, "sha256": second.sha256, "prompts": ids.tolist(), "seeds": [1],
            "settings": {"max_tokens": 4, "temperature": 1.0}}
    status, answer = call(served, "POST", "/sample", json.dumps(body).encode(), bearer(TOKEN))
    assert status == 409 and f"not sha256 {second.sha256}" in answer["error"]
    figures.add("trust", actor='ordinary failure', tried="two jobs on one vLLM server, and a /sample naming another run's adapter",
                protection='an adapter per run, its sha256 checked on every /sample', outcome='each job samples its own policy; the other refused (409)', held=True)


@pytest.mark.trust
def test_a_trainer_with_another_token_is_refused_with_the_variable_to_set(figures, served, tiny64, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "not-the-servers")
    sampler = client(served, tiny64, tmp_path)
    with pytest.raises(EngineRefused, match=TOKEN_ENV):
        sampler.load_policy(policy(tiny64, changed=False))
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(EngineRefused, match=f"asks for a token, and {TOKEN_ENV} is not set"):
        client(served, tiny64, tmp_path)
    figures.add("trust", actor='ordinary failure', tried='a trainer node with another token, or none',
                protection='the token checked, the variable named', outcome='the job refused with the fix', held=True)


@pytest.mark.trust
def test_a_server_of_another_model_is_refused_at_apply_and_at_the_trainers_start(figures, served, tiny64, tmp_path,
                                                                                   monkeypatch):
    from grpo_run.runner.jobs.preflight import _server_problem

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    other = tmp_path / "other-base"
    other.mkdir()
    (other / "config.json").write_text((tiny64 / "config.json").read_text())      # the same shape
    assert _server_problem(served, str(tiny64)) is None
    problem = _server_problem(served, str(other))
    assert problem and f"serves {served_name(str(tiny64))!r}" in problem and "grpo-run vllm-server --model" in problem
    with pytest.raises(EngineRefused, match="spec.parameters.vllm.server: the vLLM server at .* serves"):
        client(served, other, tmp_path)
    figures.add("trust", actor='ordinary failure', tried='a vLLM server of another base of the same shape',
                protection="/health's model compared with spec.model at apply and at the trainer's start", outcome='refused at both', held=True)


# --- the server's bookkeeping over a stub engine (what a real engine adds nothing to) -------------

class StubEngine:
    """Draws `reply(prompts)`; `hold` keeps a sampling running until released or aborted."""
    version = "stub"

    def __init__(self, reply=None) -> None:
        self.reply = reply or (lambda prompts: [Drawn([1, 2], [-0.5, -0.5], False) for _ in prompts])
        self.hold = False
        self.started, self.release = threading.Event(), threading.Event()
        self.should_stop = None

    def use_adapter(self, folder) -> None:
        self.folder = folder

    def generate(self, prompts, seeds, settings, should_stop):
        self.should_stop = should_stop
        self.started.set()
        while self.hold and not self.release.wait(0.01):
            if should_stop():
                raise GenerationInterrupted()
        return self.reply(prompts)


class FakeAdapter:
    def save_pretrained(self, folder: str, **options) -> None:     # as PEFT takes them (save_embedding_layers)
        Path(folder).mkdir(parents=True)
        (Path(folder) / "adapter_config.json").write_text("{}")
        (Path(folder) / "adapter_model.safetensors").write_bytes(os.urandom(64))


from grpo_run.trainer.sampling.vllm_engine import Drawn  # noqa: E402


@pytest.fixture()
def stub(tmp_path, tiny64):
    from http.server import ThreadingHTTPServer

    engine = StubEngine()
    health = {"engine": "vllm", "version": "stub", "model": served_name(str(tiny64)), "method": "LoRA",
              "maxLoraRank": 8}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(_Server(engine, health=health, token=None,
                                                                    upload_bytes=1 << 20, work=tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", engine
    engine.release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.trust
def test_an_abort_stops_only_its_own_runs_sampling_and_is_a_failure_when_the_trainer_did_not_ask(
        figures, stub, tiny64, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    url, engine = stub
    sampler = client(url, tiny64, tmp_path)
    sampler.load_policy(FakeAdapter())
    engine.hold = True
    outcome = {}

    def sample() -> None:
        try:
            outcome["drawn"] = draws(sampler)
        except Exception as e:          # noqa: BLE001 (asserted below)
            outcome["error"] = e

    worker = threading.Thread(target=sample)
    worker.start()
    assert engine.started.wait(60)
    assert call(url, "POST", "/abort", json.dumps({"run": "another-run"}).encode())[0] == 200
    assert engine.should_stop() is False                  # another run's abort: this sampling goes on
    assert call(url, "POST", "/abort", json.dumps({"run": sampler.run}).encode())[0] == 200
    worker.join(60)
    assert isinstance(outcome.get("error"), EngineUnavailable)     # not GenerationInterrupted: no stop was asked
    assert "409" in str(outcome["error"])
    figures.add("trust", actor='host on the node network', tried="/abort another run's sampling on a shared vLLM server",
                protection='/abort scoped to its run; an unrequested 409 is an infrastructure failure', outcome='the other run samples on; the aborted attempt restarts, never Preempted', held=True)


@pytest.mark.trust
@pytest.mark.parametrize("reply, said", [
    (lambda prompts: [Drawn([1], [-1.0], False)] * (len(prompts) - 1), "7 completions for 8 prompts"),
    (lambda prompts: [Drawn([10**6], [-1.0], False) for _ in prompts], "outside the model's vocabulary"),
    (lambda prompts: [Drawn([1] * 7, [-1.0] * 7, True) for _ in prompts], "7 tokens, more than max_tokens (6)"),
    (lambda prompts: [Drawn([1], [float("nan")], False) for _ in prompts], "not one finite number per token"),
])
def test_a_reply_that_is_not_the_completions_asked_for_is_never_trained_on(figures, stub, tiny64, tmp_path, monkeypatch,
                                                                          reply, said):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    url, engine = stub
    engine.reply = reply
    sampler = client(url, tiny64, tmp_path)
    sampler.load_policy(FakeAdapter())
    with pytest.raises(EngineUnavailable, match=said.replace("(", r"\(").replace(")", r"\)")):
        draws(sampler)
    figures.add("trust", actor='bucket writer', tried='a vLLM server of theirs answering too few rows, ids outside the vocabulary, too many tokens, NaN log-probs',
                protection='every reply checked before it is trained on', outcome='an infrastructure failure, never trained on', held=True)


# --- on resume, the node names the server ---------------------------------------------------------

@pytest.mark.trust
def test_on_resume_the_vllm_server_comes_from_the_node_not_the_stored_spec(figures, tmp_path, tiny64, monkeypatch):
    from grpo_run.runner.jobs.stored import VLLM_SERVER_ENV, as_this_node_runs_it
    from grpo_run.runner.spec.job import load_job
    from grpo_run.runner.supervisor.runspec import build_run_spec

    stored = load_job(str(server_job(tmp_path, tiny64, "http://10.9.9.9:8000", maxSteps=2)))
    monkeypatch.delenv(VLLM_SERVER_ENV, raising=False)
    with pytest.raises(ValueError, match=f"set {VLLM_SERVER_ENV}=http://HOST:PORT on this node"):
        as_this_node_runs_it(stored, trust_urls=False)
    monkeypatch.setenv(VLLM_SERVER_ENV, "ftp://nowhere")
    with pytest.raises(ValueError, match=f"{VLLM_SERVER_ENV}='ftp://nowhere' in this node's environment"):
        as_this_node_runs_it(stored, trust_urls=False)
    monkeypatch.setenv(VLLM_SERVER_ENV, "http://127.0.0.1:8000/")
    local = as_this_node_runs_it(stored, trust_urls=False)
    assert local.parameters.vllm.server == "http://127.0.0.1:8000"
    # what the trainer is given: the node's server, never the stored one
    assert build_run_spec(stored, "file:///x", local=local).params.vllm.server == "http://127.0.0.1:8000"
    assert as_this_node_runs_it(stored, trust_urls=True).parameters.vllm.server == "http://10.9.9.9:8000"
    figures.add("trust", actor='bucket writer', tried='a stored vllm.server, resumed',
                protection="on resume the node's GRPO_RUN_VLLM_SERVER", outcome='the stored server never contacted', held=True)


@pytest.mark.trust
def test_vllm_never_reports_usage_from_a_trainer_or_a_server(figures, tmp_path, monkeypatch):
    """vLLM sends usage reports to stats.vllm.ai unless told not to; every engine grpo-run starts
    (colocated in the trainer, and the server's, which is the same VllmSampler) is told."""
    import torch
    import vllm

    from grpo_run.trainer.sampling.vllm_engine import VllmSampler

    seen = {}

    class Engine:                       # stands for vllm.LLM: what the environment says as it starts
        def __init__(self, **options) -> None:
            seen.update({k: os.environ.get(k) for k in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")})

    monkeypatch.setattr(vllm, "LLM", Engine)
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    VllmSampler("any-model", method="LoRA", lora_rank=8, dtype=torch.float32, device=torch.device("cpu"),
                gpu_memory_utilization=0.1, work=tmp_path)
    assert seen == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    figures.add("trust", actor='ordinary failure', tried="vLLM's default usage report to stats.vllm.ai",
                protection='VLLM_NO_USAGE_STATS=1 and DO_NOT_TRACK=1 before the engine starts', outcome='no report', held=True)
