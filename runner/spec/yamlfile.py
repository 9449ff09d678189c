"""A job file's bytes -> text -> YAML document, every step bounded, so a broken or hostile file
is refused at once with a whole-file problem instead of a traceback, a full memory or a stack
overflow: too large, not UTF-8, nested too deeply, aliases that expand to millions of values
(a "billion laughs" file), an alias inside its own anchor, a key given twice.

`value_problems` then checks the values wherever they are, for documents from a file or from
code alike: nesting and size again, integers outside 64 bits, nan and inf, lone surrogates, keys
that are not text. `runner.job` turns all of it into a JobError beside the problems of each field.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, SequenceNode

from grpo_run.trainer.config import fmt

MAX_BYTES = 1024 * 1024   # a job file is a few hundred bytes; tasks and data live in files of their own
MAX_DEPTH = 32            # levels of nesting, the file's mapping 1; spec.environment.rewards[0].weight is 6
MAX_VALUES = 100_000      # values (keys, items, scalars) once aliases are expanded; a job has a few dozen
INT64 = 2**63             # every integer in a job fits in 64 bits (torch, numpy and SQLite take no more)
_PRINTABLE_BITS = 14_000  # str() of an int refuses past 4,300 digits (about 14,280 bits)
_DEEPEST = "a job's deepest field, spec.environment.rewards[0].weight, is 6 levels down"
_SURROGATE = re.compile("[\ud800-\udfff]")

_MERGE = "tag:yaml.org,2002:merge"
_INT = "tag:yaml.org,2002:int"


class FileRefused(ValueError):
    """The whole file is unusable (too large, not UTF-8, too deep, ...); the message says why and what to do."""


class HugeInt:
    """An integer too long for Python to read from text (over 4,300 digits): kept as its digit count, so
    runner.job names the field it was given for instead of the YAML reader failing."""

    def __init__(self, text: str):
        self.digits = sum(c.isdigit() for c in text)
        self.negative = text.lstrip().startswith("-")

    def __repr__(self) -> str:
        return f"{'-' if self.negative else ''}an integer of {self.digits:,} digits"


def read_text(path: Path) -> str:
    """The file's text. Raises FileNotFoundError, or FileRefused when it is not a readable UTF-8
    file of at most MAX_BYTES (read no further than that, whatever its size says)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise FileRefused("is a folder, not a file: give the job's YAML file") from None
    except OSError as e:
        raise FileRefused(f"cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        size = _size_of(path)
        raise FileRefused(f"too large: {size} (at most {MAX_BYTES // 1024 ** 2} MiB); a job file holds settings, "
                          "tasks and data go in files that spec.environment names")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FileRefused(f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column {column} cannot be "
                          "read; save the file as UTF-8") from None


def _size_of(path: Path) -> str:
    try:
        return f"{path.stat().st_size:,} bytes"
    except OSError:
        return f"over {MAX_BYTES:,} bytes"


def load(text: str) -> Any:
    """The single YAML document in `text` (plain YAML types only, as yaml.safe_load). Raises
    yaml.YAMLError for text that is not YAML, FileRefused for YAML past the bounds above."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _where(node_or_event: Any) -> str:
    mark = node_or_event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts while it composes, before any Python value is built: nesting
    depth (the composer recurses, so 10,000 `[` would overflow the stack) and the size of each
    node with its aliases expanded (memoised per node, so a bomb is refused in microseconds)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._size: dict[int, int] = {}     # id(node) -> values in it, aliases expanded
        self._written = 0                   # values as written (aliases count 1)

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._size:
                raise FileRefused(f"{_where(event)}: the alias *{event.anchor} is inside its own anchor "
                                  f"&{event.anchor}, so the value would contain itself; write the value out")
            self._written += 1
            return super().compose_node(parent, index)      # an undefined alias: PyYAML's own error
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise FileRefused(f"{_where(self.peek_event())}: nested more than {MAX_DEPTH} levels deep; "
                              + _DEEPEST)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._written += 1
        size = 1 + sum(self._size[id(child)] for child in _children(node))
        if size > MAX_VALUES:
            if self._written > MAX_VALUES:
                raise FileRefused(f"more than {MAX_VALUES:,} values; a job file has a few dozen: "
                                  "tasks and data go in files that spec.environment names")
            raise FileRefused(f"{_where(node)}: its aliases expand to more than {MAX_VALUES:,} values "
                              "(a \"billion laughs\" file?); write the values out, or use fewer aliases")
        self._size[id(node)] = size
        return node

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        """As yaml.SafeLoader, but a key given twice is an error (YAML says keys are unique; PyYAML
        would keep the last silently, and a typo must never be silently ignored)."""
        if isinstance(node, MappingNode):
            first: dict[Any, Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:            # an unhashable key: PyYAML's own error below
                    continue
                if seen is not key_node:
                    raise ConstructorError(None, None, f"duplicate key {key!r} (first on line "
                                           f"{seen.start_mark.line + 1}); give each key once",
                                           key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Node) -> int | HugeInt:
        try:
            return super().construct_yaml_int(node)
        except ValueError as e:
            if "digits" in str(e):               # Python reads at most 4,300 digits from text
                return HugeInt(str(node.value))
            raise _unreadable(node, "an integer", e) from None
        except IndexError as e:                  # PyYAML on `!!int` with no digits
            raise _unreadable(node, "an integer", e) from None


def _unreadable(node: Node, kind: str, e: Exception) -> ConstructorError:
    why = f" ({e})" if isinstance(e, ValueError) else ""
    return ConstructorError(None, None, f"{str(node.value)[:40]!r} is not {kind}{why}; put it in quotes to keep "
                            "it as text", node.start_mark)


def _guarded(construct: Any, kind: str) -> Any:
    """PyYAML's constructor for `kind`, with what it raises on a bad value (`2001-02-30`, `!!bool maybe`,
    `!!float` alone: ValueError, KeyError, ...) turned into a YAML error at the value's line."""
    def guarded(loader: _BoundedLoader, node: Node) -> Any:
        try:
            return construct(loader, node)
        except (ValueError, IndexError, KeyError, AttributeError, OverflowError) as e:
            raise _unreadable(node, kind, e) from None
    return guarded


