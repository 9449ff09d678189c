"""`grpo_run.train(...)`: the TrainingJob a YAML file describes, built from keyword arguments,
checked and run by the same library as `grpo-run apply` (runner/jobs/run.py).

What a job file names by path, train() writes first, into $GRPO_RUN_HOME/python/NAME/: each
reward function packaged as a module file (grpo_run.package), and tasks given as rows (a list of
dicts or a datasets.Dataset) as Parquet. From there they are the job's environment files like a
job file's: hashed into the spec, copied to the job's storage under its lease, fetched and checked
by a node that resumes it. The same arguments write the same bytes, so running the cell again
finds the same job (and resumes it).
"""

from __future__ import annotations

import difflib
import re
import threading
from pathlib import Path
from typing import Any

from grpo_run import JobError
from grpo_run.handle import Job, as_api_errors, live_view
from grpo_run.package import Unpackable, package_environment, package_reward

SOURCE = "grpo_run.train()"       # how the job's problems are introduced (a job file's are by its path)
FOLDER = "python"                  # under GRPO_RUN_HOME: what train() wrote for each job


def train(*, model: str, tasks: Any, name: str, rewards: list[Any] | None = None, eval_tasks: Any = None,
          held_out_fraction: float | None = None, storage: str | None = None, gpu: str | None = None,
          max_cost_usd: float | None = None, system_prompt: str | None = None, detach: bool = False,
          episodes: type | None = None, max_turns: int | None = None, tools: list[Any] | None = None,
          dry_run: bool = False, **parameters: Any) -> Any:
    """Train `model` with GRPO on `tasks`, scored by `rewards`, as the job file

        metadata: {name: NAME}
        spec: {model: MODEL, storage: STORAGE, gpu: GPU, maxCostUSD: MAX_COST_USD,
               environment: {rewards: [...], tasks: ..., evalTasks: ... | heldOutFraction: ...},
               parameters: {numGenerations: ..., ...}}

    would, on the same supervisor: in the foreground here (the live view on stderr; returns when
    the run stops: Succeeded, or Preempted after a SIGINT with its checkpoint durable), or with
    `detach=True` submitted to `storage` for a node to train (`grpo-run resume NAME --storage
    STORAGE`). Returns the Job. With `dry_run=True`, start nothing: check the job as `grpo-run apply
    --dry-run` does, print its estimate (cost, time, memory fit, the sampler) and return the job
    with status.estimate, as `grpo_run.apply(path, dry_run=True)` does (the functions and tasks
    are written to $GRPO_RUN_HOME/python/NAME/ as a run would write them, and nothing else).

    rewards: functions `f(completion: str, task: dict) -> float`, each alone (weight 1) or as
      `(f, weight)`; `{"function": f, "weight": w, "group": True}` for a group reward,
      `f(completions: list[str], task: dict) -> list[float]`, called with a prompt's G
      completions; each one's mean is recorded under the function's name. Each is packaged
      with its source (grpo_run.package); one that cannot travel is refused here, before
      anything is written. A reward model (a one-logit sequence classifier) as its hub id or
      folder, alone or as `{"model": id, "weight": w, "name": n}`; an LLM judge as
      `{"judge": {"url": ..., "model": ..., "prompt": ...}, "weight": w, "name": n}`: the job
      file's `rewards` entries, checked as `apply` checks them (docs/job.md).
    episodes: an environment that talks back (docs/environments.md): a class with
      `reset(self, task, seed)` -> the first prompt and `step(self, reply)` -> grpo_run.Step,
      one object per episode, packaged with its source as a reward function is
      (spec.environment.episodes); `rewards` may then be left out (the episode's reward is the
      sum of its steps' rewards, plus the rewards', applied to the whole episode).
      max_turns: replies per episode at most (spec.environment.maxTurns, default 6).
    tools: typed functions with docstrings a chat model may call (spec.environment.tools): their
      schemas go to the chat template, a reply's calls (Qwen's <tool_call> JSON) are answered with
      their results, and the first reply that calls none is the answer (or goes to `episodes`).
      Each is packaged with its source as a reward function is.
    tasks, eval_tasks: a list of dicts (each with a "prompt": text or chat messages, and the
      columns the rewards read), a datasets.Dataset, or a task file's path (.jsonl, .json, .csv,
      .parquet); give eval_tasks or held_out_fraction.
    parameters: every spec.parameters field in snake_case (num_generations=8, max_steps=500,
      save_steps=25, learning_rate=1e-5, lora={"r": 8}, method="QLoRA", ...).

    Raises JobError for what `grpo-run apply` would refuse (its message names the job file's
    field: spec.parameters.numGenerations for num_generations), RunError when the job cannot
    run here now.

        def correct(completion: str, task: dict) -> float:
            return float(completion.strip() == task["answer"])

        job = grpo_run.train(model="Qwen/Qwen2.5-0.5B-Instruct", name="add-lora",
                             tasks=[{"prompt": "2+2=", "answer": "4"}, ...], held_out_fraction=0.1,
                             rewards=[correct], max_steps=200, storage="s3://bucket/runs")
    """
    from grpo_run.runner.home import home
    from grpo_run.runner.jobs.run import check_job, start
    from grpo_run.runner.spec.job import name_problem, parse_job

    if (trouble := name_problem(name)) is not None:
        raise JobError(f"{SOURCE}: name: {trouble}")
    params = _parameters(parameters)
    if system_prompt is not None:
        params["systemPrompt"] = system_prompt
    packaged = _packaged_rewards(rewards, episodes is not None)   # every refusal before anything is written
    environment = None
    if episodes is not None:
        try:
            environment = package_environment(episodes)
        except Unpackable as e:
            raise JobError(f"{SOURCE}: episodes: {e}") from None
    packaged_tools = _packaged_tools(tools)
    folder = home() / FOLDER / name
    folder.mkdir(parents=True, exist_ok=True)
    env: dict[str, Any] = {"name": name, "path": [str(folder)], "rewards": []}
    if environment is not None:
        path = folder / f"{episodes.__name__}.py"
        _write_if_changed(path, environment.encode())
        env["episodes"] = f"{path}:{episodes.__name__}"
    if max_turns is not None:
        env["maxTurns"] = max_turns
    if packaged_tools:
        (folder / "tools").mkdir(exist_ok=True)
        env["tools"] = []
        for fn_name, source in packaged_tools:
            path = folder / "tools" / f"{fn_name}.py"
            _write_if_changed(path, source.encode())
            env["tools"].append(f"{path}:{fn_name}")
    for item in packaged:
        if isinstance(item, dict):                  # a reward model or a judge: the job file's entry
            env["rewards"].append(item)
            continue
        fn_name, source, weight, group = item
        path = folder / f"{fn_name}.py"
        _write_if_changed(path, source.encode())
        env["rewards"].append({"function": f"{path}:{fn_name}", "weight": weight, **({"group": True} if group else {})})
    env["tasks"] = _task_file(tasks, folder / "tasks.parquet", "tasks")
    if eval_tasks is not None:
        env["evalTasks"] = _task_file(eval_tasks, folder / "eval_tasks.parquet", "eval_tasks")
    if held_out_fraction is not None:
        env["heldOutFraction"] = held_out_fraction
    spec: dict[str, Any] = {"model": model, "environment": env, "parameters": params}
    for key, value in (("storage", storage), ("gpu", gpu), ("maxCostUSD", max_cost_usd)):
        if value is not None:
            spec[key] = value
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": spec}
    with as_api_errors():
        try:
            job = parse_job(doc, source=SOURCE, base=folder)
        except ValueError as e:                     # JobError: every problem, one per line
            raise JobError(str(e)) from None
        checked = check_job(SOURCE, job, dry_run=dry_run, detach=detach)
        if dry_run:
            return _dry_run(checked)
        start(checked, detach=detach, output=None, stop=threading.Event(), progress=live_view())
    return Job(name, storage if detach else None)


