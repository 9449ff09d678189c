"""Loading the policy: a causal LM from a hub id or a folder, wrapped for LoRA, QLoRA or Full."""

from __future__ import annotations

import logging

import torch

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.startup import clock

log = logging.getLogger(__name__)


class QLoRAUnavailable(RuntimeError):
    """bitsandbytes cannot run NF4 4-bit layers on this machine (missing, or no kernel for the device)."""


# glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MB); after
# that, sampling's per-token [N, vocab] buffers (19 MB for 32 completions over Qwen3's vocabulary)
# come from the heap, interleaved with the growing KV cache, and fragment it. Measured
# (bench/step_memory.py, 32 completions x 256 tokens, 151,936-token vocabulary, CPU, 2 cores):
# the sampling phase's resident set grew by 1.96 GB with the default, 0.14 GB with a fixed
# threshold; the step took 45.5 / 46.7 s fixed against 40.7 / 36.6 s sliding (mapping each such
# block costs page faults). Fixed at 8 MB: blocks that large are mapped and returned on free.
# Blocks of the tiny demo model and of GPU runs stay far below it.
MMAP_THRESHOLD_BYTES = 8 * 1024**2


def fix_mmap_threshold() -> bool:
    """Turn off glibc's sliding mmap threshold for this process (unless MALLOC_MMAP_THRESHOLD_
    is set, the user's own choice). True when it took effect; False off glibc."""
    import ctypes
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-3, MMAP_THRESHOLD_BYTES))      # -3: M_MMAP_THRESHOLD


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(device: torch.device) -> torch.dtype:
    # bf16 on GPUs that have it; fp32 on CPU, where bf16 matmuls are slow and less exact.
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def check_qlora(device: torch.device) -> None:
    """Quantize and multiply one small NF4 matrix on `device`, so a missing kernel is found before
    anything is spent. Raises QLoRAUnavailable saying what is missing."""
    try:
        import bitsandbytes as bnb  # noqa: F401
        from bitsandbytes.nn import Linear4bit
    except Exception as e:  # ImportError, or a CUDA-setup error raised at import
        raise QLoRAUnavailable(f"bitsandbytes cannot be imported ({type(e).__name__}: {e}); "
                               "install bitsandbytes>=0.45 or use method: LoRA") from None
    try:
        layer = Linear4bit(16, 16, bias=False, compute_dtype=compute_dtype(device), quant_type="nf4")
        layer = layer.to(device)
        layer(torch.ones(2, 16, device=device, dtype=compute_dtype(device)))
    except Exception as e:
        raise QLoRAUnavailable(f"bitsandbytes {bnb.__version__} has no working NF4 kernel for {device.type} "
                               f"({type(e).__name__}: {e}); use method: LoRA, or a bitsandbytes build for this device") from None


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    with clock().part("model load"):
        tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"          # prompts are left-padded so completions start together
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_path} has no EOS token: completions could never end")
    return tok


def eos_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a completion: the model's generation config's `eos_token_id` (an
    int, or a list as in Qwen's instruct models, [<|im_end|>, <|endoftext|>]) and the tokenizer's
    EOS, in that order, each once. A model without generation_config.json has the tokenizer's."""
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:                    # no generation_config.json (or no such file on the hub)
        configured = None
    if configured is not None:
        ids += [int(i) for i in (configured if isinstance(configured, (list, tuple)) else [configured])]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def load_policy(model_path: str, params: GRPOParams, device: torch.device):
    """The model to train, on `device`, with only the trainable parameters requiring grad.

    LoRA/QLoRA: a PEFT adapter over the frozen base (its reference for KL is the same model
    with the adapter disabled). Full: every parameter trains.
    """
    with clock().part("model load"):     # the node's path to its first step (trainer.startup)
        return _load_policy(model_path, params, device)


def _load_policy(model_path: str, params: GRPOParams, device: torch.device):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = compute_dtype(device)
    kwargs: dict = {"dtype": dtype}
    if params.method == "QLoRA":
        check_qlora(device)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if params.method != "QLoRA":
        model.to(device)
    if params.method == "Full":
        model.requires_grad_(True)
    else:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if params.method == "QLoRA":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        lora = params.lora
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.scaling_alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
            target_modules=lora.targetModules if isinstance(lora.targetModules, str) else list(lora.targetModules))
        torch.manual_seed(params.seed)   # the adapter's initial weights are part of the seeded run
        model = get_peft_model(model, config)
    if params.gradientCheckpointing:
        kwargs = {"use_reentrant": False}   # non-reentrant: works with frozen inputs (LoRA) without hooks
        if hasattr(model, "activation_checkpointing_enable"):      # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def load_reference(model_path: str, device: torch.device):
    """A frozen copy of the base, for KL with method Full (LoRA uses the disabled adapter)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=compute_dtype(device)).to(device)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


