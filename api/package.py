"""A reward written as a Python function, packaged to travel with its job.

`grpo_run.train(rewards=[fn])` turns each function into one small module file: the function's
own source, and what it uses from its module, found by name: the modules it imports (`import
re`), names it imports from installed modules (`from math import isclose`), the functions and
classes of its own module it calls (their source, recursively), constants (numbers, text, and
tuples, lists, dicts and sets of them, written back as literals), and standard-library objects
its module's source makes with one assignment (`PATTERN = re.compile(...)`: the statement). The file is one of the
job's environment files (runner/jobs/envfiles.py), so it is hashed into the spec, copied to the job's
storage under the lease and fetched, checked, by any node that resumes the job; the grader
imports it inside its sandbox, never the supervisor or the CLI; the evaluation cache's
fingerprint covers its bytes.

Source, not cloudpickle (the mechanism Ray and Modal use): the packaged file is text a person
can read in the bucket and in `get tj -o yaml`'s hashes, it needs no new dependency and no
unpickling on the node (unpickling runs whatever the bytes say, before the sandbox could judge
it), and a function defined in a notebook cell or in `__main__` packages the same way as one in
a module. What source cannot carry is refused here, with the reason and what to write instead:
a lambda or a function whose source is gone, a closure, a decorated function, a builtin or a C
extension's function, a live object it reads as a global (a model, a tokenizer, an open file; a
standard-library object made in a notebook cell, which has no module source to read it from),
and a module that is not installed (a file next to the script: the node would not have it).
Stdlib only: this runs in the user's process before anything else of the job.
"""

from __future__ import annotations

import ast
import inspect
import sys
import sysconfig
import textwrap
import types
from pathlib import Path
from typing import Any

# The folders an installed module lives under (the stdlib's, site-packages): a module elsewhere (a
# file next to the user's script) would not be on the node that resumes the job.
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_LITERALS = (bool, int, float, complex, str, bytes, type(None))


class Unpackable(ValueError):
    """A reward function that cannot travel with the job; the message names it, says why and what
    to write instead."""


def package_reward(fn: Any, kind: str = "reward") -> str:
    """The source of a module that defines `fn` (under its own name) and everything it uses from
    its module; `kind`: what it is to the job, in messages ("reward", "tool"). Raises Unpackable."""
    label = _label(fn, kind)
    _check_function(fn, label)
    found = _Found(fn.__globals__, label)
    found.visit(fn)
    return _module_text(found, f"{kind} {fn.__name__}", fn)


def package_environment(cls: Any) -> str:
    """The source of a module that defines the episodes environment class `cls` (under its own
    name) and everything its methods use from its module, as package_reward does for a function
    (`from grpo_run import Step` stays an import: grpo-run is on every node). Raises Unpackable."""
    label = f"episodes {getattr(cls, '__qualname__', None) or type(cls).__name__}"
    if not isinstance(cls, type):
        raise Unpackable(f"{label} is a {type(cls).__name__}, not a class: give the class itself (episodes=Guess), "
                         "with reset(self, task, seed) and step(self, reply)")
    if "<locals>" in cls.__qualname__:
        raise Unpackable(f"{label} is defined inside a function: define it at the top level of your module or notebook")
    module = sys.modules.get(cls.__module__)
    found = _Found(vars(module) if module is not None else {}, label)
    found.visit(cls)
    return _module_text(found, f"environment {cls.__name__}", cls)