def _dry_run(checked) -> dict[str, Any]:
    """train(dry_run=True)'s answer: the estimate printed as `apply --dry-run` prints it, the
    budget's warning on stderr, and the job with status.estimate returned; Refused (JobError) for
    a job that does not fit, after its estimate."""
    import sys

    from grpo_run.runner.estimate.summary import budget_warning, summary
    from grpo_run.runner.exits import EXIT_USAGE, Refused
    from grpo_run.runner.jobs.run import sampler_lines

    job, est = checked.job, checked.estimate
    if est:
        print(summary(job.name, est, job_file=SOURCE, max_cost_usd=job.maxCostUSD))
        if checked.sampler:
            print(sampler_lines(checked.sampler))
        if short := budget_warning(job.name, est, job.maxCostUSD):
            print(short, file=sys.stderr)
    if checked.refusal:
        raise Refused(checked.refusal, EXIT_USAGE, prefixed=False)
    return checked.dry_run_doc()


def _parameters(given: dict[str, Any]) -> dict[str, Any]:
    """spec.parameters from train()'s snake_case keywords; an unknown one is refused by its
    keyword name, with the nearest known one."""
    from grpo_run.trainer.config import GRPOParams

    known = {_snake(field): field for field in GRPOParams.model_fields}
    params = {}
    for key, value in given.items():
        if key not in known:
            raise JobError(f"{SOURCE}: unknown argument {key}; {_hint(key, known)}")
        params[known[key]] = value
    return params


