"""A tiny causal LM built locally, for the demo and the tests.

Nothing can be downloaded on these machines, so the demo builds its base model: a Qwen3-style
transformers config with a character-level tokenizer, saved with `save_pretrained` and loaded
back through the same `from_pretrained` path a hub id or a local checkpoint takes.

Why these numbers (measured while building the demo): at transformers' default
`initializer_range=0.02` a LoRA adapter cannot move the tied embeddings or the final norm far
enough and the policy stays at chance; at 0.1, with 2 layers x 64 hidden and a vocabulary of
single characters, LoRA r=8 learns `(a+b) mod 10` from ~0.1 to ~0.9 mean reward.

A job names it as `spec.model: tiny:char`; runner/home.py builds it once under
`$GRPO_RUN_HOME/models/` and reuses it. The build is deterministic (seeded), so every machine gets byte-identical weights.

`tiny:chat` is shaped like an instruct model instead: a byte-level BPE tokenizer with Qwen's
special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) and a Qwen-style Jinja chat
template, so chat prompts, system prompts and template arguments run offline as they do with
Qwen2.5 / Qwen3. Its weights are random: it exercises the path, it does not solve GSM8K.
`build_chat_model` also takes any Qwen3 config (Qwen3-0.6B's own, say) for measurements.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Every character the catalog environments use, one token each.
ALPHABET = "0123456789+=-:,| "
SPECIAL = ("<pad>", "<eos>", "<unk>")


def build_tokenizer():
    """A character-level fast tokenizer: one token per character of ALPHABET."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out: Path, *, seed: int = 0, head_dim: int = 16) -> Path:
    """Build the tiny model and tokenizer into `out` (atomically: a half-built folder is never seen).
    `head_dim` 64 (2 heads of 64 over a hidden size of 128, 1 KV head) gives the same model in a
    shape vLLM's CPU attention serves (it has no kernel for 16): the sampling-engine tests'."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = Path(out)
    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=64 if head_dim == 16 else 2 * head_dim, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4 if head_dim == 16 else 2,
        num_key_value_heads=2 if head_dim == 16 else 1, head_dim=head_dim, max_position_embeddings=128,
        initializer_range=0.1, tie_word_embeddings=True, rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        layer_types=["full_attention"] * 2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return _save_atomically(model, tok, Path(out))


# Qwen2.5 / Qwen3's chat format: each message between <|im_start|>ROLE\n and <|im_end|>\n; the
# generation prompt opens the assistant's turn; enable_thinking=false closes an empty think block
# as Qwen3's template does.
# With `tools`, as Qwen2.5 / Qwen3 render them: the schemas in the system turn, with how to call
# one (<tool_call>{"name": ..., "arguments": {...}}</tool_call>), and each tool's result in a
# <tool_response> block of a user turn (consecutive results share one).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- set ns.first = 1 %}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# What the BPE merges are learnt from: the words and digits of GSM8K-style problems and answers.
_CHAT_CORPUS = (
    "system user assistant You are a helpful assistant. Solve the problem step by step. "
    "Put the final answer in \\boxed{}. The answer is #### 0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 42 100 "
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? <think> </think> + - * / = $ % . , ? !"
)


def build_chat_tokenizer(vocab_size: int = 512):
    """A byte-level BPE fast tokenizer with Qwen's special tokens and chat template; EOS is
    `<|im_end|>` (an assistant turn ends there), padding `<|endoftext|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([_CHAT_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE,
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def build_chat_model(out: Path, *, seed: int = 0, config: dict | None = None) -> Path:
    """A Qwen3 causal LM with random weights and the chat tokenizer, saved into `out`.
    `config`: Qwen3Config fields over a tiny default (2 layers x 64 hidden); a vocab_size larger
    than the tokenizer's is allowed (ids past it decode to nothing), so Qwen3-sized logits can
    be measured with a small tokenizer."""
    model, tok = _chat_model(seed=seed, config=config)
    return _save_atomically(model, tok, Path(out))


def _chat_model(*, seed: int = 0, config: dict | None = None):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = build_chat_tokenizer()
    fields = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  initializer_range=0.02, tie_word_embeddings=True, rms_norm_eps=1e-6)
    fields.update(config or {})
    fields.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                  layer_types=["full_attention"] * fields["num_hidden_layers"])
    if fields["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {fields['vocab_size']} is smaller than the tokenizer's {len(tok)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**fields), dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]   # as Qwen's instruct models
    return model, tok


# tiny:chat-tools: tiny:chat set by hand to open every answer with one tool call, so the tools
# example (examples/calculator-tools) makes real calls on a model that knows nothing. The whole
# call is one token of its tokenizer, and the model is made a bigram one (each layer's attention
# and MLP write nothing), whose head puts that token after the newline that opens an assistant
# turn and <|im_end|> after it, each about 40 logits above the rest: a sampled reply is the call
# (the worker runs multiply(7, 35) and answers 245) at any temperature a job uses. Every other
# weight is tiny:chat's, random.
TOOL_LESSON_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 7, "b": 35}}\n</tool_call>'


def build_tool_chat_model(out: Path, *, seed: int = 0) -> Path:
    """tiny:chat-tools (above), saved into `out`. Deterministic: seeded."""
    import torch

    model, tok = _chat_model(seed=seed, config={"tie_word_embeddings": False})
    tok.add_tokens([TOOL_LESSON_CALL])
    model.resize_token_embeddings(len(tok))
    model.config.vocab_size = len(tok)
    call, end = tok.convert_tokens_to_ids(TOOL_LESSON_CALL), tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok("\n", add_special_tokens=False).input_ids[-1]
    with torch.no_grad():
        for layer in model.model.layers:             # the hidden state is the token's embedding, normed
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head[call] = 5.0 * embed[newline] / embed[newline].norm()
        head[end] = 5.0 * embed[call] / embed[call].norm()
    return _save_atomically(model, tok, Path(out))


def _save_atomically(model, tok, out: Path) -> Path:
    """save_pretrained into a staging folder renamed into place: a half-built folder is never seen."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    try:
        os.rename(staging, out)
    except OSError:
        # Another process built it first; theirs is identical (same seed), keep it.
        import shutil
        shutil.rmtree(staging, ignore_errors=True)
    return out


def build_named(name: str, out: Path) -> Path:
    """`tiny:NAME`'s model into `out` (runner.home names the folder): char, char64, chat, chat-tools.
    Raises ValueError for another name."""
    if name == "chat":
        return build_chat_model(out)
    if name == "chat-tools":
        return build_tool_chat_model(out)
    if name in ("char", "char64"):
        return build_tiny_model(out, head_dim=64 if name == "char64" else 16)
    raise ValueError(f"no tiny model {name!r}")