def _module_text(found: _Found, what: str, obj: Any) -> str:
    origin = getattr(inspect.getmodule(obj), "__file__", None) or "an interactive session"
    lines = [f'"""The {what}, packaged by grpo_run.train() from {Path(origin).name}: its source and what it'
             ' uses."""', "", "from __future__ import annotations", ""]
    lines += sorted(found.imports)
    if found.imports:
        lines.append("")
    lines += [f"{name} = {text}" for name, text in found.constants.items()]
    lines += list(found.assignments.values())
    if found.constants or found.assignments:
        lines.append("")
    for source in found.sources.values():
        lines += ["", source.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def _label(fn: Any, kind: str = "reward") -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{kind} {name}"


def _check_function(fn: Any, label: str) -> None:
    if isinstance(fn, types.MethodType):
        raise Unpackable(f"{label} is a bound method: its object cannot travel with the job; write a plain "
                         "function with def at the top level of your module or notebook")
    if not isinstance(fn, types.FunctionType):
        raise Unpackable(f"{label} is a {type(fn).__name__}, not a Python function written with def (a builtin, a C "
                         "extension's function or a callable object has no source to send): wrap it in a def at the "
                         "top level of your module or notebook")
    if fn.__name__ == "<lambda>":
        raise Unpackable(f"{label} is a lambda: give it a name with def at the top level of your module or notebook, "
                         "so its source can travel with the job")
    if fn.__closure__:
        raise Unpackable(f"{label} closes over {', '.join(fn.__code__.co_freevars)} from the function that made it: "
                         "those live values cannot travel with the job; define it at the top level and pass what it "
                         "needs through the task's columns, or as constants of its module")
    if "<locals>" in fn.__qualname__:
        raise Unpackable(f"{label} is defined inside another function: define it at the top level of your module or "
                         "notebook")


class _Found:
    """What a reward uses from its module's globals, gathered by visit()."""

    def __init__(self, module_globals: dict[str, Any], label: str) -> None:
        self.globals, self.label = module_globals, label
        self.imports: set[str] = set()
        self.constants: dict[str, str] = {}
        self.sources: dict[str, str] = {}        # name -> source, dependencies first
        self.assignments: dict[str, str] = {}    # name -> its module's `NAME = ...` statement, dependencies first

    def visit(self, obj: Any) -> None:
        name = obj.__name__
        if name in self.sources:
            return
        self.sources[name] = ""                  # visiting: a recursive call does not loop
        source = self._source(obj)
        tree = ast.parse(source)
        node = tree.body[0]
        if getattr(node, "decorator_list", None):
            raise Unpackable(f"{self.label}: {name} is decorated (@...): a decorator's result has no source of its "
                             "own; call the decorated behaviour inside a plain def instead")
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if isinstance(obj, types.FunctionType):
            used &= _global_names(obj.__code__)  # not its parameters and locals
            # ... but its default values are evaluated where it is defined, outside its code
            used |= {n.id for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None
                     for n in ast.walk(d) if isinstance(n, ast.Name)}
        for used_name in sorted(used - {name}):
            if used_name in self.globals:
                self._take(used_name, self.globals[used_name])
        del self.sources[name]
        self.sources[name] = source              # after what it uses

    def _source(self, obj: Any) -> str:
        try:
            return textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError):
            raise Unpackable(f"{self.label}: the source of {obj.__name__} is not available (defined with exec(), or in "
                             "a console whose history is gone): define it in a file or a notebook cell") from None

    def _take(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType):
            self._installed(name, value)
            self.imports.add(f"import {value.__name__}" if value.__name__ == name
                             else f"import {value.__name__} as {name}")
        elif isinstance(value, (types.FunctionType, type)) and value.__module__ == self.globals.get("__name__"):
            if isinstance(value, types.FunctionType):
                _check_function(value, f"{self.label} uses {name}, which")
            self.visit(value)
        elif callable(value) and getattr(value, "__module__", None) and _importable_name(value):
            module = sys.modules.get(value.__module__)
            if module is not None:
                self._installed(name, module)
            self.imports.add(f"from {value.__module__} import {value.__qualname__}" if value.__qualname__ == name
                             else f"from {value.__module__} import {value.__qualname__} as {name}")
        elif _literal(value):
            self.constants[name] = repr(value)
        elif (statement := self._assignment(name, value)) is not None:
            self.assignments[name] = statement
        else:
            raise Unpackable(f"{self.label} uses the global {name} (a {type(value).__name__}), a live object that "
                             "cannot travel with the job: create it inside the function (or in a helper it calls), "
                             "or give the reward a module of its own installed on the nodes")

    def _assignment(self, name: str, value: Any) -> str | None:
        """`NAME = expression` as the module's source writes it (its last top-level assignment),
        when `value` is an object of the standard library (a compiled regex, a Decimal, a
        frozenset, ...): re-running the expression in the grader makes it again. None otherwise:
        a third-party object (a model, a tokenizer) is not re-created inside the sandbox, and a
        notebook's module has no source file to read it from. What the expression uses is
        packaged like the function's own globals."""
        kind = type(value).__module__.split(".")[0]
        if kind not in sys.stdlib_module_names or kind == "builtins" and not isinstance(value, frozenset):
            return None
        try:
            module_source = inspect.getsource(sys.modules[self.globals["__name__"]])
        except (KeyError, OSError, TypeError):
            return None
        found = None
        for node in ast.parse(module_source).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == name):
                found = node
        if found is None:
            return None
        self.assignments[name] = ""              # visiting: what it uses is packaged first
        for used in sorted({n.id for n in ast.walk(found.value) if isinstance(n, ast.Name)} - {name}):
            if used in self.globals and used not in self.assignments:
                self._take(used, self.globals[used])
        del self.assignments[name]
        return ast.get_source_segment(module_source, found)

    def _installed(self, name: str, module: types.ModuleType) -> None:
        if module.__name__.partition(".")[0] == "grpo_run":
            return                      # grpo-run itself (Step): installed wherever the job runs
        where = getattr(module, "__file__", None)
        if where and not str(Path(where).resolve()).startswith(_INSTALLED) and not where.startswith(_INSTALLED):
            raise Unpackable(f"{self.label} uses {name} from {where}, a module that is not installed, so a node that "
                             "resumes the job would not have it: install it as a package on the nodes, or define "
                             "what the reward needs beside it (in the same file or notebook)")


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` (and the functions and comprehensions inside it) reads as globals or attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _importable_name(value: Any) -> bool:
    qualname = getattr(value, "__qualname__", "")
    return bool(qualname) and "." not in qualname and value.__module__ not in ("__main__", "builtins")


def _literal(value: Any) -> bool:
    """A value its repr() writes back exactly (ast.literal_eval reads it as equal)."""
    if not isinstance(value, (*_LITERALS, tuple, list, dict, set, frozenset)) or isinstance(value, frozenset):
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return False