def _hint(key: str, known: dict[str, str]) -> str:
    """What to write instead of the unknown keyword `key`: TRL's GRPOConfig names from their table
    (grpo_run.trl_names), else a near spelling that is a close match (a typo: num_generation), else
    what train() takes. A cutoff above difflib's 0.6: a loose match names another setting
    (per_device_train_batch_size was "eval_batch_size")."""
    from grpo_run.trl_names import trl_hint

    if (trl := trl_hint(key)) is not None:
        return trl + " (docs/python-api.md has TRL's names beside grpo-run's)"
    near = difflib.get_close_matches(key, [*known, "eval_tasks", "held_out_fraction", "system_prompt"], n=1,
                                     cutoff=0.8)
    return f"did you mean {near[0]}?" if near else f"train() takes {', '.join(sorted(known))}"


def _snake(camel: str) -> str:
    """rewardMemoryMB -> reward_memory_mb: a run of capitals is one word."""
    return re.sub(r"(?<=[a-z0-9])([A-Z]+)", lambda m: "_" + m.group(1).lower(), camel)


def _packaged_rewards(rewards: list[Any] | None, episodes: bool = False) -> list[tuple[str, str, float, bool] | dict[str, Any]]:
    """(function name, its packaged module's source, weight, group) of each reward function, the
    job file's entry of each reward model or judge; raises JobError for a reward that is none of
    train()'s forms, two functions of one name, or one that cannot travel. `episodes`: the job
    has an environment that talks back, and may have no rewards."""
    if rewards is None and episodes:
        return []
    if not isinstance(rewards, list) or not rewards:
        raise JobError(f"{SOURCE}: rewards: give a list of functions, each f or (f, weight), e.g. rewards=[correct, "
                       f"(length_penalty, 0.1)] (got {type(rewards).__name__})")
    out, names = [], set()
    for i, item in enumerate(rewards):
        if isinstance(item, (str, Path)) or isinstance(item, dict) and ("model" in item or "judge" in item):
            out.append(_model_or_judge(item, i))
            continue
        fn, weight = item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0)
        group = False
        if isinstance(item, dict):
            if not set(item) <= {"function", "weight", "group"} or not isinstance(item.get("group", False), bool):
                raise JobError(f"{SOURCE}: rewards[{i}]: a dict takes function, weight and group (True: it scores a "
                               f"prompt's completions together) (got {item!r:.80})")
            fn, weight, group = item.get("function"), item.get("weight", 1.0), item.get("group", False)
        if not callable(fn) or isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise JobError(f"{SOURCE}: rewards[{i}]: give a function, (function, weight) or {{\"function\": f, "
                           f"\"weight\": w, \"group\": True}} (got {item!r:.80})")
        source = _packaged_one(fn, f"rewards[{i}]", "reward", names,
                               "each reward's mean is recorded under its function's name: rename one")
        out.append((fn.__name__, source, float(weight), group))
    return out


