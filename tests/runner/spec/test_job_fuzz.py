"""Fuzzed job files: every input ends as a valid job or a JobError that names a field (or says
what is wrong with the whole file), never a traceback, and nothing is written to storage.

Inputs: a valid job mutated at random paths (hypothesis), random bytes and YAML-ish text, and
hand-written pathological files (an anchor bomb, 50 MB, 10,000-deep nesting, python tags,
duplicate keys, tabs). Runs are derandomized and keep no example database, so a failure replays
as it is, with the same inputs, on any machine.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from grpo_run.runner.exits import EXIT_USAGE
from grpo_run.runner.spec.job import JobError, load_job, parse_job
from grpo_run.runner.spec.yamlfile import load as load_yaml

pytestmark = pytest.mark.fault

REPO = Path(__file__).resolve().parents[3]
DEMO = yaml.safe_load((REPO / "examples" / "tiny-arithmetic.yaml").read_text())

# Hypothesis keeps caches (unicode tables, constants found in the code) in ./.hypothesis even with
# no example database: keep them out of the repository.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "grpo-run-hypothesis")
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=25)

ENVELOPE = ("apiVersion", "kind", "metadata", "spec")
# What a whole-file problem starts with (runner.jobfile, runner.job.load_job / parse_job).
WHOLE_FILE = re.compile(r"(not valid YAML: |not UTF-8 text: |too large: |is a folder, not a file|cannot be read: "
                        r"|the file must be a YAML mapping |the file has a key |the file: |more than [\d,]+ values"
                        r"|line \d+, column \d+: (nested more than|its aliases expand|the alias \*))")


# --- the jobs mutated ---------------------------------------------------------------------------

def full_job(storage: str) -> dict[str, Any]:
    """A valid job with most optional fields set, so mutations reach them."""
    return {
        "apiVersion": "grpo-run/v1", "kind": "TrainingJob",
        "metadata": {"name": "fuzz-full", "labels": {"team": "rl"}, "annotations": {"note": "x"}},
        "spec": {
            "runtime": "grpo-lora", "model": "tiny:char",
            "environment": {"name": "arithmetic", "rewards": [{"function": "correct", "weight": 1.0, "name": "ok"}]},
            "parameters": {"numGenerations": 4, "beta": 0.01, "maxCompletionLength": 8, "method": "LoRA",
                           "lora": {"r": 4, "alpha": 8.0, "dropout": 0.1, "targetModules": ["q_proj", "v_proj"]},
                           "saveSteps": 5, "maxSteps": 10, "learningRate": 0.001, "topP": 0.9, "topK": 5,
                           "stopStrings": ["\n"], "chatTemplateKwargs": {"enable_thinking": False},
                           "systemPrompt": "Answer with one digit.", "evalSteps": 5, "seed": 3,
                           "trainTasks": 50, "evalTasks": 20, "rewardTimeoutSeconds": 5.0},
            "maxCostUSD": 5, "gpu": "RTX-4090", "storage": storage,
            "pricing": {"usdPerHour": 0.5, "stepSeconds": 1.2},
            "notices": {"clouds": ["aws"], "awsMetadataURL": "http://127.0.0.1:9"},
        },
    }


def own_env_job(storage: str) -> dict[str, Any]:
    """A valid job with its own reward and task files (written by `job_folder`), paths relative."""
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "fuzz-own"},
            "spec": {"model": "tiny:char", "storage": storage,
                     "environment": {"name": "mine", "reward": "rewards.py:score", "tasks": "train.jsonl",
                                     "evalTasks": "eval.jsonl", "path": ["."]}}}


def demo_job(storage: str) -> dict[str, Any]:
    doc = copy.deepcopy(DEMO)
    doc["spec"]["storage"] = storage
    return doc


def job_folder(root: Path) -> Path:
    """The folder the job files live in: the user environment's files, nothing else."""
    folder = root / "jobs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text("def score(completion, task):\n    return 1.0\n")
    (folder / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (folder / "eval.jsonl").write_text('{"prompt": "2+2="}\n')
    return folder


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# Values of every kind, the awkward ones more often than chance would pick them.
SPECIAL_NUMBERS = [0, -1, 1, 2, 10**400, -(10**400), 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**18,
                   math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.5, 1e-5]
SPECIAL_TEXT = ["", " ", "x" * 100_000, "a" * 300, "\x00", "a\x00b", "\u202eevil\u202c", "\ud800", "x\udfffy",
                "😀", "名前", "~nosuchuser-fuzz/x", "~", "../" * 50, "/" + "d/" * 3000, "tiny:char", "tiny:nope",
                "LoRA", "QLoRa", "s3://bucket/prefix", "file:///tmp/x", "1e-5", "yes", "null", "True", "-",
                "Qwen/Qwen3-0.6B", "rewards.py:score", "nope.py:f", "mod:", ":f", "arithmetic", "chess",
                "http://127.0.0.1:9/", "ftp://x", "\t", "\n", "a: b", "{", "%YAML", "&a", "*a"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.sampled_from(SPECIAL_NUMBERS),
    st.text(max_size=20), st.sampled_from(SPECIAL_TEXT),
    st.builds(lambda a, b: a + "\ud800" + b, st.text(max_size=3), st.text(max_size=3)),
    st.binary(max_size=8),
)
weird_values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.sampled_from(SPECIAL_TEXT[:12])), scalars,
                    max_size=3),
    st.integers(min_value=2, max_value=60).map(nested),
)
keys = st.one_of(st.text(max_size=12), st.sampled_from(
    ["name", "spec", "Spec", "paramters", "numGeneration", "maxStep", "evalTask", "storag", "model ", "status",
     "[key]", "x.y", "a: b", "\ud800", "", "kind"]), st.integers(), st.booleans(), st.none(), st.floats())


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path in a document, containers first: (key, index, ...)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for part in path[:-1]:
        doc = doc[part]
    return doc