_BoundedLoader.add_constructor(_INT, _BoundedLoader.construct_yaml_int)
for _tag, _kind in (("float", "a number"), ("bool", "true or false"), ("timestamp", "a date")):
    _tag = f"tag:yaml.org,2002:{_tag}"
    _BoundedLoader.add_constructor(_tag, _guarded(yaml.SafeLoader.yaml_constructors[_tag], _kind))


# --- the values, wherever they are ------------------------------------------------------------

def value_problems(doc: dict) -> tuple[list[str], dict[str, str], list[str]]:
    """What is wrong with the values themselves, wherever they are, before pydantic looks:
    (problems with the whole document, which stop validation: nested past MAX_DEPTH, more than
    MAX_VALUES values, an integer too long to print, a key with a lone surrogate;
    {path: problem} for an integer outside 64 bits, nan or inf, a string with a lone surrogate;
    problems with keys that are not text, which pydantic names by a wrong path or not at all).
    Iterative and bounded, so a document that contains itself is refused too."""
    found: dict[str, str] = {}
    bad_keys: list[str] = []
    stack: list[tuple[tuple, Any, int, bool]] = [((), doc, 1, True)]   # (where, value, depth, report it)
    seen = 0
    while stack:
        loc, v, depth, report = stack.pop()
        seen += 1
        where = _loc(loc)
        if seen > MAX_VALUES:
            return [f"more than {MAX_VALUES:,} values; a job has a few dozen: tasks and data go in files "
                    "that spec.environment names"], {}, []
        if depth > MAX_DEPTH:
            return [f"{_loc(loc[:3])}: nested more than {MAX_DEPTH} levels deep (or it contains itself); "
                    + _DEEPEST], {}, []
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > _PRINTABLE_BITS:
            return [f"{where or 'the file'}: {int_text(v)}; numbers in a job fit in 64 bits"], {}, []
        if isinstance(v, dict):
            for k, x in reversed(v.items()):
                if loc == () and k == "status":      # what a stored job says about itself: not checked
                    continue
                if isinstance(k, str) and _SURROGATE.search(k):          # pydantic cannot even name it
                    return [f"{_loc(loc + (k,))}: this key {_surrogate(k)}"], {}, []
                if not isinstance(k, str):
                    if isinstance(k, int) and not isinstance(k, bool) and k.bit_length() > _PRINTABLE_BITS:
                        return [f"{where or 'the file'}: a key is {int_text(k)}; keys are names"], {}, []
                    if report:
                        bad_keys.append(f"{where + ': has' if where else 'the file has'} a key that is not text "
                                        f"(got {int_text(k)}): put it in quotes; unquoted, YAML reads yes, no, "
                                        "true and false as booleans and digits as numbers")
                    stack.append((loc + ("[key]",), k, depth + 1, False))
                stack.append((loc + (k,), x, depth + 1, report and isinstance(k, str)))
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += [(loc + (i,), x, depth + 1, report) for i, x in reversed(list(enumerate(v)))]
        elif not report:
            continue
        elif isinstance(v, HugeInt) or (isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64):
            found[where] = (f"{where}: must be between -2**63 and 2**63-1 (got {int_text(v)}): numbers in a job "
                            "fit in 64 bits")
        elif isinstance(v, float) and not math.isfinite(v):
            found[where] = (f"{where}: must be a finite number (got {v}): give a number, or leave the field out "
                            "for its default")
        elif isinstance(v, str) and _SURROGATE.search(v):
            found[where] = f"{where}: {_surrogate(v)} (got {fmt(v)})"
    return [], found, bad_keys


def _loc(loc: tuple) -> str:
    return ".".join(map(str, loc))


def int_text(v: Any) -> str:
    """An integer (or any key) as a problem shows it: shortened, and never str() of one too long to print."""
    if isinstance(v, HugeInt) or not isinstance(v, int) or isinstance(v, bool):
        return repr(v) if isinstance(v, HugeInt) else fmt(v)
    if v.bit_length() > _PRINTABLE_BITS:
        return f"an integer of about {int(v.bit_length() * math.log10(2)):,} digits"
    text = str(v)
    digits = len(text.lstrip("-"))
    return text if digits <= 30 else f"{text[:12]}…{text[-6:]}, {digits:,} digits"


def _surrogate(text: str) -> str:
    code = ord(_SURROGATE.search(text).group())
    return (f"has a lone surrogate \\u{code:04x}, which is not a character (a \\u escape for half of a "
            "UTF-16 pair?); write the character itself")
