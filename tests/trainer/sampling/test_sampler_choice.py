"""Which engine samples a run (spec.parameters.sampler), decided once and kept."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from grpo_run.runner.supervisor import attempt
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.sampling import choice
from grpo_run.trainer.sampling.choice import choose

QWEN3_0_6B = {"hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}
DEMO = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}


@pytest.fixture
def with_vllm(monkeypatch):
    monkeypatch.setattr(choice, "vllm_version", lambda: "0.32.0")


@pytest.fixture
def without_vllm(monkeypatch):
    monkeypatch.setattr(choice, "vllm_version", lambda: None)


def test_auto_takes_vllm_where_it_serves_the_model(with_vllm):
    c = choose("auto", "LoRA", lambda: QWEN3_0_6B, gpu=True)
    assert c.engine == "vllm" and c.version == "0.32.0"


def test_auto_on_a_cpu_is_native_where_vllm_would_serve_it_too_and_vllm_when_asked(with_vllm):
    # vLLM's CPU build samples at about a fifth of the native decoder's tokens/s (docs/benchmarks.md)
    on_cpu = choose("auto", "LoRA", lambda: QWEN3_0_6B, gpu=False)
    assert on_cpu.engine == "native" and "no GPU on this node" in on_cpu.why
    assert choose("vllm", "LoRA", lambda: QWEN3_0_6B, gpu=False).engine == "vllm"


def test_a_head_size_the_cpu_attention_lacks_is_refused_on_a_cpu_and_vllm_on_a_gpu(with_vllm):
    with pytest.raises(ValueError, match="head_dim is 16"):
        choose("vllm", "LoRA", lambda: DEMO, gpu=False)
    assert choose("auto", "LoRA", lambda: DEMO, gpu=True).engine == "vllm"


def test_sampler_vllm_that_cannot_be_is_an_error_naming_the_field_and_the_fix(with_vllm):
    with pytest.raises(ValueError, match=r"spec.parameters.sampler: vllm cannot sample this job: method QLoRA.*sampler: native"):
        choose("vllm", "QLoRA", lambda: QWEN3_0_6B, gpu=True)


def test_native_never_reads_the_model(with_vllm):
    def unread():
        raise AssertionError("read")
    assert choose("native", "LoRA", unread, gpu=True).engine == "native"


def test_a_model_config_that_cannot_be_read_makes_auto_native(with_vllm):
    def missing():
        raise LookupError("no config.json")
    c = choose("auto", "LoRA", missing, gpu=True)
    assert c.engine == "native" and "no config.json" in c.why


def test_vllm_settings_outside_their_range_name_the_field():

    for bad, field in (({"gpuMemoryUtilization": 1.5}, "gpuMemoryUtilization"), ({"gpuMemoryUtilization": 0}, "gpuMemoryUtilization"),
                       ({"mode": "server"}, "mode"), ({"importanceSamplingCap": -1}, "importanceSamplingCap")):
        with pytest.raises(Exception) as e:
            GRPOParams(vllm=bad)
        assert field in str(e.value)


class _Books:
    def __init__(self, chosen):
        self.chosen, self.recorded = chosen, None

    def sampler(self):
        return self.chosen

    def choose_sampler(self, engine, why):
        self.recorded = (engine, why)


def _process(books, params):
    spec = SimpleNamespace(params=params, model="unused", processes=1, env=SimpleNamespace(rewards=[], episodes=None))
    return attempt.TrainerProcess(spec, "/nonexistent", books, None, checkpoints=None, wake=threading.Event())


def test_a_run_that_chose_vllm_is_refused_on_a_node_without_it_never_switched(monkeypatch):
    monkeypatch.setattr(choice, "vllm_version", lambda: None)
    books = _Books("vllm")
    with pytest.raises(attempt.SamplerUnavailable, match="this node has no vLLM: install grpo-run\\[vllm\\]"):
        _process(books, GRPOParams(sampler="auto"))._sampler()
    assert books.recorded is None


def test_the_first_start_records_the_choice_and_later_ones_keep_it(monkeypatch):
    monkeypatch.setattr(choice, "vllm_version", lambda: "0.32.0")
    books = _Books(None)
    assert _process(books, GRPOParams(sampler="native"))._sampler() == "native"
    assert books.recorded == ("native", "spec.parameters.sampler: native")
    kept = _Books("native")        # chosen before: auto is not asked again, whatever this node has
    assert _process(kept, GRPOParams(sampler="auto"))._sampler() == "native" and kept.recorded is None


def test_server_mode_needs_no_vllm_here_and_still_refuses_what_it_cannot_sample(without_vllm):
    c = choose("auto", "LoRA", lambda: DEMO, gpu=False, server=True)
    assert c.engine == "vllm" and "server" in c.why            # the demo's head size: the server's GPU serves it
    with pytest.raises(ValueError, match="method QLoRA"):
        choose("vllm", "QLoRA", lambda: DEMO, gpu=False, server=True)


def test_server_settings_name_the_field_and_the_fix():
    for bad, text in (({"mode": "server"}, "vllm.server"), ({"server": "http://127.0.0.1:8000"}, "vllm.mode"),
                      ({"mode": "server", "server": "127.0.0.1:8000"}, "http://HOST:PORT")):
        with pytest.raises(Exception) as e:
            GRPOParams(vllm=bad)
        assert text in str(e.value)


def test_several_trainer_processes_sample_natively_with_the_reason(with_vllm):
    c = choose("auto", "LoRA", lambda: QWEN3_0_6B, gpu=True, processes=4)
    assert c.engine == "native" and "4 trainer processes" in c.why
    with pytest.raises(ValueError, match="spec.resources.processes: 1"):
        choose("vllm", "LoRA", lambda: QWEN3_0_6B, gpu=True, processes=2)


def test_a_node_without_vllm_is_told_before_the_lease_and_leaves_the_job_as_it_was(tmp_path, monkeypatch):
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.runner.jobs import find as jobs
    from grpo_run.state import values
    from grpo_run.state.record import Record

    store = Store(str(tmp_path / "store" / "job"))
    with Record(tmp_path / "state.db") as record:
        values.SAMPLER.set(record, {"engine": "vllm", "why": "auto: ..."})
    store.put_file(tmp_path / "state.db", "state.db")
    before = store.get_bytes("state.db")
    job = SimpleNamespace(name="job", parameters=GRPOParams(sampler="auto"))
    monkeypatch.setattr(choice, "vllm_version", lambda: None)
    said = jobs.before_the_lease(job, store)[1]
    assert said and "this node has no vLLM: install grpo-run[vllm]" in said and said.startswith("job: spec.parameters.sampler")
    assert store.get_bytes("state.db") == before and not store.exists("lease.json")
    monkeypatch.setattr(choice, "vllm_version", lambda: "0.32.0")
    assert jobs.before_the_lease(job, store)[1] is None
    server = SimpleNamespace(name="job", parameters=GRPOParams(vllm={"mode": "server", "server": "http://127.0.0.1:1"}))
    monkeypatch.setattr(choice, "vllm_version", lambda: None)
    assert jobs.before_the_lease(server, store)[1] is None          # a server's node needs no engine of its own


def test_a_qlora_refusal_names_what_the_installed_vllm_lacks(tmp_path, monkeypatch):
    """vLLM 0.32.0 (constraints.txt) has no bitsandbytes loader; a vLLM that has one is seen as such."""
    import importlib.util

    fake = tmp_path / "vllm"
    (fake / "model_executor" / "model_loader").mkdir(parents=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(fake)])
                        if name == "vllm" else None)
    monkeypatch.setattr(choice, "vllm_version", lambda: "0.32.0")
    assert choice.vllm_loads_bitsandbytes() is False
    assert choice.vllm_refusal("QLoRA", QWEN3_0_6B, gpu=True).startswith(
        "method QLoRA: vLLM 0.32.0 has no bitsandbytes loader")
    (fake / "model_executor" / "model_loader" / "bitsandbytes_loader.py").write_text("")
    assert choice.vllm_loads_bitsandbytes() is True
    assert "grpo-run does not hand a 4-bit (bitsandbytes) base to vLLM" in choice.vllm_refusal("QLoRA", {}, gpu=True)


@pytest.mark.skipif(choice.vllm_version() != "0.32.0", reason="the pinned vLLM's own files")
def test_the_pinned_vllm_has_no_bitsandbytes_loader():
    assert choice.vllm_loads_bitsandbytes() is False
