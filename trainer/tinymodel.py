"""A tiny causal LM built locally, for the demo and the tests.

Nothing can be downloaded on these machines, so the demo builds its base model: a Qwen3-style
transformers config with a character-level tokenizer, saved with `save_pretrained` and loaded
back through the same `from_pretrained` path a hub id or a local checkpoint takes.

Why these numbers (measured while building the demo): at transformers' default
`initializer_range=0.02` a LoRA adapter cannot move the tied embeddings or the final norm far
enough and the policy stays at chance; at 0.1, with 2 layers x 64 hidden and a vocabulary of
single characters, LoRA r=8 learns `(a+b) mod 10` from ~0.1 to ~0.9 mean reward.

A job names it as `spec.model: tiny:char`; it is built once under `$GRPO_RUN_HOME/models/` and
reused. The build is deterministic (seeded), so every machine gets byte-identical weights.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TINY_PREFIX = "tiny:"
TINY_NAMES = ("char",)
# Every character the catalog environments use, one token each.
ALPHABET = "0123456789+=-:,| "
SPECIAL = ("<pad>", "<eos>", "<unk>")


def grpo_run_home() -> Path:
    return Path(os.environ.get("GRPO_RUN_HOME", Path.home() / ".grpo-run")).expanduser()


def is_tiny(model: str) -> bool:
    return model.startswith(TINY_PREFIX)


def tiny_model_path(model: str) -> Path:
    """Where `tiny:NAME` lives once built. Raises ValueError for an unknown NAME."""
    name = model[len(TINY_PREFIX):]
    if name not in TINY_NAMES:
        raise ValueError(f"unknown tiny model {model!r}; available: " + ", ".join(TINY_PREFIX + n for n in TINY_NAMES))
    return grpo_run_home() / "models" / f"tiny-{name}"


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


def build_tiny_model(out: Path, *, seed: int = 0) -> Path:
    """Build the tiny model and tokenizer into `out` (atomically: a half-built folder is never seen)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = Path(out)
    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        initializer_range=0.1, tie_word_embeddings=True, rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        layer_types=["full_attention"] * 2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
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


def ensure_model(model: str) -> str:
    """Resolve `spec.model` to what `from_pretrained` takes: builds `tiny:*` on first use."""
    if not is_tiny(model):
        return model
    path = tiny_model_path(model)
    if not (path / "config.json").exists():
        build_tiny_model(path)
    return str(path)
