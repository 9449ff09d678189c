"""Prompts as the model reads them: a task's `prompt` (text, or a list of chat messages) to ids.

With a tokenizer that has a chat template, every prompt goes through it exactly as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
**chatTemplateKwargs)` would render it, where messages are the system prompt (unless the task
brings its own system message) followed by the task's messages, or by one user message for a
text prompt. Without a template, text prompts are tokenized as they are and messages are refused.
Batches are left-padded (completions then start in the same column).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Sequence, Union

import torch

Message = dict[str, Any]            # {"role": "user", "content": "..."} (other keys pass to the template)
Prompt = Union[str, Sequence[Message]]

# Distinct prompts whose rendered ids are kept: a data set's worth for most (GSM8K has 7,473),
# without holding every prompt of a million-row one.
CACHE_SIZE = 2**16


def chat_messages(prompt: Prompt, system_prompt: str | None = None) -> list[Message]:
    """The conversation a prompt stands for: [system prompt] + the task's messages, or + one user
    message for text. A system message already in the task's messages wins over `system_prompt`.
    Raises ValueError for anything that is neither text nor a list of {role, content} messages."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _checked_messages(prompt)
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _checked_messages(prompt: Any) -> list[Message]:
    ok = (isinstance(prompt, (list, tuple)) and len(prompt) > 0
          and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in prompt))
    if not ok:
        shown = repr(prompt)
        raise ValueError("a task's prompt must be text or a list of chat messages like "
                         "[{\"role\": \"user\", \"content\": \"...\"}] "
                         f"(got {shown[:120] + '...' if len(shown) > 120 else shown})")
    return [dict(m) for m in prompt]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class PromptEncoder:
    """Turns task prompts into left-padded id batches for one tokenizer; renders each distinct
    prompt once (an LRU of CACHE_SIZE prompts)."""

    def __init__(self, tokenizer, *, system_prompt: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.templated = has_chat_template(tokenizer)
        self._rendered = functools.lru_cache(maxsize=CACHE_SIZE)(self._render)
        self._tokenized = functools.lru_cache(maxsize=CACHE_SIZE)(self._tokenize)

    def encode(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, attention mask [N, P] (CPU, left-padded with the pad id). Raises ValueError for a
        message prompt, a system prompt or template arguments when the tokenizer has no chat
        template, and for a prompt that is neither text nor messages."""
        if not self.templated:
            return self._raw(prompts)
        return self._left_padded([self.ids(p) for p in prompts])

    def _left_padded(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        # built as lists, then one tensor each: a tensor per row cost more than the rows' ids
        width, pad = max(len(r) for r in rows), self.tokenizer.pad_token_id
        ids = [[pad] * (width - len(row)) + list(row) for row in rows]
        mask = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def ids(self, prompt: Prompt) -> tuple[int, ...]:
        """One prompt's ids through the chat template (cached by its text or its messages' JSON)."""
        key = prompt if isinstance(prompt, str) else json.dumps(_checked_messages(prompt), sort_keys=True,
                                                                   ensure_ascii=False, default=str)
        return self._rendered(key, isinstance(prompt, str))

    def _tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokenizer(text)["input_ids"])

    def _render(self, key: str, is_text: bool) -> tuple[int, ...]:
        messages = chat_messages(key if is_text else json.loads(key), self.system_prompt)
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, **self.template_kwargs)
        return tuple(int(t) for t in out)

    def _raw(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        # No template: text as it is, tokenized in one call (byte-identical to before templates).
        name = getattr(self.tokenizer, "name_or_path", "") or "this model"
        fix = ("use a model whose tokenizer has a chat template (an instruct model), "
               "or set the tokenizer's chat_template")
        for p in prompts:
            if not isinstance(p, (str, list, tuple)):
                _checked_messages(p)                  # raises: neither text nor messages
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"a task's prompt is a list of chat messages, but the tokenizer of {name} has no chat "
                             f"template to render them: give the prompts as text, or {fix}")
        for field, value in (("systemPrompt", self.system_prompt), ("chatTemplateKwargs", self.template_kwargs)):
            if value:
                raise ValueError(f"spec.parameters.{field} needs a chat template, and the tokenizer of {name} "
                                 f"has none: leave {field} out, or {fix}")
        if self.tokenizer.padding_side == "left":
            # each distinct text tokenized once, then kept: the rows the tokenizer's own padded
            # batch gives (a test compares them), without its call every step (about 2 ms a step
            # on the demo's 2 cores, its threads contending with torch's)
            return self._left_padded([self._tokenized(p) for p in prompts])
        # each distinct prompt once (a step repeats each G times): the same left-padded rows
        where = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        enc = self.tokenizer(list(where), return_tensors="pt", padding=True)
        if len(where) == len(prompts):
            return enc.input_ids, enc.attention_mask
        rows = torch.tensor([where[p] for p in prompts])
        return enc.input_ids[rows], enc.attention_mask[rows]
