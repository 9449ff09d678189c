"""The fast decoder samples exactly what the model's own forward samples, on every architecture it
takes; models it does not take are sampled through their own forward."""

import pytest
import torch

from grpo_run.trainer.model import llama
from grpo_run.trainer.sampling import decode
from grpo_run.trainer.sampling import sampler

VOCAB = 40


def lm(kind: str, **extra):
    """A random 2-layer model of `kind` with grouped KV heads, built from its config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None, initializer_range=0.2)
    if kind == "gpt2":
        fields = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**fields, **extra}),
                                            dtype=torch.float32).eval()


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():                      # a trained adapter: B is zero only at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def prompts():
    """Left-padded prompts of three lengths, each repeated as a group of 3, plus one alone."""
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    rows = [r for r in rows for _ in range(3)] + [[20, 21, 22, 23]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def both(model, monkeypatch, ids, mask, **kw):
    kw = {"max_new_tokens": 12, "temperature": 1.0, "eos_ids": (1,), "pad_id": 0, **kw}
    fast = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    with monkeypatch.context() as m:
        m.setattr(sampler, "decoder_for", lambda model, compiled=False, keep=False: decode.TransformersDecoder(model))
        slow = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    return fast, slow


def assert_same_logits(model, ids, mask, tokens: int) -> None:
    """The fast decoder's logits equal the model's own forward's, bit for bit, after the prompt and
    after each of `tokens` greedy tokens."""
    fast, slow = decode.LlamaFamilyDecoder(model), decode.TransformersDecoder(model)
    running = torch.ones(ids.size(0), dtype=torch.bool)
    with torch.no_grad():
        a, b = fast.start(ids, mask, tokens), slow.start(ids, mask, tokens)
        for _ in range(tokens):
            assert torch.equal(a, b)
            nxt = a.argmax(-1)
            a, b = fast.step(nxt, running), slow.step(nxt, running)
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind, extra", [
    ("qwen3", {"head_dim": 8}), ("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": None}),
    ("llama", {"num_key_value_heads": 4}),          # one query head per KV head
    # scaled rotary frequencies: fixed (the decoder's table of them) and dynamic (the model's module each token)
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
               "max_position_embeddings": 8}),    # completions go past it: the frequencies change as they grow
], ids=["qwen3", "llama", "qwen2", "mistral", "llama-mha", "llama3-rope", "dynamic-rope"])
@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_the_fast_decoder_samples_the_same_tokens_as_the_models_own_forward(kind, extra, adapter, monkeypatch):
    model = lm(kind, **extra)
    model = with_lora(model) if adapter == "lora" else model
    assert isinstance(decode.decoder_for(model), decode.LlamaFamilyDecoder), decode.llama_family_refusal(model)
    ids, mask = prompts()
    for kw in ({}, {"temperature": 0.0}, {"top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3}):
        fast, slow = both(model, monkeypatch, ids, mask, **kw)
        assert torch.equal(fast.ids, slow.ids), kw
        assert torch.equal(fast.mask, slow.mask) and torch.equal(fast.truncated, slow.truncated)


def test_logits_are_bit_identical_at_every_position_unpadded_and_padded():
    model = with_lora(lm("qwen3", head_dim=8))
    for ids, mask in (prompts(), (torch.randint(2, VOCAB, (4, 6)), torch.ones(4, 6, dtype=torch.long))):
        assert_same_logits(model, ids, mask, 5)


@pytest.mark.parametrize("rows", [[[7]], [[7, 8, 9]], [[7], [8]], [[5, 6], [7, 8, 9]]])
def test_fewer_distinct_prompts_than_a_matrix_kernel_takes_still_decode_bit_identically(rows, monkeypatch):
    # a group of 8 completions of one to two short prompts: fewer than 4 distinct rows to prefill
    model = with_lora(lm("qwen3", head_dim=8, hidden_size=64, intermediate_size=128))
    width = max(map(len, rows))
    rows = [r for r in rows for _ in range(8 // len(rows))]
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    assert_same_logits(model, ids, mask, 4)


def test_a_group_is_prefilled_once(monkeypatch):
    model = lm("qwen3", head_dim=8)
    seen = []
    original = decode.LlamaFamilyDecoder._prefill
    monkeypatch.setattr(decode.LlamaFamilyDecoder, "_prefill",
                        lambda self, ids, *rest: seen.append(ids.shape) or original(self, ids, *rest))
    ids, mask = prompts()
    decode.LlamaFamilyDecoder(model).start(ids, mask, 4)
    assert seen == [torch.Size([4, ids.size(1)])]          # 10 rows, 4 distinct prompts


def test_models_outside_the_family_are_sampled_through_their_own_forward(monkeypatch):
    model = lm("gpt2")
    assert "gpt2" in decode.llama_family_refusal(model)
    assert isinstance(decode.decoder_for(model), decode.TransformersDecoder)
    ids, mask = prompts()
    out = sampler.sample(model, ids, mask, max_new_tokens=6, temperature=1.0, eos_ids=(1,), pad_id=0,
                      generator=torch.Generator().manual_seed(0))
    assert out.ids.shape[0] == ids.size(0) and out.ids.size(1) <= 6


def test_sliding_window_attention_is_left_to_the_models_own_forward():
    model = lm("mistral", sliding_window=4)
    assert "sliding" in decode.llama_family_refusal(model)


def test_a_merged_adapter_is_left_to_the_models_own_forward():
    model = with_lora(lm("qwen3", head_dim=8))
    model.merge_adapter()
    assert "merged" in decode.llama_family_refusal(model)


def qlora(compute: torch.dtype):
    """A 4-bit QLoRA model over a random qwen3 (skipped where bitsandbytes cannot run here), its
    adapter trained-looking (B not zero)."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpo_run.trainer.model.policy import QLoRAUnavailable, check_qlora

    try:
        check_qlora(torch.device("cpu"))
    except QLoRAUnavailable as e:
        pytest.skip(str(e))
    with tempfile.TemporaryDirectory() as folder:
        lm("qwen3", head_dim=32, hidden_size=128, intermediate_size=256).save_pretrained(f"{folder}/tiny-qwen3")
        model = AutoModelForCausalLM.from_pretrained(
            f"{folder}/tiny-qwen3", dtype=compute, device_map={"": "cpu"},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=compute))
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_qlora_decodes_the_same_logits_and_tokens_as_the_models_own_forward(compute, monkeypatch):
    # bfloat16: the float32 adapter's output is cast before it is added, as PEFT does over bitsandbytes
    model = qlora(compute)
    assert isinstance(decode.decoder_for(model), decode.LlamaFamilyDecoder), decode.llama_family_refusal(model)
    ids, mask = prompts()
    assert_same_logits(model, ids, mask, 3)
    fast, slow = both(model, monkeypatch, ids, mask)
    assert torch.equal(fast.ids, slow.ids)


