"""The decoder behind sampling: a prompt's prefill, then one forward per new token.

Two implementations of one small interface (`start`, then `step` per token):

- `LlamaFamilyDecoder` for Llama, Mistral, Qwen2 and Qwen3 models (plain, LoRA or QLoRA): the
  KV cache and the attention mask are allocated once for the whole completion and written in
  place; each prompt is prefilled once and its cache shared by its G completions; a token's
  forward is the family's own arithmetic (trainer.model.llama), without the library's per-call
  machinery. On the 2-layer demo model that machinery was most of a token's time (profile in
  bench/sampler.py).
- `TransformersDecoder` for every other model: the model's own forward with its own cache.

Both compute the same thing, so a seeded run draws the same tokens with either (tests/trainer/
test_decode.py compares them token for token on every supported architecture).
"""

from __future__ import annotations

import inspect
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_run.trainer.model.llama import (LlamaFamily, Layer, attention, base_of, causal_over, last_logits,
                                          llama_family_refusal)

log = logging.getLogger(__name__)



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
    params = inspect.signature(type(base_of(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"




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

class LlamaFamilyDecoder(LlamaFamily):
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
    uncompacted decoder in tests/trainer/sampling/test_decode.py; CPU matrix products of fewer than 4 rows
    take another kernel, hence MIN_ROWS), and when to compact depends only on the tokens drawn,
    so a seeded run replays exactly.
    """

    COMPACT_SHARE = 0.75
    MIN_ROWS = 4
    needs_eval_mode = False   # its arithmetic is eval mode's whatever the modules' mode (no dropout)
    rope_table_at_start = True
    kept_as = "_grpo_run_decoder"     # the model's attribute that keeps it (`of`)

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
        attn = causal_over(mask) if self.padded else None                              # [U, 1, P, P]
        keys, values = [], []

        def attend(layer: Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            keys.append(k)
            values.append(v)
            return attention(q, k, v, attn, layer)
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

        def attend(layer: Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            self.keys[i][:, :, t:t + 1] = k
            self.values[i][:, :, t:t + 1] = v
            return attention(q, self.keys[i][:, :, :t + 1], self.values[i][:, :, :t + 1], mask, layer)
        h = self._layers(self.embed(tokens.unsqueeze(1)), self.next_position, attend)  # [M, 1, C]
        self.length, self.next_position = t + 1, self.next_position + 1
        return self.head(h)[:, -1]

class CompiledDecoder(LlamaFamilyDecoder):
    """LlamaFamilyDecoder with static shapes, so its decode step can be compiled once and, on a GPU,
    replayed as one CUDA graph instead of hundreds of kernel launches (spec.parameters.compileDecode).

    The cache and the mask keep their shapes for the whole completion: prompts are left-padded to
    a multiple of PROMPT_BUCKET positions (so steps with prompts of other lengths reuse the same
    compiled step), every token attends over all P+T positions through the mask, the position
    written is a tensor, and ended completions stay in the batch. The step goes through
    torch.compile (mode "reduce-overhead" on CUDA: CUDA graphs), compiled once per batch shape and
    kept with the model. The arithmetic is the same as LlamaFamilyDecoder's, but compiled kernels
    may round differently: tests/trainer/sampling/test_decode.py checks on CPU that a seeded run draws the
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

        def attend(layer: Layer, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
            keys[i].index_copy_(2, position, k)
            values[i].index_copy_(2, position, v)
            return attention(q, keys[i], values[i], attn, layer)
        h = self._layers(self.embed(tokens.unsqueeze(1)), positions, attend)
        return self.head(h)[:, -1]

