"""An episode's ids at each turn boundary: the first prompt's, then, after each sampled reply, the
ids the environment's observation adds, rendered once and never re-tokenized with the history.

Text (a tokenizer without a chat template): the observation's text tokenized on its own, without
special tokens, and appended as it is.

Chat messages (a chat template): the template rendered with the conversation so far and the
reply as the assistant's message, once without the observation (`without`) and once with it and
the generation prompt (`with_`); `with_` must begin with `without`, and what it adds is the
observation's turn. What the template puts after the assistant's end-of-turn token (Qwen's
"\\n" after `<|im_end|>`) belongs to the boundary too and is kept (the newline a peer dropped at
every assistant-to-tool boundary); a reply cut before its end-of-turn token gets the template's
own end of turn, as environment tokens. The reply's text (derived from its sampled ids) is only
what the template is rendered with to find the boundary: the trained ids are the sampled ones.

Tools: a reply the tools answered is rendered as the template expects a tool-calling turn, the
assistant's message with its calls in `tool_calls` (read from the reply in the job's format,
grader.tools) and each result with the `tool_call_id` of its call (9 letters and digits, as
Mistral's template demands) and the tool's `name` (Hermes'). A template that refuses that shape
(Llama 3.1's: one call per turn) is rendered with the reply as the assistant's text instead.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError

from grpo_run.trainer.grader.tools import declared_tool_format, template_tool_format, tool_calls
from grpo_run.trainer.model.prompts import Message, Prompt, PromptEncoder, chat_messages

log = logging.getLogger(__name__)

# A vocabulary this small is listed in full in the warning (tiny:char's has 20 tokens).
LISTED_VOCABULARY = 64


def unknown_characters(tokenizer: Any, text: str) -> str:
    """The characters of `text` that `tokenizer` reads as its unknown token, each once in the order
    they first appear; "" when there are none, or the tokenizer has no unknown token (byte-level
    BPE, as Qwen's and Llama's: every text has ids of its own)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in tokenizer(text, add_special_tokens=False).input_ids:
        return ""
    return "".join(c for c in dict.fromkeys(text) if unk in tokenizer(c, add_special_tokens=False).input_ids)


def _as_text(text: Any) -> str:
    """A prompt or observation as one text: itself, or its chat messages' contents."""
    if isinstance(text, str):
        return text
    if isinstance(text, Sequence):
        return "".join(m["content"] for m in text if isinstance(m, Mapping) and isinstance(m.get("content"), str))
    return ""


def unknown_characters_problem(tokenizer: Any, text: Any, what: str) -> str | None:
    """One line saying that `what` (a prompt, an observation: text or chat messages) has
    characters `tokenizer` does not know, which the model reads as one and the same unknown token
    (two observations that differ only there look alike to it); None when it has none."""
    whole = _as_text(text)
    unknown = unknown_characters(tokenizer, whole)
    if not unknown:
        return None
    shown = " ".join(repr(c) for c in unknown[:20]) + (" ..." if len(unknown) > 20 else "")
    special = set(getattr(tokenizer, "all_special_tokens", []))
    known = [t for t in tokenizer.get_vocab() if t not in special] if len(tokenizer) <= LISTED_VOCABULARY else []
    reads = (f"; it reads only {''.join(sorted(known))!r} (docs/environments.md): write with those, or use a model "
             f"with a full vocabulary" if known else "")
    quoted = repr(whole) if len(whole) <= 60 else repr(whole[:57]) + "..."
    return (f"{what} {quoted} has characters the model's tokenizer does not know ({shown}): each becomes "
            f"{tokenizer.unk_token}, one and the same token to the model{reads}")