def test_ended_completions_leave_the_batch_and_the_others_draw_the_same_tokens(monkeypatch):
    # 16 rows, EOS likely (a strong EOS logit bias), so rows end at different lengths
    model = with_lora(lm("qwen3", head_dim=8))
    with torch.no_grad():
        model.get_base_model().lm_head.weight[1] += 0.6
    ids, mask = prompts()
    ids, mask = ids.repeat(2, 1)[:16], mask.repeat(2, 1)[:16]
    batches = []
    original = decode.LlamaFamilyDecoder._forward
    monkeypatch.setattr(decode.LlamaFamilyDecoder, "_forward",
                        lambda self, tokens: batches.append(tokens.size(0)) or original(self, tokens))
    fast, slow = both(model, monkeypatch, ids, mask, max_new_tokens=24)
    assert torch.equal(fast.ids, slow.ids) and torch.equal(fast.mask, slow.mask)
    lengths = fast.mask.sum(1)
    assert lengths.min() < lengths.max()                           # the rows did end at different steps
    assert max(batches) <= 16 and min(batches) < 16 and min(batches) >= decode.LlamaFamilyDecoder.MIN_ROWS
    assert batches == sorted(batches, reverse=True)


def test_the_compiled_decoder_draws_the_same_tokens_and_keeps_its_compiled_step(monkeypatch):
    model = with_lora(lm("qwen3", head_dim=8))
    ids, mask = prompts()
    compiled = decode.decoder_for(model, compiled=True)
    assert isinstance(compiled, decode.CompiledDecoder) and decode.decoder_for(model, compiled=True) is compiled
    for kw in ({}, {"temperature": 0.0}):
        fast, slow = both(model, monkeypatch, ids, mask, **kw)
        out = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(3), compiled=True,
                          **{"max_new_tokens": 12, "temperature": 1.0, "eos_ids": (1,), "pad_id": 0, **kw})
        assert torch.equal(out.ids, slow.ids) and torch.equal(out.mask, slow.mask), kw
    # another prompt width within the same bucket: the compiled step is reused, not compiled again
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    sampler.sample(model, ids[:, 1:], mask[:, 1:], generator=torch.Generator().manual_seed(3), compiled=True,
                max_new_tokens=12, temperature=1.0, eos_ids=(1,), pad_id=0)
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.mask.size(1) == decode.CompiledDecoder.PROMPT_BUCKET + 12