def _packaged_tools(tools: list[Any] | None) -> list[tuple[str, str]]:
    """(function name, its packaged module's source) of each tool; JobError for one that is not a
    function, two of one name, or one that cannot travel. Its schema is read in the sandbox."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise JobError(f"{SOURCE}: tools: give a list of typed functions with docstrings, e.g. tools=[add] "
                       f"(got {type(tools).__name__})")
    out, names = [], set()
    for i, fn in enumerate(tools):
        out.append((fn.__name__, _packaged_one(fn, f"tools[{i}]", "tool", names,
                                               "the model calls a tool by its name: rename one")))
    return out


def _packaged_one(fn: Any, where: str, kind: str, names: set[str], unique: str) -> str:
    """`fn`'s packaged module source (grpo_run.package), its name added to `names`; JobError at
    `where` for one that cannot travel or whose name is taken (`unique`: why names must differ)."""
    try:
        source = package_reward(fn, kind)
    except Unpackable as e:
        raise JobError(f"{SOURCE}: {where}: {e}") from None
    if fn.__name__ in names:
        raise JobError(f"{SOURCE}: {where}: two {kind}s are named {fn.__name__}; {unique}")
    names.add(fn.__name__)
    return source


def _model_or_judge(item: str | Path | dict[str, Any], i: int) -> dict[str, Any]:
    """The job file's rewards entry for a reward model (its id or folder, or {"model", "weight",
    "name"}) or a judge ({"judge", "weight", "name"}); a folder given as a relative path is made
    absolute here (the job's files live elsewhere). The rest is checked as apply checks it."""
    entry = {"model": str(item)} if isinstance(item, (str, Path)) else dict(item)
    allowed = {"model", "judge", "weight", "name"}
    if not set(entry) <= allowed:
        raise JobError(f"{SOURCE}: rewards[{i}]: a reward model or judge takes {', '.join(sorted(allowed))} "
                       f"(got {', '.join(sorted(set(entry) - allowed))})")
    model = entry.get("model")
    if isinstance(model, (str, Path)) and Path(model).expanduser().exists():
        entry["model"] = str(Path(model).expanduser().resolve())
    return entry


def _task_file(tasks: Any, path: Path, field: str) -> str:
    """A task file's path: as given, or `path` written (Parquet) from a list of dicts or a
    datasets.Dataset."""
    if isinstance(tasks, (str, Path)):
        return str(Path(tasks).expanduser().resolve())
    rows = tasks
    if type(tasks).__name__ == "Dataset" and hasattr(tasks, "to_list"):     # datasets.Dataset, without importing it
        rows = tasks.to_list()
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise JobError(f"{SOURCE}: {field}: give a list of dicts (each with a \"prompt\"), a datasets.Dataset or a "
                       f"task file's path (got {type(tasks).__name__}{' with no rows' if rows == [] else ''})")
    lacking = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if lacking is not None:        # said here: the job file's fix (spec.environment.columns) is not train()'s
        have = ", ".join(map(str, rows[lacking])) or "none"
        other = next((k for k in rows[lacking] if k not in ("answer", "solution")), "question")
        raise JobError(f"{SOURCE}: {field}: row {lacking} has no \"prompt\" key (it has {have}): give every task "
                       f"its prompt under \"prompt\", e.g. [{{**t, \"prompt\": t[{str(other)!r}]}} for t in rows]")
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise JobError(f"{SOURCE}: {field}: the rows cannot be written as Parquet ({e}): give each column one type "
                       "in every row") from None
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    _write_if_changed(path, buffer.getvalue())
    return str(path)


def _write_if_changed(path: Path, data: bytes) -> None:
    """Write `data` to `path` unless it holds those bytes already (through a temporary name)."""
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