def readable(tokenizer: Any, ids: Sequence[int]) -> str:
    """`ids` as text for people (samples, logs): special tokens skipped, except the unknown token,
    which is shown (skipping it would show a reply the model never read: " higher:" and " lower:"
    both as ":" to tiny:char)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    hidden = set(tokenizer.all_special_ids) - {unk}
    return tokenizer.decode([t for t in ids if t not in hidden], skip_special_tokens=False)


class ToolFormatUnknown(ValueError):
    """A job with tools whose model's chat template has no tool-call format grpo-run reads: its
    calls would be read as answers, so the job is refused (with why)."""


def chat_template_text(tokenizer: Any) -> str | None:
    """The template `apply_chat_template(..., tools=...)` renders with: a tokenizer with several
    named templates uses its "tool_use" one for tools, as transformers does."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def tool_format_of(tokenizer: Any) -> str | dict[str, Any]:
    """The tool-call format of `tokenizer`: the one it declares (transformers' response parsing,
    `tokenizer.response_template`, as grader.tools.declared_tool_format reads it) when it declares
    one, else the one its chat template teaches (grader.tools.TOOL_FORMATS). Raises
    ToolFormatUnknown saying why there is none."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    declared = getattr(tokenizer, "response_template", None)
    if declared is not None:
        fmt, why = declared_tool_format(declared)
        if fmt is None:
            raise ToolFormatUnknown(f"{name}: {why}")
        template = chat_template_text(tokenizer)
        if not template or not re.search(r"\btools\b", template):          # the model would never see them
            raise ToolFormatUnknown(f"{name}: {template_tool_format(template)[1]}")
        return fmt
    fmt, why = template_tool_format(chat_template_text(tokenizer))
    if fmt is None:
        raise ToolFormatUnknown(f"{name}: {why}")
    return fmt


class BoundaryMismatch(ValueError):
    """The chat template renders the conversation so far differently once a turn is added, so the
    added turn's ids cannot be told apart from the history's without re-tokenizing it."""


class TurnRenderer:
    """Renders one tokenizer's prompts and observations to ids (through `encoder`, which holds
    the system prompt and the template's arguments)."""

    def __init__(self, encoder: PromptEncoder, eos_ids: Sequence[int]) -> None:
        self.encoder, self.tokenizer = encoder, encoder.tokenizer
        self.eos_ids = tuple(eos_ids)
        # with tools, the format their calls are read in (the worker reads them the same way)
        self.tool_format = tool_format_of(self.tokenizer) if encoder.template_kwargs.get("tools") else None
        self._unknown_told: set[str] = set()       # what was warned of (prompt, observation)

    def first(self, prompt: Prompt) -> tuple[list[int], list[Message] | None]:
        """The first prompt's ids, and the conversation it stands for (None without a template).
        Raises ValueError as PromptEncoder does (messages without a chat template)."""
        ids, mask = self.encoder.encode([prompt])            # exactly as a single-turn prompt's
        ids = ids[0][mask[0].bool()].tolist()
        self._tell_unknown(ids, prompt, "the episode's prompt")
        return ids, (chat_messages(prompt, self.encoder.system_prompt) if self.encoder.templated else None)

    def _tell_unknown(self, ids: Sequence[int], text: Any, what: str) -> None:
        """A warning (the terminal and trainer.log) the first time a prompt or an observation has
        characters the tokenizer does not know: the environment runs, but what it says is lost on
        the model. Once for prompts and once for observations per renderer (one per attempt), not
        on every turn; the warning lists what the tokenizer does read, when that is short."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if what in self._unknown_told or unk is None or unk not in ids:   # usually one membership test
            return
        problem = unknown_characters_problem(self.tokenizer, text, what)
        if problem:
            self._unknown_told.add(what)
            log.warning(problem)

    def observation(self, conversation: list[Message] | None, reply_ids: Sequence[int], reply: str,
                    observation: str | list[Mapping[str, Any]]) -> tuple[list[int], list[Message] | None]:
        """The ids appended after a reply (`reply_ids`, sampled; `reply`, their text) for the
        environment's `observation`, and the conversation afterwards."""
        if conversation is None:
            ids = self._text_ids(observation, "step's observation")
            self._tell_unknown(ids, observation, "the environment's observation")
            return ids, None
        added = [{"role": "user", "content": observation}] if isinstance(observation, str) else \
            [dict(m) for m in observation]
        plain: Message = {"role": "assistant", "content": reply}
        talked = [*conversation, plain]
        if self.tool_format and added and all(m.get("role") == "tool" for m in added):
            called, added = self._tool_turn(conversation, reply, added)
            try:                                   # the template's own shape of a tool-calling turn
                talked = [*conversation, called]
                without = self._render(talked, generation_prompt=False)
                with_ = self._render([*talked, *added], generation_prompt=True)
            except TemplateError:                  # the template's raise_exception: the reply as plain text
                talked = [*conversation, plain]
                without = self._render(talked, generation_prompt=False)
                with_ = self._render([*talked, *added], generation_prompt=True)
        else:
            without = self._render(talked, generation_prompt=False)
            with_ = self._render([*talked, *added], generation_prompt=True)
        if with_[:len(without)] != without:
            raise BoundaryMismatch(
                "the chat template renders the conversation so far differently once the environment's turn is "
                "added (it is not prefix-stable), so the turn's ids cannot be appended without re-tokenizing the "
                "history; use a template that renders earlier turns the same way whatever follows them")
        added_ids = with_[len(without):]
        self._tell_unknown(added_ids, observation, "the environment's observation")
        return self._after_reply(without, reply_ids) + added_ids, [*talked, *added]

    def _tool_turn(self, conversation: list[Message], reply: str,
                   results: list[dict[str, Any]]) -> tuple[Message, list[dict[str, Any]]]:
        """The assistant's message with the calls read from `reply`, and the tools' results paired
        with them in order (the worker answers each call, parsed or not, with one message)."""
        before = sum(1 for m in conversation if m.get("role") == "tool")     # ids unique in the conversation
        calls = tool_calls(reply, self.tool_format or "hermes")
        ids = [f"call{before + k:05d}" for k in range(len(results))]
        structured = [{"id": ids[k], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for k, c in enumerate(calls[:len(results)]) if isinstance(c, dict)]
        answered = []
        for k, message in enumerate(results):
            call = calls[k] if k < len(calls) else None
            named = call["name"] if isinstance(call, dict) else "error"       # a call that did not parse
            answered.append({**message, "tool_call_id": message.get("tool_call_id", ids[k]),
                             "name": message.get("name", named)})
        called: Message = {"role": "assistant", "content": reply}
        if structured:
            called["tool_calls"] = structured
        return called, answered

    def _after_reply(self, without: list[int], reply_ids: Sequence[int]) -> list[int]:
        """What the template renders after the assistant's reply, from its end-of-turn token on:
        the part after the sampled end-of-turn token, or (a reply cut short, or ended by another
        stop token) the template's end of turn itself and what follows it."""
        ended = bool(reply_ids) and reply_ids[-1] in self.eos_ids
        if ended and reply_ids[-1] in without:
            at = len(without) - 1 - without[::-1].index(reply_ids[-1])
            return without[at + 1:]
        ends = [i for i, t in enumerate(without) if t in self.eos_ids]
        return without[ends[-1]:] if ends else []

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 return_dict=False, **self.encoder.template_kwargs)
        return [int(t) for t in out]

    def _text_ids(self, text: Any, what: str) -> list[int]:
        if not isinstance(text, str):
            name = getattr(self.tokenizer, "name_or_path", "") or "this model"
            raise ValueError(f"the environment's {what} is chat messages, but the tokenizer of {name} has no chat "
                             "template to render them: return text, or use a model with a chat template")
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