@st.composite
def mutated(draw, make: Any) -> Any:
    """A valid job (from `make`) changed 1-3 times at random paths: a value replaced by one of
    another kind, a key deleted or misspelt, an unknown key added at any level."""
    doc = make()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "rename"]))
        if path == ():
            if op == "replace":
                return draw(weird_values)
            op = "add"
        target = _parent(doc, path) if path else None
        if op == "replace":
            target[path[-1]] = draw(weird_values)
        elif op == "delete":
            del target[path[-1]]
        elif op == "rename" and isinstance(target, dict):
            target[draw(keys)] = target.pop(path[-1])
        else:
            holder = doc if path == () else _parent(doc, path)[path[-1]]
            if isinstance(holder, dict):
                holder[draw(keys)] = draw(weird_values)
            elif isinstance(holder, list):
                holder.append(draw(weird_values))
    return doc


TOKENS = ["apiVersion", "kind", "metadata", "spec", "name", "model", "grpo-run/v1", "TrainingJob", "tiny:char",
          "environment", "arithmetic", "parameters", "numGenerations", ":", ": ", "-", "- ", "[", "]", "{", "}",
          ",", "&a ", "*a", "!!python/object:os.system", "!!str", "!!binary", "!!set", "!!int", "<<: ", "?", "|",
          ">", "'", '"', "#", "\n", "\n  ", "\n    ", "\t", " ", "%YAML 1.1", "---", "...", "0x1F", "1e400",
          ".nan", ".inf", "9" * 50, "2001-02-30", "2020-01-01", "!!float ", "!!bool ", "!!timestamp ", "\\ud800",
          "\x00", "\ufeff", "\u202e", "é", "~"]
yamlish = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
DEMO_TEXT = (REPO / "examples" / "tiny-arithmetic.yaml").read_text()


@st.composite
def spliced_demo(draw) -> bytes:
    """The demo file with a slice of its YAML (past the opening comments) replaced by YAML-ish
    text: nearly valid files."""
    start = draw(st.integers(DEMO_TEXT.index("apiVersion:"), len(DEMO_TEXT)))
    end = draw(st.integers(start, min(len(DEMO_TEXT), start + 40)))
    return (DEMO_TEXT[:start] + draw(yamlish) + DEMO_TEXT[end:]).encode("utf-8", "surrogatepass")


raw_files = st.one_of(st.binary(max_size=300), yamlish.map(lambda t: t.encode("utf-8", "surrogatepass")),
                      spliced_demo())


def to_yaml(doc: Any) -> bytes | None:
    """`doc` as a YAML file, or None where PyYAML cannot write it."""
    try:
        return yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass")
    except (yaml.YAMLError, RecursionError, TypeError, ValueError):
        return None


# --- hand-written pathological files ------------------------------------------------------------

def _bomb(levels: int = 9, width: int = 9) -> str:
    text = 'a0: &a0 ["lol"' + ', "lol"' * (width - 1) + "]\n"
    for i in range(1, levels + 1):
        text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]\n"
    return text


