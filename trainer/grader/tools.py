"""Tools for chat models, inside the environment's sandboxed worker: each tool's JSON schema
from its signature and docstring (the format transformers' `get_json_schema` writes and chat
templates render), the tool calls in a reply in the job's format (Qwen/Hermes `<tool_call>` JSON,
Llama 3.x JSON, Mistral `[TOOL_CALLS]`: TOOL_FORMATS; or as the tokenizer declares them), and
the calls run, each under its own time limit. Standard library only, as the worker is.

A reply with tool calls is answered by the tools, their results given back as "tool" messages
for the chat template to render; a reply without one goes to the environment's `step` (a job with
tools and no environment of its own: it is the episode's answer, and the episode ends). A tool
that raises, and a tool call that does not parse or names no tool, is answered with the error
as the tool's result: the model can read it and recover. A tool still running at its time limit
ends the episode ("toolTime"), with what it has.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any, Callable

from grpo_run.trainer.grader.calls import RewardTimeout, call_with_alarm, shown

# a reply's calls past these are answered with an error, not run; the supervisor's hang watchdog counts
# them in an episode's longest silence
MAX_TOOL_CALLS = 8

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
RESULT_CHARS = 4000        # a tool's result is cut here (with a note of how much more there was)
_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null",
           list: "array", tuple: "array", dict: "object", Any: None}


class ToolProblem(TypeError):
    """A function that cannot be a tool: said with the function's and the parameter's name."""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema: {"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties", "required"}, "return"?}}, as transformers'
    get_json_schema writes it for the same function. Every parameter needs a type hint, and the
    function a docstring (what the model reads to decide when to call it); raises ToolProblem."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not isinstance(name, str) or inspect.isclass(fn):
        raise ToolProblem(f"{shown(fn)} is not a function; a tool is a typed Python function with a docstring")
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ToolProblem(f"tool {name} has no docstring; say in one what it does (and each argument under Args:), "
                          "the model reads it to decide when to call it")
    description, args, returns = _parse_doc(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as error:
        raise ToolProblem(f"tool {name}: its type hints cannot be read ({type(error).__name__}: {error})") from None
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolProblem(f"tool {name}: *{param.name} / **{param.name} cannot be described to the model; "
                              "name each argument")
        if param.name not in hints:
            raise ToolProblem(f"tool {name}: argument {param.name!r} has no type hint; the model's schema comes from "
                              f"the hints (for example {param.name}: int)")
        prop = _json_type(hints[param.name], f"tool {name}: argument {param.name!r}")
        if param.name in args:
            prop["description"] = args[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    function: dict[str, Any] = {"name": name, "description": description,
                                "parameters": {"type": "object", "properties": properties}}
    if required:
        function["parameters"]["required"] = required
    if "return" in hints and hints["return"] is not type(None):
        function["return"] = _json_type(hints["return"], f"tool {name}: its return type")
        if returns:
            function["return"]["description"] = returns
    return {"type": "function", "function": function}


def _json_type(hint: Any, what: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SIMPLE:
        return {} if _SIMPLE[hint] is None else {"type": _SIMPLE[hint]}
    if origin is typing.Literal:
        kinds = sorted({_SIMPLE.get(type(a)) for a in args if type(a) in _SIMPLE} - {None})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            out = _json_type(rest[0], what)
        else:
            parts = [_json_type(a, what) for a in rest]
            out = {"type": [p["type"] for p in parts]} if all(set(p) == {"type"} for p in parts) else {"anyOf": parts}
        if len(rest) < len(args):
            out["nullable"] = True
        return out
    if origin in (list, set, frozenset):
        return {"type": "array", **({"items": _json_type(args[0], what)} if args else {})}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _json_type(args[0], what)}
        return {"type": "array", "prefixItems": [_json_type(a, what) for a in args]}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _json_type(args[1], what)} if len(args) == 2 else {})}
    raise ToolProblem(f"{what} is typed {hint!r}, which has no JSON schema type; use int, float, str, bool, a "
                      "list or dict of those, a Literal of choices, or Optional of one")


def _parse_doc(doc: str) -> tuple[str, dict[str, str], str]:
    """(description, {argument: its description}, what it returns) from a Google-style docstring."""
    sections = re.split(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises):\s*$", doc, flags=re.M)
    description = sections[0].strip()
    args: dict[str, str] = {}
    returns = ""
    for head, body in zip(sections[1::2], sections[2::2]):
        if head in ("Returns", "Return"):
            returns = " ".join(line.strip() for line in body.strip().splitlines())
        elif head != "Raises":
            current, indent = None, 0
            for line in body.splitlines():
                found = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
                if found and (current is None or len(line) - len(line.lstrip()) <= indent):
                    current, indent = found.group(1), len(line) - len(line.lstrip())
                    args[current] = found.group(2).strip()
                elif current is not None and line.strip():
                    args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args, returns


# The tool-call formats a reply is read in, one per job, chosen from the model's chat template
# (`template_tool_format`) and given to the worker in its config:
#   "hermes"   Qwen2.5/3, Hermes 2/3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number
#   "llama3"   Llama 3.1/3.2/3.3: the whole reply one JSON object {"name": ..., "parameters": {...}}
#              ("arguments" too), after <|python_tag|> or not; several separated by ";"
#   "mistral"  Mistral v0.3 / Nemo / Small: [TOOL_CALLS] then a JSON list of {"name", "arguments"}
# The trainer decodes replies without special tokens, and <|python_tag|> and [TOOL_CALLS] are
# special tokens of those tokenizers: their marker is read when it is there, and a reply that is
# exactly a call (a JSON list of calls, for Mistral) is a call without it.
# A tokenizer that declares its response format (transformers' `response_template`, read by
# `tokenizer.parse_response`) is read by that declaration instead: its "tool_calls" field's
# delimiters and transform, as `declared_tool_format` takes them, passed as a dict for `fmt`.
TOOL_FORMATS = ("hermes", "llama3", "mistral")
_HOW = {"hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        "llama3": '{"name": ..., "parameters": {...}} as the whole reply',
        "mistral": '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'}


def template_tool_format(template: str | None) -> tuple[str | None, str]:
    """The tool-call format a chat template teaches its model, from the template's own text, and
    (None, why) when it has none grpo-run reads: no template, a template that renders no tools,
    or one that renders them in another format. A job with tools is refused with the why."""
    if not template or not isinstance(template, str):
        return None, ("the tokenizer has no chat template, so the tools' schemas cannot reach the model; use an "
                      "instruct model with a chat template that renders tools")
    if not re.search(r"\btools\b", template):
        return None, ("its chat template does not render tools (it never reads `tools`), so the model would never "
                      "see them; use a model whose chat template supports tool calling (Qwen2.5/3, Llama 3.1+, "
                      "Mistral v0.3+, Hermes 2/3)")
    if "[TOOL_CALLS]" in template:
        return "mistral", ""
    if "<tool_call>" in template:
        return "hermes", ""
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3", ""
    return None, ("its chat template renders tools, but in a tool-call format grpo-run does not read (it reads "
                  "Qwen/Hermes <tool_call> JSON, Llama 3.x JSON calls and Mistral [TOOL_CALLS]); its calls would "
                  "be read as answers, so the job is refused")


def declared_tool_format(response_template: Any) -> tuple[dict[str, Any] | None, str]:
    """The tool-call field of a tokenizer's declared `response_template` (transformers' response
    parsing) as the worker reads it: {"open": [regex, ...], "close": [regex, ...], "transform",
    "transform_each"}; (None, why) when there is none, or it declares what the worker does not
    read (content parsed other than as plain JSON)."""
    fields = response_template.get("fields") if isinstance(response_template, dict) else None
    field = fields.get("tool_calls") if isinstance(fields, dict) else None
    if not isinstance(field, dict):
        return None, "its declared response_template has no \"tool_calls\" field"
    if field.get("content", "text") != "json" or set(field.get("content_args") or {}) - {"allow_non_json"}:
        how = f"{field.get('content', 'text')!r} {field.get('content_args') or ''}".strip()
        return None, (f"its declared response_template parses tool calls with content {how}; grpo-run's "
                      "sandboxed worker reads plain JSON tool calls only")
    anchors = {}
    for side in ("open", "close"):
        if f"{side}_pattern" in field:
            anchors[side] = [str(field[f"{side}_pattern"])]
        elif side in field:
            literal = field[side] if isinstance(field[side], list) else [field[side]]
            anchors[side] = [re.escape(str(text)) for text in literal]
        else:
            return None, f"its declared response_template's tool_calls field has no {side} delimiter"
    return {"open": anchors["open"], "close": anchors["close"], "transform": field.get("transform"),
            "transform_each": bool(field.get("transform_each"))}, ""


def tool_calls(reply: str, fmt: str | dict[str, Any] = "hermes") -> list[dict[str, Any] | str]:
    """The tool calls in `reply` written in format `fmt` (TOOL_FORMATS, or a declared format:
    declared_tool_format), in order: {"name", "arguments"} for each that parses, else the text
    saying what is wrong with it (told to the model as that call's result). [] for a reply that
    calls nothing."""
    if isinstance(fmt, dict):
        calls = _declared_calls(reply, fmt)
    elif fmt in TOOL_FORMATS:
        calls = {"hermes": _hermes_calls, "llama3": _llama3_calls, "mistral": _mistral_calls}[fmt](reply)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(TOOL_FORMATS)}, or a declared one")
    return [*calls[:MAX_TOOL_CALLS], *(f"error: at most {MAX_TOOL_CALLS} tool calls are answered per reply; this "
                                       "one was not run" for _ in calls[MAX_TOOL_CALLS:])]


def _hermes_calls(reply: str) -> list[dict[str, Any] | str]:
    calls = [_as_call(body, "hermes") for body in TOOL_CALL.findall(reply)]
    if not calls and "<tool_call>" in reply:
        calls.append("error: the tool call has no closing </tool_call>")
    return calls


def _llama3_calls(reply: str) -> list[dict[str, Any] | str]:
    text = reply.strip()
    tagged = text.startswith("<|python_tag|>")
    text = text.removeprefix("<|python_tag|>").strip()
    if not text.startswith("{") or '"name"' not in text:
        return [f"error: after <|python_tag|> write {_HOW['llama3']}"] if tagged else []
    values, rest = _json_values(text, ";")
    if values is None or rest:            # JSON-looking with a name, yet not only calls: a malformed call
        return [f"error: the tool call is not JSON ({rest or 'it does not parse'}); write {_HOW['llama3']}"]
    if not all(isinstance(v, dict) and "name" in v for v in values):
        return [] if not tagged else [f"error: write {_HOW['llama3']}"]
    return [_as_call(v, "llama3") for v in values]


def _mistral_calls(reply: str) -> list[dict[str, Any] | str]:
    text = reply.strip()
    at = text.find("[TOOL_CALLS]")
    if at >= 0:
        body = text[at + len("[TOOL_CALLS]"):].strip()
    elif text.startswith("[") and '"name"' in text:
        body = text                        # the marker, a special token, dropped by the decode
    else:
        return []
    values, rest = _json_values(body, "")
    if values is None or len(values) != 1 or rest:
        if at < 0:
            return []                      # without the marker only an exact list of calls is a call
        return [f"error: the tool calls are not one JSON list ({rest or 'it does not parse'}); write {_HOW['mistral']}"]
    listed = values[0] if isinstance(values[0], list) else [values[0]]
    if at < 0 and not all(isinstance(v, dict) and "name" in v for v in listed):
        return []
    empty = f"error: the list of tool calls is empty; write {_HOW['mistral']}"
    return [_as_call(v, "mistral") for v in listed] or [empty]


def _declared_calls(reply: str, fmt: dict[str, Any]) -> list[dict[str, Any] | str]:
    """Each region of `reply` between the declared open and close delimiters, its JSON shaped by
    the declared transform (placeholders "{content}", "{content.name}", "{NAME}" of a named group
    of the open delimiter, as transformers' response parsing fills them)."""
    opener = re.compile("|".join(f"(?:{p})" for p in fmt["open"]), re.S)
    closer = re.compile("|".join(f"(?:{p})" for p in fmt["close"]), re.S)
    calls: list[dict[str, Any] | str] = []
    at = 0
    while (opened := opener.search(reply, at)) is not None:
        closed = closer.search(reply, opened.end())
        body = reply[opened.end():closed.start() if closed else len(reply)]
        at = closed.end() if closed else len(reply)
        try:
            value = json.loads(body)
        except ValueError as error:
            calls.append(f"error: the tool call is not JSON ({error})")
            continue
        captures = {k: v for k, v in opened.groupdict().items() if v is not None}
        transform = fmt.get("transform")
        try:
            if transform is None:
                shaped = value if isinstance(value, list) else [value]
            elif fmt.get("transform_each"):
                shaped = [_transformed(transform, {**captures, **item}) for item in value]
            else:
                shaped = [_transformed(transform, {**captures, "content": value})]
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            calls.append(f"error: the tool call does not have the declared shape ({error})")
            continue
        for one in shaped:
            function = one.get("function", one) if isinstance(one, dict) else one
            calls.append(_as_call(function, "hermes") if isinstance(function, dict)
                         else "error: a tool call is a JSON object with a name and arguments")
    return calls


_PLACEHOLDER = re.compile(r"\{(\w+(?:\.\w+)*)\}")


def _transformed(transform: Any, scope: dict[str, Any]) -> Any:
    if isinstance(transform, dict):
        return {k: _transformed(v, scope) for k, v in transform.items()}
    if isinstance(transform, list):
        return [_transformed(v, scope) for v in transform]
    whole = _PLACEHOLDER.fullmatch(transform) if isinstance(transform, str) else None
    if not whole:
        return transform
    root, *keys = whole.group(1).split(".")
    value = scope[root]
    for key in keys:
        value = value[key]
    return value


def _json_values(text: str, separator: str) -> tuple[list[Any] | None, str]:
    """The JSON values `text` is made of (separated by `separator` or whitespace), and what is left
    after the last one ("" when nothing is); (None, the error) when the first does not parse."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError as error:
            return (None, str(error)) if not values else (values, text[at:].strip()[:80])
        values.append(value)
        while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
            at += 1
    return values, ""


def _as_call(body: Any, fmt: str) -> dict[str, Any] | str:
    """One call's JSON (text, or already parsed) as {"name", "arguments"}, or what is wrong with it."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError as error:
            return f"error: the tool call is not JSON ({error}); write {_HOW[fmt]}"
    arguments = body.get("arguments", body.get("parameters", {})) if isinstance(body, dict) else None
    if isinstance(arguments, str):                   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not isinstance(arguments, dict):
        return f"error: a tool call is {_HOW[fmt]}"
    return {"name": body["name"], "arguments": arguments}


class ToolTime(Exception):
    """A tool was still running at its time limit: the episode ends ("toolTime")."""


def answer_calls(tools: dict[str, Callable[..., Any]], calls: list[dict[str, Any] | str],
                 timeout_s: float) -> tuple[list[dict[str, str]], int]:
    """Each call's result as a "tool" message, and how many of them were errors. Raises ToolTime."""
    messages, errors = [], 0
    for call in calls:
        if isinstance(call, str):
            messages.append({"role": "tool", "content": call})
            errors += 1
            continue
        name, fn = call["name"], tools.get(call["name"])
        if fn is None:
            text, failed = f"error: there is no tool {name!r}; the tools are {', '.join(sorted(tools))}", True
        else:
            try:
                text, failed = _as_text(call_with_alarm(lambda: fn(**call["arguments"]), timeout_s)), False
            except RewardTimeout:
                raise ToolTime(f"tool {name} did not return within {timeout_s:g} s") from None
            except Exception as error:               # the model called it wrongly, or it failed: the model reads why
                text, failed = f"error: {type(error).__name__}: {error}", True
        messages.append({"role": "tool", "name": name, "content": _capped(text)})
        errors += failed
    return messages, errors


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _capped(text: str) -> str:
    return text if len(text) <= RESULT_CHARS else f"{text[:RESULT_CHARS]}... ({len(text) - RESULT_CHARS} more characters)"


class AnswerAfterTools:
    """The environment of a job with tools and no episodes class of its own: the task's prompt
    first; the first reply that calls no tool is the answer, and the episode ends there (the
    job's reward functions score the whole episode)."""

    def reset(self, task: dict, seed: int) -> Any:
        return task["prompt"]

    def step(self, reply: str) -> dict[str, Any]:
        return {"observation": None, "reward": 0.0, "done": True}
