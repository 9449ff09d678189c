"""Sampling a group: autoregressive decoding with a KV cache and explicit generators, so a
seeded step replays exactly; stops between tokens when a preemption asks it to."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.sampling.decode import decoder_for
from grpo_run.trainer.sampling.filters import apply_repetition_penalty, top_k_filter, top_p_filter


class GenerationInterrupted(Exception):
    """Sampling was abandoned because a stop (preemption) was requested between tokens."""


class Completions(NamedTuple):
    ids: Tensor          # [N, T] completion tokens, pad after a completion ends
    mask: Tensor         # [N, T] 1 up to and including the token that ended it (EOS or a stop string's last)
    truncated: Tensor    # [N] bool: cut at max_new_tokens without an EOS or a stop string
    entropy: Tensor      # [N] float: summed over each completion's tokens, the entropy (nats) of the
                         # distribution its token was drawn from (after the filters); 0 when greedy
    logprobs: Tensor | None = None   # [N, T] the engine's log-probability of each sampled token (vLLM's;
                                     # None from the native decoder, whose are the trainer's own)


@torch.no_grad()
def sample(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
           eos_ids: Sequence[int], pad_id: int, generator: torch.Generator | Sequence[torch.Generator] | None,
           top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
           finished: Callable[[Tensor, Tensor], Tensor] | None = None,
           should_stop: Callable[[], bool] | None = None, compiled: bool = False,
           keep_decoder: bool = False, logprobs: bool = False) -> Completions:
    """Autoregressive sampling with a KV cache and an explicit generator (so it can be replayed).

    prompt_ids, prompt_mask [N, P] (left-padded). A completion ends at the first token in
    `eos_ids`, or at the token for which `finished(tokens [N, t], running [N] bool) -> [N] bool`
    says so (stop strings: the callback sees the tokens so far and answers for the running
    rows; the others are ignored). Returns Completions: ids [N, T<=max_new_tokens], mask [N, T],
    truncated [N].

    Each next token: repetition penalty on the raw logits (`repetition_penalty`, 1 = off; the
    prompt's tokens and those generated so far count, padding does not), then temperature, then
    top-k (0 = off), then top-p (1 = off), then one multinomial draw with `generator`; a list of
    generators splits the rows into as many equal consecutive blocks (one per prompt's group),
    each drawing from its own, so a group's draws do not depend on which rows sit beside it in
    the batch (on how many processes share the step). Temperature 0
    is greedy: argmax after the repetition penalty only. With the filters off the draws are
    exactly those of plain temperature sampling, so seeded runs replay unchanged. The update's
    log-probabilities (completion_logprobs) are of the temperature-scaled distribution only,
    not of the penalised or truncated one, as in TRL. Raises GenerationInterrupted when
    `should_stop()` turns true. `compiled`: the decode step compiled with static shapes
    (decode.CompiledDecoder; Llama-family models). `keep_decoder`: the fast decoder is kept with the
    model for the next call (decode.decoder_for's `keep`). The model decodes in eval mode (dropout
    off) and is left in the mode it was in. `logprobs`: Completions.logprobs holds each drawn
    token's log-probability under the temperature-scaled distribution (as completion_logprobs
    computes it: before the penalty and the filters), for asynchronous runs (trainer.ahead), whose
    drawing policy is gone by the time its rollouts are trained on.
    """
    decoder = decoder_for(model, compiled=compiled, keep=keep_decoder)
    training = bool(getattr(model, "training", False)) and decoder.needs_eval_mode
    if training:
        model.eval()
    try:
        return _sample(decoder, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                       eos_ids=eos_ids, pad_id=pad_id, generator=generator, top_k=top_k, top_p=top_p,
                       repetition_penalty=repetition_penalty, finished=finished, should_stop=should_stop,
                       logprobs=logprobs)
    finally:
        decoder.release()                 # a kept decoder does not hold its cache through the update
        if training:
            model.train()


def _sample(decoder, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
            eos_ids: Sequence[int], pad_id: int, generator, top_k: int, top_p: float,
            repetition_penalty: float, finished, should_stop, logprobs: bool = False) -> Completions:
    n, device = prompt_ids.size(0), prompt_ids.device
    logits = decoder.start(prompt_ids, prompt_mask, max_new_tokens)                 # [N, V]
    done = torch.zeros(n, dtype=torch.bool, device=device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    seen = None
    if repetition_penalty != 1.0:                                     # [N, V]: tokens seen so far
        seen = torch.zeros(n, logits.size(-1), dtype=torch.bool, device=device)
        keep = prompt_mask.bool()
        seen[rows.unsqueeze(1).expand_as(prompt_ids)[keep], prompt_ids[keep]] = True
    draws = _Draws(generator, n, logits.size(-1), max_new_tokens, device) if temperature > 0 else None
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)   # [N, T]
    masks = torch.zeros(n, max_new_tokens, dtype=torch.bool, device=device)             # [N, T]
    entropy = torch.zeros(n, dtype=torch.float32, device=device)                         # [N]
    drawn = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device) if logprobs else None   # [N, T]
    length = 0
    for t in range(max_new_tokens):
        if should_stop is not None and should_stop():
            raise GenerationInterrupted()
        raw = logits
        if seen is not None:
            logits = apply_repetition_penalty(logits.float(), seen, repetition_penalty)
        if temperature > 0:
            scaled = logits.float() / temperature
            if top_k > 0:
                scaled = top_k_filter(scaled, top_k)
            if top_p < 1.0:
                scaled = top_p_filter(scaled, top_p)
            probs = torch.softmax(scaled, dim=-1)
            nxt = draws.draw(probs, t)                                          # [N]
            entropy += torch.special.entr(probs).sum(-1).masked_fill_(done, 0.0)   # -p log p, 0 at p = 0
        else:
            nxt = logits.argmax(dim=-1)
        masks[:, t] = ~done
        if drawn is not None and temperature > 0:
            drawn[:, t] = torch.log_softmax(raw.float() / temperature, dim=-1).gather(1, nxt.unsqueeze(1)).squeeze(1)
        nxt.masked_fill_(done, pad_id)
        tokens[:, t], length = nxt, t + 1
        ended = torch.isin(nxt, eos)
        if finished is not None:
            running = ~(done | ended)
            if bool(running.any()):
                ended = ended | (finished(tokens[:, :length], running) & running)
        done = done | ended
        if bool(done.all()):
            break
        if seen is not None:
            seen[rows, nxt] = True
        logits = decoder.step(nxt, ~done)
    if draws is not None and not bool(torch.isfinite(entropy).all()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")   # multinomial's words
    return Completions(tokens[:, :length], masks[:, :length].long(), ~done, entropy,
                       None if drawn is None else drawn[:, :length] * masks[:, :length])


class _Draws:
    """One token per row, as `torch.multinomial(probs, 1, generator)` draws it for each block of rows
    with its own generator, without its per-call checks (a NaN or inf probability makes a NaN
    entropy, which `_sample` raises on at the end).

    torch draws one sample as argmax(p / q), q ~ Exp(1) drawn with `exponential_` over the rows'
    [rows, V] probabilities; its CPU generator fills a tensor element after element, so noise for
    the next `ahead` tokens drawn in one call per generator is the noise those tokens' calls would
    have drawn, and the tokens are the same (tests/trainer/sampling/test_sampling.py). On this machine's
    demo (8 generators, 8 tokens) multinomial's checks and per-call overhead were 1.4 ms of a 25 ms
    step. A large vocabulary, and any device but the CPU (a CUDA generator's stream depends on the
    call's shape), draws token by token into each block's rows of one buffer: the calls multinomial
    makes, without its checks and their device syncs. On a CPU the generators may end past noise
    for tokens never drawn (every completion ended first)."""

    AHEAD_ELEMENTS = 1 << 22      # at most 16 MB of float32 noise drawn ahead

    def __init__(self, generator, n: int, vocab: int, steps: int, device: torch.device) -> None:
        self.generators = generator if isinstance(generator, (list, tuple)) else [generator]
        self.n, self.block = n, n // len(self.generators)
        self.ahead = max(1, min(steps, self.AHEAD_ELEMENTS // (n * vocab))) if device.type == "cpu" else 1
        self.steps, self.vocab, self.device = steps, vocab, device
        self.noise: Tensor | None = None       # [ahead, N, V]
        self.start = 0                         # the token of noise[0]

    def draw(self, probs: Tensor, t: int) -> Tensor:
        """Token t's draw for probs [N, V] (float32) -> [N]."""
        if self.noise is None or t >= self.start + self.noise.size(0):
            self._draw_noise(t, probs.dtype)
        q = self.noise[t - self.start]
        return torch.div(probs, q, out=q).argmax(dim=-1)      # into the noise, as multinomial does

    def _draw_noise(self, t: int, dtype: torch.dtype) -> None:
        k = min(self.ahead, self.steps - t)
        if k == 1:                  # each block's rows (contiguous) filled in place: no copy of V-wide rows
            if self.noise is None or self.noise.size(0) != 1:
                self.noise = torch.empty(1, self.n, self.vocab, dtype=dtype, device=self.device)
            for i, g in enumerate(self.generators):
                self.noise[0, i * self.block:(i + 1) * self.block].exponential_(1, generator=g)
        else:
            blocks = [torch.empty(k, self.block, self.vocab, dtype=dtype, device=self.device)
                      .exponential_(1, generator=g) for g in self.generators]
            self.noise = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        self.start = t