def _in_spec(line: str) -> str:
    """The demo file with `line` added under spec (two spaces in)."""
    return DEMO_TEXT.replace("spec:\n", "spec:\n  " + line + "\n", 1)


PATHOLOGICAL: dict[str, bytes | str | None] = {
    "anchor-bomb": _bomb(),
    "anchor-bomb-in-a-field": DEMO_TEXT.replace("  parameters:\n", "  parameters:\n    chatTemplateKwargs:\n"
                                                + "".join("      " + line + "\n" for line in _bomb().splitlines())),
    "merge-key-bomb": "a0: &a0 {k0: 1, k1: 2, k2: 3, k3: 4, k4: 5, k5: 6, k6: 7, k7: 8, k8: 9}\n"
    + "".join(f"a{i}: &a{i} {{<<: *a{i - 1}, " + ", ".join(f"m{j}: *a{i - 1}" for j in range(9)) + "}\n"
              for i in range(1, 10)),
    "fifty-megabytes": None,                                   # written by `_write`: 50 MB of valid YAML text
    "a-very-long-line": "apiVersion: " + "v" * 900_000 + "\n",
    "deep-flow-list": "[" * 10_000 + "]" * 10_000,
    "deep-flow-map": "{a: " * 10_000 + "1" + "}" * 10_000,
    "deep-block-list": "".join(" " * i + "-\n" for i in range(3000)),
    "deep-in-spec": _in_spec("chatTemplateKwargs: " + "[" * 5000 + "]" * 5000),
    "recursive-alias": "a: &a [*a]\n",
    "undefined-alias": _in_spec("model: *nowhere"),
    "python-object-tag": "!!python/object:os.system {}\n",
    "python-apply-tag": _in_spec('model: !!python/object/apply:os.system ["echo owned"]'),
    "python-name-tag": _in_spec("model: !!python/name:os.system"),
    "duplicate-top-level-key": DEMO_TEXT.replace("kind: TrainingJob\n", "kind: TrainingJob\nkind: TrainingJob\n"),
    "duplicate-nested-key": DEMO_TEXT.replace("    seed: 0\n", "    seed: 0\n    seed: 1\n"),
    "tab-indentation": DEMO_TEXT.replace("  model: tiny:char", "\tmodel: tiny:char"),
    "tab-after-colon": "apiVersion:\tgrpo-run/v1\n\tkind: x\n",
    "binary-bytes": bytes(range(256)) * 4,
    "latin-1": DEMO_TEXT.replace("tiny-arithmetic", "tiny-arithm\u00e9tic").encode("latin-1"),
    "utf-16": DEMO_TEXT.encode("utf-16"),
    "nul-character": DEMO_TEXT.replace("runtime", "run\x00time"),
    "a-list": "- apiVersion: grpo-run/v1\n- kind: TrainingJob\n",
    "a-scalar": "grpo-run/v1\n",
    "null-document": "~\n",
    "empty-file": "",
    "only-comments": "# nothing here\n",
    "two-documents": DEMO_TEXT + "---\n" + DEMO_TEXT,
    "huge-int-text": _in_spec("maxCostUSD: " + "9" * 5000),
    "huge-int-field": DEMO_TEXT.replace("    seed: 0", "    seed: " + "1" + "0" * 400),
    "huge-hex-int": DEMO_TEXT.replace("    seed: 0", "    seed: 0x" + "f" * 5000),
    "nan": DEMO_TEXT.replace("beta: 0.0 ", "beta: .nan "),
    "infinite-learning-rate": DEMO_TEXT.replace("learningRate: 0.002", "learningRate: .inf"),
    "lone-surrogate": DEMO_TEXT.replace("model: tiny:char", 'model: "\\ud800"'),
    "name-too-long-for-the-os": DEMO_TEXT.replace("model: tiny:char", "model: ./" + "m" * 5000),
    "unknown-home-folder": _in_spec("storage: ~nosuchuser-fuzz/store"),
    "rewards-a-number": DEMO_TEXT.replace("name: arithmetic", "name: arithmetic\n    rewards: 5"),
    "own-environment-path-too-long": DEMO_TEXT.replace(
        "name: arithmetic", "name: mine\n    reward: ./" + "r" * 5000 + ".py:f\n    tasks: t.jsonl\n"
        "    evalTasks: e.jsonl"),
    "unhashable-key": _in_spec("? [1, 2]\n  : x"),
    "impossible-date": DEMO_TEXT.replace("name: tiny-arithmetic", "name: 2001-02-30"),
    "bool-tag-on-a-word": DEMO_TEXT.replace("beta: 0.0 ", "beta: !!bool maybe "),
    "int-tag-on-nothing": DEMO_TEXT.replace("    seed: 0", "    seed: !!int"),
    "float-tag-on-a-word": DEMO_TEXT.replace("learningRate: 0.002", "learningRate: !!float fast"),
    "key-yes-at-the-top": DEMO_TEXT.replace("kind: TrainingJob", "kind: TrainingJob\nyes: 1"),
    "the-job-is-a-folder": None,                               # written by `_write`: a folder
}
ACCEPTED = {"utf-8-bom"}                                       # the hand-written inputs that are valid jobs
PATHOLOGICAL["utf-8-bom"] = "\ufeff" + DEMO_TEXT