def test_a_kept_decoder_holds_no_cache_after_sampling():
    model = with_lora(lm("qwen3", head_dim=8))
    ids, mask = prompts()
    out = sampler.sample(model, ids, mask, max_new_tokens=4, temperature=1.0, eos_ids=(1,), pad_id=0,
                         generator=torch.Generator().manual_seed(0), keep_decoder=True)
    kept = getattr(model, decode.LlamaFamilyDecoder.kept_as)
    assert decode.decoder_for(model, keep=True) is kept and out.ids.size(1) >= 1
    assert kept.keys == [] and kept.values == [] and kept.logits is None      # nothing held through the update


# --- the update's forward ---------------------------------------------------------------------

def update_batch(padded: bool):
    """Prompts left-padded (or not) and completions right-padded, as the update gets them."""
    ids, mask = prompts() if padded else (torch.randint(2, VOCAB, (10, 5), generator=torch.Generator().manual_seed(4)),
                                          torch.ones(10, 5, dtype=torch.long))
    lengths = torch.tensor([6, 3, 1, 6, 4, 2, 5, 6, 1, 3]) if padded else torch.full((10,), 6)
    comp_mask = (torch.arange(6) < lengths.unsqueeze(1)).long()
    comp = torch.randint(2, VOCAB, (10, 6), generator=torch.Generator().manual_seed(5)) * comp_mask
    return ids, mask, comp, comp_mask


def logprobs_and_gradients(model, fast, batch):
    from grpo_run.trainer import grpo

    model.zero_grad(set_to_none=True)
    logps = grpo.completion_logprobs(model, *batch, 0.9, fast=fast)
    weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)          # every row and token counts
    (logps * weights * batch[3]).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind, extra", [
    ("qwen3", {"head_dim": 8}), ("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": None}),
    ("llama", {"num_key_value_heads": 4}),
], ids=["qwen3", "llama", "qwen2", "mistral", "llama-mha"])
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_the_updates_forward_gives_the_models_own_log_probabilities_and_gradients_bit_for_bit(
        kind, extra, method, checkpointing):
    model = lm(kind, **extra)
    base = model
    if method == "lora":
        model = with_lora(model)
        base = model.get_base_model()
    else:
        model.requires_grad_(True)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert llama.training_refusal(model) is None
    fast = decode.LlamaFamilyDecoder(model)
    calls = []
    for layer in base.model.layers:          # the fast forward checkpoints through the layers' own function
        if checkpointing:
            own = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, own=own, **k: calls.append(1) or own(*a, **k)
    for padded in (True, False):
        slow_logps, slow_grads = logprobs_and_gradients(model, None, update_batch(padded))
        calls.clear()
        fast_logps, fast_grads = logprobs_and_gradients(model, fast, update_batch(padded))
        assert len(calls) == (2 if checkpointing else 0)
        assert torch.equal(fast_logps, slow_logps), padded
        assert fast_grads.keys() == slow_grads.keys() and len(fast_grads) > 0
        for name, grad in slow_grads.items():
            assert torch.equal(fast_grads[name], grad), (padded, name)


def test_the_update_keeps_the_models_own_forward_where_the_decoders_arithmetic_would_differ():
    from peft import LoraConfig, get_peft_model

    dropout = get_peft_model(lm("qwen3", head_dim=8), LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear",
                                                                  task_type="CAUSAL_LM"))
    assert llama.training_refusal(dropout) == "LoRA dropout"
    assert llama.training_refusal(lm("llama", attention_dropout=0.1)) == "attention dropout"
    assert "gpt2" in llama.training_refusal(lm("gpt2"))
    plain = with_lora(lm("qwen3", head_dim=8))
    assert llama.training_refusal(plain) is None


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_updates_forward_over_a_4bit_base_gives_the_models_own_log_probabilities_and_gradients(compute):
    model = qlora(compute)
    model.train()
    assert llama.training_refusal(model) is None
    fast = decode.LlamaFamilyDecoder(model)
    slow_logps, slow_grads = logprobs_and_gradients(model, None, update_batch(True))
    fast_logps, fast_grads = logprobs_and_gradients(model, fast, update_batch(True))
    assert torch.equal(fast_logps, slow_logps)
    assert fast_grads.keys() == slow_grads.keys() and len(fast_grads) > 0
    for name, grad in slow_grads.items():
        assert torch.equal(fast_grads[name], grad), name