def _write(folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    content = PATHOLOGICAL[name]
    if name == "fifty-megabytes":
        chunk = ("# " + "x" * 1021 + "\n").encode() * 1024     # 1 MiB of comment lines
        with open(path, "wb") as f:
            f.write(DEMO_TEXT.encode())
            for _ in range(50):
                f.write(chunk)
    elif name == "the-job-is-a-folder":
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    return path


# --- what every input must end as ---------------------------------------------------------------

@dataclass
class Tally:
    """How the inputs ended, for the figures (counted as they happen, never assumed)."""
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    tracebacks: int = 0
    written_to_storage: int = 0
    slowest_s: float = 0.0
    examples: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {"tried": self.tried, "refused": self.refused, "accepted": self.accepted,
                "tracebacks": self.tracebacks, "written_to_storage": self.written_to_storage,
                "slowest_s": round(self.slowest_s, 3)}


def top_keys(doc: Any) -> set[str]:
    """The top-level keys as problems name them (a lone surrogate as its \\u escape)."""
    if not isinstance(doc, dict):
        return set()
    return {str(k).encode("utf-8", "backslashreplace").decode("utf-8") for k in doc}


def names_a_field_or_the_file(line: str, keys: set[str]) -> bool:
    """`line` starts with a field's path (the envelope's, or a top-level key the file has, as in
    `foo: unknown field`) or is a whole-file problem."""
    return bool(WHOLE_FILE.match(line)) or any(line.startswith((f"{k}: ", f"{k}.")) for k in (*ENVELOPE, *keys))


def assert_names_a_field_or_the_file(e: JobError, keys: set[str]) -> None:
    assert e.problems, "a JobError with no problems"
    for line in e.problems:
        assert names_a_field_or_the_file(line, keys), f"names no field and is not about the whole file: {line!r}"
        line.encode("utf-8")                                    # a problem can go to any log or terminal
        assert len(line) <= 1000, f"a problem line of {len(line):,} characters"
    assert "Traceback" not in str(e)


def ends_cleanly(tally: Tally, attempt: Any, keys: set[str]) -> str:
    """Run `attempt` (a load or a parse); 'accepted' or 'refused', counted. Anything but a
    JobError is counted as a traceback and fails the example (hypothesis shrinks it)."""
    tally.tried += 1
    started = time.monotonic()
    try:
        attempt()
    except JobError as e:
        assert_names_a_field_or_the_file(e, keys)
        tally.refused += 1
        return "refused"
    except BaseException:
        tally.tracebacks += 1
        raise
    finally:
        tally.slowest_s = max(tally.slowest_s, time.monotonic() - started)
    tally.accepted += 1
    return "accepted"


def _empty_or_absent(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def storage_untouched(tally: Tally, store: Path, home: Path) -> None:
    written = [str(p) for p in (store, home / "runs", home / "store") if not _empty_or_absent(p)]
    if written:
        tally.written_to_storage += 1
    assert not written, f"written to storage: {written}"


# --- the fuzzing --------------------------------------------------------------------------------

@pytest.mark.parametrize("base", ["demo", "full", "own-environment"])
def test_mutated_jobs_are_valid_or_refused_naming_the_field(base, tmp_path, figures, monkeypatch):
    folder, store, home = job_folder(tmp_path), tmp_path / "store", tmp_path / "home"
    monkeypatch.setenv("GRPO_RUN_HOME", str(home))
    make = {"demo": demo_job, "full": full_job, "own-environment": own_env_job}[base]
    assert parse_job(make(str(store)), base=folder)            # the starting point is a valid job
    tally = Tally()

    @FUZZ
    @given(doc=mutated(lambda: make(str(store))))
    def check(doc):
        keys = top_keys(doc)
        ends_cleanly(tally, lambda: parse_job(copy.deepcopy(doc), base=folder), keys)
        text = to_yaml(doc)                                      # the same job as a file, through load_job
        if text is not None:
            path = folder / "job.yaml"
            path.write_bytes(text)
            ends_cleanly(tally, lambda: load_job(path), keys)
        storage_untouched(tally, store, home)

    check()
    figures.add("fuzz", inputs=f"mutated {base} job, as a document and as a file", **tally.figures())
    assert tally.refused > tally.tried // 4 and tally.tracebacks == 0 and tally.written_to_storage == 0


def test_random_bytes_and_yamlish_text_are_valid_or_refused(tmp_path, figures, monkeypatch):
    folder, store, home = job_folder(tmp_path), tmp_path / "store", tmp_path / "home"
    monkeypatch.setenv("GRPO_RUN_HOME", str(home))
    tally = Tally()

    @FUZZ
    @given(data=raw_files)
    def check(data):
        path = folder / "job.yaml"
        path.write_bytes(data)
        ends_cleanly(tally, lambda: load_job(path), _keys_of_file(path))
        storage_untouched(tally, store, home)

    check()
    figures.add("fuzz", inputs="random bytes and YAML-ish text", **tally.figures())
    assert tally.tried == tally.refused + tally.accepted and tally.tracebacks == 0


def _keys_of_file(path: Path) -> set[str]:
    """The top-level keys of a small YAML file (for naming checks), or none."""
    try:
        return top_keys(load_yaml(path.read_text("utf-8")))
    except Exception:
        return set()


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_files_are_refused_quickly_as_a_whole_or_by_field(name, tmp_path, monkeypatch):
    folder, store, home = job_folder(tmp_path), tmp_path / "store", tmp_path / "home"
    monkeypatch.setenv("GRPO_RUN_HOME", str(home))
    path = _write(folder, name)
    tally = Tally()
    outcome = ends_cleanly(tally, lambda: load_job(path), _keys_of_file(path) if path.is_file()
                           and path.stat().st_size < 2**20 else set())
    storage_untouched(tally, store, home)
    assert outcome == ("accepted" if name in ACCEPTED else "refused")
    assert tally.slowest_s < 2.0, f"{name} took {tally.slowest_s:.1f}s to load or refuse"


def test_an_anchor_bomb_is_refused_before_it_is_expanded(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    started = time.monotonic()
    with pytest.raises(JobError) as e:
        load_job(path)
    assert time.monotonic() - started < 0.5
    assert len(e.value.problems) == 1 and "aliases expand to more than" in e.value.problems[0]


def test_every_problem_is_still_reported_beside_a_huge_number():
    doc = demo_job("store")
    doc["spec"]["parameters"].update(seed=10**400, numGenerations=1, learningRate=math.inf)
    with pytest.raises(JobError) as e:
        parse_job(doc)
    found = e.value.problems
    assert "spec.parameters.seed: must be between -2**63 and 2**63-1 (got 100000000000…000000, 401 digits): " \
           "numbers in a job fit in 64 bits" in found
    assert any(p.startswith("spec.parameters.numGenerations: must be >= 2 (got 1)") for p in found)
    assert any(p.startswith("spec.parameters.learningRate: must be a finite number (got inf)") for p in found)
    assert len(found) == 3


def test_an_integer_too_long_to_read_is_named_by_its_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(PATHOLOGICAL["huge-int-text"])
    with pytest.raises(JobError) as e:
        load_job(path)
    assert e.value.problems == ["spec.maxCostUSD: must be between -2**63 and 2**63-1 (got an integer of 5,000 "
                                "digits): numbers in a job fit in 64 bits"]


def test_a_key_yaml_reads_as_a_boolean_is_named_with_the_fix(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(PATHOLOGICAL["key-yes-at-the-top"])
    with pytest.raises(JobError) as e:
        load_job(path)
    assert e.value.problems == ["the file has a key that is not text (got true): put it in quotes; unquoted, YAML "
                                "reads yes, no, true and false as booleans and digits as numbers"]


def test_a_megabyte_value_is_shortened_in_the_problem():
    doc = demo_job("store")
    doc["spec"]["model"] = 7
    doc["spec"]["runtime"] = "r" * 1_000_000
    with pytest.raises(JobError) as e:
        parse_job(doc)
    (runtime,) = [p for p in e.value.problems if p.startswith("spec.runtime:")]
    assert len(runtime) <= 1000 and "characters left out" in runtime
    assert runtime.endswith("choose LoRA, QLoRA or Full with spec.parameters.method")


# --- the CLI ------------------------------------------------------------------------------------

def run_apply(path: Path) -> tuple[int, str]:
    """`grpo-run apply -f PATH` in-process (no --dry-run): (exit status, stdout + stderr)."""
    from grpo_run.runner.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["apply", "-f", str(path)])
    return code, out.getvalue() + err.getvalue()


def assert_refused_by_the_cli(tally: Tally, path: Path, keys: set[str], store: Path, home: Path) -> None:
    tally.tried += 1
    started = time.monotonic()
    try:
        code, output = run_apply(path)
    except BaseException:
        tally.tracebacks += 1
        raise
    finally:
        tally.slowest_s = max(tally.slowest_s, time.monotonic() - started)
    tally.refused += code == EXIT_USAGE
    assert code == EXIT_USAGE, output[-2000:]
    assert "Traceback" not in output
    assert str(path) in output                                  # the file is named ...
    lines = [line.strip() for line in output.splitlines()[1:] if line.startswith("  ") and not line.startswith("   ")]
    assert any(names_a_field_or_the_file(line, keys) for line in lines), output[-2000:]  # ... and a field or the file
    storage_untouched(tally, store, home)


def _fresh_places(root: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """(job folder, storage folder, GRPO_RUN_HOME) for one input, none of them written yet."""
    root.mkdir(parents=True)
    home = root / "home"
    monkeypatch.setenv("GRPO_RUN_HOME", str(home))
    return job_folder(root), root / "store", home


def refused_by_the_loader(path: Path) -> bool:
    """Checked before the CLI sees a file: a valid job would start training."""
    try:
        load_job(path)
    except JobError:
        return True
    return False


def test_the_cli_refuses_pathological_files_with_exit_2_and_writes_nothing(tmp_path, figures, monkeypatch):
    tally = Tally()
    for name in sorted(set(PATHOLOGICAL) - ACCEPTED):
        folder, store, home = _fresh_places(tmp_path / name, monkeypatch)
        path = _write(folder, name)
        text = path.read_text("utf-8", "replace") if path.is_file() and path.stat().st_size < 2**20 else ""
        text = (text.replace("spec:\n", f"spec:\n  storage: {store}\n", 1)
                if "spec:\n" in text and "storage:" not in text else None)
        if text is not None and name not in ("utf-16", "latin-1", "binary-bytes"):
            path.write_text(text)                               # its storage is this test's
        if not refused_by_the_loader(path):
            tally.tried += 1                                    # counted as accepted, never run
            tally.accepted += 1
            continue
        assert_refused_by_the_cli(tally, path, _keys_of_file(path) if text is not None else set(), store, home)
    figures.add("fuzz", inputs="hand-written pathological files, through `grpo-run apply`", **tally.figures())
    assert tally.accepted == 0 and tally.refused == tally.tried and tally.written_to_storage == 0


def test_the_cli_refuses_fuzzed_invalid_jobs_with_exit_2_and_writes_nothing(tmp_path, figures, monkeypatch):
    tally, inputs = Tally(), itertools.count()

    @FEW
    @given(doc=mutated(lambda: full_job("STORE")), raw=raw_files, as_file=st.booleans())
    def check(doc, raw, as_file):
        folder, store, home = _fresh_places(tmp_path / f"input-{next(inputs)}", monkeypatch)
        if isinstance(doc, dict) and isinstance(doc.get("spec"), dict) and doc["spec"].get("storage") == "STORE":
            doc["spec"]["storage"] = str(store)
        data = to_yaml(doc) if as_file else raw
        if data is None:
            data = raw
        path = folder / "job.yaml"
        path.write_bytes(data)
        if not refused_by_the_loader(path):
            tally.tried += 1                                    # a valid job would train: counted, never run
            tally.accepted += 1
            return
        assert_refused_by_the_cli(tally, path, _keys_of_file(path), store, home)

    check()
    figures.add("fuzz", inputs="fuzzed jobs through `grpo-run apply` (valid ones counted, not run)",
                **tally.figures())
    assert tally.refused >= 10 and tally.refused + tally.accepted == tally.tried and tally.written_to_storage == 0
