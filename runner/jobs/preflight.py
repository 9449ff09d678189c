"""Preflight: what `apply`, `apply --dry-run` and `apply --detach` check before any node is paid for.

Each of these mistakes used to pass a dry run and cost a node boot to find (issue 22): a reward
file with a syntax error, a wrong function name, a task file without `prompt`, storage on a
scheme the lease cannot use, s3:// without credentials, a hub model the estimate could not read.
Here they are found on the machine that submits, in the job file's error format (every problem at
once, each naming its field and the fix), and `apply` exits 2 as for any bad job file:

    the model     a hub id's config.json is in the Hugging Face cache or fetched into it
                  (runner.estimate.model_config), so the memory fit is always checked
    the rewards   each reward file imported, and its function found, by the grader's own
                  sandboxed worker, the way the trainer will (trainer.grader)
    the tasks     the first rows of every task file and local data set (trainer.envs.sources), read through
                  spec.environment.columns and checked for a prompt, as the trainer reads them
    the storage   a scheme the job's lease works on (s3:// or a folder); for s3://, credentials
                  found, and (not on a dry run) a small object written, read and deleted under
                  the job's prefix
    the judges    an LLM judge needs GRPO_RUN_ALLOW_JUDGES=1 where the job runs (a note for a
                  dry run or --detach: another node may run it)
    the sampler   `sampler: vllm` that cannot sample this job: vLLM missing here (apply), a method it
                  is not handed (QLoRA), a head size vLLM's CPU attention lacks on a CPU
                  (trainer.sampling.choice)
and warnings, which do not refuse the job: saveSteps >= maxSteps on a job with storage (no
checkpoint before the end); prompts with characters the model's tokenizer reads as <unk> (tiny:char's
20 tokens; `_check_vocabulary`). `check_before_apply` is apply's one call (the CLI's and the Python API's); `preflight` the library's.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from grpo_run.runner.spec.job import TrainingJob
from grpo_run.trainer.envs.sources import (dataset_problems, first_line, first_rows, gsm8k_problems, quiet,
                                           task_file_problems)

Mode = Literal["dry-run", "apply", "detach"]

PROBE_RETRY_S = 15.0            # how long the storage probe retries a store that does not answer
SUPPORTED_STORAGE = ("s3://bucket/prefix (AWS S3, or MinIO, SeaweedFS, R2 and other S3-compatible stores "
                     "through AWS_ENDPOINT_URL), gs://bucket/prefix (Google Cloud Storage), az://container/prefix "
                     "(Azure Blob Storage) or a local folder")
# columns that usually hold a data set's prompt, in the order a hint tries them


@dataclass
class Findings:
    """What the preflight found: problems refuse the job (exit 2), warnings and notes are told."""

    problems: list[str] = field(default_factory=list)   # "spec.FIELD: what is wrong: the fix"
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class StorageUnreachable(RuntimeError):
    """The job's storage did not answer the probe within PROBE_RETRY_S: a failure of the moment
    (exit 1), not of the job file."""


def preflight(job: TrainingJob, *, mode: Mode) -> Findings:
    """Every check above for `job`, as `mode` runs it. Raises StorageUnreachable when the s3://
    probe gets no answer; everything else is a finding."""
    found = Findings()
    _check_storage(job, mode, found)
    p = job.parameters
    if job.storage is not None and p.saveSteps >= p.maxSteps:
        found.warnings.append(
            f"spec.parameters.saveSteps: {p.saveSteps} >= maxSteps ({p.maxSteps}): no checkpoint is saved before "
            "the last step, so a node lost on the way starts this job over from step 0 (only a spot notice "
            "saves one sooner); set saveSteps below maxSteps")
    _check_model(job, mode, found)
    _check_folders(job, mode, found)
    _check_tasks(job, found)
    _check_rewards(job, found)
    _check_episodes(job, found)
    _check_tool_format(job, mode, found)
    _check_vocabulary(job, found)
    _check_judges(job, mode, found)
    _check_sampler(job, mode, found)
    return found


def sampler_choice(job: TrainingJob, *, here: bool):
    """The engine `job` samples with and why (trainer.sampling.choice.Choice): on this machine
    (`here`: apply runs it here), or on a GPU node that has vLLM (a dry run or --detach: the node
    decides at the job's first start). Raises ValueError for `sampler: vllm` that cannot be,
    LookupError when the model's config cannot be read (said by _check_model)."""
    from grpo_run.runner.estimate.config import model_config
    from grpo_run.runner.spec.hardware import node_processes
    from grpo_run.trainer.sampling.choice import decide, node_has_gpu

    return decide(job.parameters, lambda: model_config(job.model), gpu=node_has_gpu(),
                  processes=node_processes(job.resources), here=here)


def decided_here(job: TrainingJob, mode: Mode) -> bool:
    """Whether this machine decides the engine `job` samples with: apply runs it here, and a dry run
    of a job without storage can run nowhere else (so it says what apply would, refusal included);
    --detach and a dry run of a stored job leave it to the node that first starts it."""
    return mode == "apply" or (mode == "dry-run" and job.storage is None)


def _check_sampler(job: TrainingJob, mode: Mode, found: Findings) -> None:
    try:
        choice = sampler_choice(job, here=decided_here(job, mode))
    except ValueError as e:
        found.problems.append(str(e))
        return
    except LookupError:
        return                      # the model's config: _check_model said it
    vllm = job.parameters.vllm
    if choice.engine == "vllm" and vllm.mode == "server":
        problem = _server_problem(vllm.server, job.model)
        if problem and mode == "apply":
            found.problems.append(problem)
        elif problem:               # the nodes may reach what this machine does not
            found.notes.append(f"{problem} (from this machine; the nodes must reach it)")


def _server_problem(url: str, model: str) -> str | None:
    """Why the vLLM server at `url` does not answer its /health (None when it does)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            health = json.loads(reply.read())
        if health.get("engine") != "vllm":
            return f"spec.parameters.vllm.server: {url} answered, but not as `grpo-run vllm-server`"
        return _served_model_problem(url, health.get("model"), model)
    except (urllib.error.URLError, OSError, ValueError) as e:
        return (f"spec.parameters.vllm.server: no vLLM server answers at {url} ({getattr(e, 'reason', e)}): start "
                f"one there with `grpo-run vllm-server --model {model}` (docs/sampling.md)")


def _served_model_problem(url: str, served, model: str) -> str | None:
    """Why a server serving `served` cannot sample a job of spec.model `model` (None when it can):
    another base would sample, and the job train, on weights that are not the job's."""
    from grpo_run.runner.home import is_tiny, tiny_model_path
    from grpo_run.trainer.sampling.vllm_server import served_name

    ours = served_name(str(tiny_model_path(model)) if is_tiny(model) else model)
    if served == ours:
        return None
    return (f"spec.parameters.vllm.server: the vLLM server at {url} serves {served!r}, and spec.model is {ours!r}: "
            f"point the job at a server of its model, or start one with `grpo-run vllm-server --model {ours}`")


def check_before_apply(file: str, job: TrainingJob, *, dry_run: bool, detach: bool) -> None:
    """`apply`'s preflight (the CLI's and the Python API's): prints its warnings and notes (stderr)
    and raises Refused when the job must stop here (EXIT_USAGE for a job file that would fail, or
    for a dry run with detach; EXIT_FAILED when the storage does not answer)."""
    from grpo_run.runner.exits import EXIT_FAILED, EXIT_USAGE, Refused
    from grpo_run.runner.spec.job import JobError

    if dry_run and detach:
        raise Refused("--dry-run and --detach together: --dry-run starts and submits nothing, --detach submits; give "
                      "one (a dry run checks everything --detach would, but writing to storage)", EXIT_USAGE)
    try:
        found = preflight(job, mode="dry-run" if dry_run else "detach" if detach else "apply")
    except StorageUnreachable as e:
        raise Refused(str(e), EXIT_FAILED) from None
    for line in found.warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in found.notes:
        print(f"note: {line}", file=sys.stderr)
    if found.problems:
        raise Refused(str(JobError(file, found.problems)), EXIT_USAGE, prefixed=False)


# --- storage ----------------------------------------------------------------------------------------


def _check_storage(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """A scheme the lease works on; for s3://, credentials, and the probe unless a dry run."""
    url = job.storage
    if url is None:                         # this machine's own store ($GRPO_RUN_HOME/store)
        return
    try:
        parts = urlsplit(url) if "://" in url else None
    except ValueError as e:                 # s3://[bucket: urlsplit reads [ as an IPv6 address
        found.problems.append(f"spec.storage: not a URL (got {url}): {e}; write it as s3://bucket/prefix")
        return
    scheme = parts.scheme.lower() if parts is not None else ""
    if scheme in ("gs", "gcs", "az"):
        _check_cloud_storage(job, mode, found)
        return
    if scheme not in ("", "file", "s3", "s3a"):
        found.problems.append(f"spec.storage: {scheme}:// is not supported (got {url}): use " + SUPPORTED_STORAGE)
        return
    if scheme not in ("s3", "s3a"):
        return                              # a folder: apply checks it as it starts; nothing to pay for yet
    try:
        source = aws_credentials_source()
    except Exception as e:                  # a profile that does not exist, a config file that does not parse
        found.problems.append(f"spec.storage: the AWS credentials for {url} cannot be read: {first_line(e)}")
        return
    if source is None:
        found.problems.append(
            f"spec.storage: no AWS credentials found for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(plus AWS_ENDPOINT_URL for an S3-compatible store), or AWS_PROFILE, or run where an instance role "
            "applies")
        return
    from grpo_run.runner.home import job_store_url

    where = job_store_url(url, job.name)
    if mode == "dry-run":
        found.notes.append(f"spec.storage: AWS credentials found ({source}); not tried on a dry run: apply and "
                           f"--detach first write, read and delete a small object under {where}")
        return
    _probe(where, found)


def _check_cloud_storage(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """gs:// and az://: the URL, the client library (its extra named when missing), the account
    for Azure; the probe unless a dry run (it meets the credentials: a missing or refused one is
    a StorageConfigError that says what to set)."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.checkpoint.storage.store import StorageConfigError
    from grpo_run.runner.home import job_store_url

    url = job.storage
    where = job_store_url(url, job.name)
    try:
        open_store(where)           # the URL's form, the library, the account: nothing sent yet
    except StorageConfigError as e:
        found.problems.append(f"spec.storage: {first_line(e)}")
        return
    if mode == "dry-run":
        found.notes.append(f"spec.storage: credentials not tried on a dry run: apply and --detach first write, "
                           f"read and delete a small object under {where}")
        return
    _probe(where, found)


def aws_credentials_source() -> str | None:
    """How botocore would sign requests here ('env', 'shared-credentials-file', 'iam-role', ...),
    or None when it finds no credentials: the chain s3:// storage uses. Raises what botocore
    raises for a broken configuration (a missing AWS_PROFILE, say)."""
    import botocore.session

    credentials = botocore.session.get_session().get_credentials()
    return None if credentials is None else (credentials.method or "found")


def _probe(url: str, found: Findings) -> None:
    """Write, read back and delete a small object under `url` (Store.check)."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable

    try:
        open_store(url, retry_seconds=PROBE_RETRY_S).check()
    except StorageConfigError as e:         # no such bucket, access denied, credentials refused
        found.problems.append(f"spec.storage: {first_line(e)}")
    except StorageUnavailable as e:
        raise StorageUnreachable(f"spec.storage: {first_line(e)}; nothing was submitted or started") from None


# --- the model --------------------------------------------------------------------------------------


def _check_model(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """The model's config.json (and each reward model's) is found here (a hub id's fetched into
    the cache): the memory fit is checked by every apply. A config the estimate cannot read (dry
    run: refused by the estimate itself) is said on apply and --detach, never passed over in silence."""
    from grpo_run.runner.estimate.config import model_config, reward_model_configs
    from grpo_run.runner.estimate.memory import model_shape

    try:
        reward_model_configs(job)        # their memory is counted in the fit: found here, or said
    except (LookupError, ValueError) as e:
        found.problems.append(str(e))
    try:
        config = model_config(job.model)
    except (LookupError, ValueError) as e:
        text = str(e)
        found.problems.append(text if text.startswith("spec.model") else f"spec.model: {text}")
        return
    if mode == "dry-run":
        return
    try:
        model_shape(config)
    except ValueError as e:
        found.warnings.append(f"spec.model: the memory fit on spec.gpu is not checked: {first_line(e)}")


def _check_folders(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """A model given as a folder of this machine, for a job another node may run (--detach, or a
    dry run of a job with storage): that node needs the folder at the same path, or the job fails
    there on its first try (trainer.model.missing)."""
    if mode == "apply" or (mode == "dry-run" and job.storage is None):
        return
    named = [("spec.model", job.model)] + [(f"spec.environment.rewards.{i}.model", r.model)
                                          for i, r in enumerate(job.environment.rewards) if r.model]
    for where, path in named:
        if Path(path).is_dir():
            found.notes.append(f"{where}: {path} is a folder on this machine: a node runs this job only if the "
                               "same folder is at that path there (a hub id, or the folder in the node's image)")


# --- the tasks --------------------------------------------------------------------------------------


def _check_tasks(job: TrainingJob, found: Findings) -> None:
    """The first rows of every task file and local data set, as the trainer will read them."""
    env = job.environment
    base = "spec.environment"
    if not env.reads_tasks:
        for split, path in (env.dataFiles or {}).items():     # gsm8k's own files
            found.problems += gsm8k_problems(path, f"{base}.dataFiles.{split}")
        return
    from grpo_run.trainer.envs.catalog import CATALOG

    check = CATALOG[env.name].task_problem if env.is_catalog else None   # code: each task's tests
    for key in ("tasks", "evalTasks"):
        path = getattr(env, key)
        if path is not None:
            found.problems += task_file_problems(path, env.columns, f"{base}.{key}", check)
    for split, path in (env.dataFiles or {}).items():
        found.problems += task_file_problems(path, env.columns, f"{base}.dataFiles.{split}", check)
    if env.dataset is not None:
        if not Path(env.dataset).exists():
            found.notes.append(f"{base}.dataset: {env.dataset} is a data set on the hub, not read here; its columns "
                               "are checked when a node loads it")
            return
        found.problems += dataset_problems(env, f"{base}.dataset")


# --- the rewards ------------------------------------------------------------------------------------


def _check_rewards(job: TrainingJob, found: Findings) -> None:
    """Each of the job's own reward functions loaded by the grader's sandboxed worker, as the
    trainer's Scorer will load it (same search path and memory limit), with every layer of the
    sandbox in force (strict): a dry run or a submission must not run a bundle's code on this
    machine with less. Where this machine lacks a layer the reward is not loaded here, and a note
    says so (the node loads it in its own sandbox when the job starts). The product's catalog
    rewards are not loaded: they ship with grpo-run."""
    from grpo_run.trainer.grader.grader import Grader, RewardFunctionError, SandboxUnavailable

    env, p = job.environment, job.parameters
    if env.reward is not None:
        refs = [("spec.environment.reward", env.reward)]
    else:
        refs = [(f"spec.environment.rewards.{i}.function", r.function) for i, r in enumerate(env.rewards)]
    for where, ref in refs:
        if ref is None or ":" not in ref or ref.startswith("grpo_run."):    # a reward model, a catalog reward
            continue
        try:
            with _quiet_grader():
                Grader(ref, search_path=env.path, timeout_s=p.rewardTimeoutSeconds,
                       memory_mb=p.rewardMemoryMB, retries=0, strict=True).close()
        except SandboxUnavailable as e:     # before any of the reward's code ran
            found.notes.append(f"{where}: not loaded on this machine, which cannot sandbox it fully (missing: "
                               f"{', '.join(e.missing)}); the node loads it in its sandbox when the job starts")
            return
        except RewardFunctionError as e:
            found.problems.append(f"{where}: {_reward_fix(e.summary, ref)}")


def _check_episodes(job: TrainingJob, found: Findings) -> None:
    """The job's episodes environment loaded by the grader's sandboxed worker, as the trainer's
    EnvironmentHost will load it, strict as the rewards are (`_check_rewards`), and checked to be
    a class with reset(task, seed) and step(reply)."""
    from grpo_run.trainer.envs.catalog import ANSWER_AFTER_TOOLS
    from grpo_run.trainer.episodes.host import EnvironmentFailed, EnvironmentHost
    from grpo_run.trainer.grader.grader import SandboxUnavailable

    env, p = job.environment, job.parameters
    if not env.plays_episodes:
        return
    field = "episodes" if env.episodes else "tools"
    try:
        with _quiet_grader():
            EnvironmentHost(env.episodes or ANSWER_AFTER_TOOLS, search_path=env.path, timeout_s=p.rewardTimeoutSeconds,
                            memory_mb=p.rewardMemoryMB, retries=0, strict=True, tools=env.tools).close()
    except SandboxUnavailable as e:
        found.notes.append(f"spec.environment.{field}: not loaded on this machine, which cannot sandbox it fully "
                           f"(missing: {', '.join(e.missing)}); the node loads it in its sandbox when the job starts")
    except EnvironmentFailed as e:
        if e.summary.startswith("ToolProblem: ") or env.episodes is None:
            found.problems.append(f"spec.environment.tools: {e.summary.removeprefix('ToolProblem: ')}")
            return
        summary = e.summary.removeprefix("TypeError: ")
        name = e.ref.rpartition(":")[2]
        if not summary.startswith((name + " ", name + ".", name + "(")):      # not the class check's own words
            summary = _reward_fix(e.summary, env.episodes).replace(":FUNCTION)", ":CLASS)")
        found.problems.append(f"spec.environment.episodes: {summary}")


def _check_tool_format(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """A job with tools on a model whose chat template teaches no tool-call format grpo-run reads
    (trainer.episodes.tokens.tool_format_of) is refused at apply, where the model is here: its
    calls would otherwise be read as answers."""
    from grpo_run.runner.home import ensure_model
    from grpo_run.trainer.episodes.tokens import ToolFormatUnknown, tool_format_of
    from grpo_run.trainer.model.policy import load_tokenizer

    if mode != "apply" or not job.environment.tools:
        return
    try:
        tokenizer = load_tokenizer(ensure_model(job.model))
    except (OSError, ValueError):        # a model that is not here: _check_model says so
        return
    try:
        tool_format_of(tokenizer)
    except ToolFormatUnknown as e:
        found.problems.append(f"spec.environment.tools: the model {e}")


def _check_vocabulary(job: TrainingJob, found: Findings) -> None:
    """A warning for the first rows' prompts (task files, local data sets; an episodes
    environment's first prompt, from reset) with characters the model's tokenizer does not know:
    tiny:char reads 20 tokens, and the rest of a newcomer's first own prompt would be <unk>. Only
    tokenizers this machine has without a download (tiny:char, a local model folder) are asked;
    byte-level ones (Qwen's, Llama's) have no unknown token. The observations are checked at the
    first episode (trainer.episodes.tokens)."""
    from grpo_run.trainer.episodes.tokens import unknown_characters_problem

    tokenizer = _local_tokenizer(job.model)
    if tokenizer is None:
        return
    env = job.environment
    sources = {f"spec.environment.{key}": getattr(env, key) for key in ("tasks", "evalTasks")}
    sources |= {f"spec.environment.dataFiles.{split}": path for split, path in (env.dataFiles or {}).items()}
    first_task = None
    for where, path in sources.items():
        if path is None or not env.reads_tasks:
            continue
        try:
            rows = first_rows(path)
        except ValueError:
            continue                            # _check_tasks said why
        for i, row in enumerate(rows, 1):
            task = {**row, **{k: row.get(c) for k, c in env.columns.items()}} if isinstance(row, dict) else {}
            first_task = first_task or (task if "prompt" in task else None)
            problem = unknown_characters_problem(tokenizer, task.get("prompt"), f"{where}: {Path(path).name} row {i}'s prompt")
            if problem:
                found.warnings.append(problem)
                break
    if env.episodes and first_task is not None:
        prompt = _first_episode_prompt(job, first_task)
        problem = unknown_characters_problem(tokenizer, prompt, "spec.environment.episodes: reset's first prompt")
        if problem:
            found.warnings.append(problem)


def _local_tokenizer(model: str):
    """The tokenizer of `model` when this machine has it without a download and it has an unknown
    token (tiny:char, a local folder); None otherwise."""
    if model == "tiny:char":
        from grpo_run.trainer.model.tinymodel import build_tokenizer

        return build_tokenizer()
    if not Path(model).is_dir():
        return None
    try:
        with quiet("transformers"):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:                       # a folder without a tokenizer: the model check says so
        return None
    return tokenizer if getattr(tokenizer, "unk_token_id", None) is not None else None


def _first_episode_prompt(job: TrainingJob, task: dict[str, Any]) -> Any:
    """What the episodes environment's reset returns for `task` (seed 0), from the grader's sandboxed
    worker as the trainer runs it; None when it cannot be had here (the environment's own problems
    are _check_episodes')."""
    from grpo_run.trainer.episodes.host import EnvironmentHost

    env, p = job.environment, job.parameters
    try:
        with _quiet_grader():
            host = EnvironmentHost(env.episodes, search_path=env.path, timeout_s=p.rewardTimeoutSeconds,
                                   memory_mb=p.rewardMemoryMB, retries=0, strict=True, tools=env.tools)
            try:
                return host.reset([task], [0])[0]
            finally:
                host.close()
    except Exception:
        return None


def _check_judges(job: TrainingJob, mode: Mode, found: Findings) -> None:
    """An LLM judge needs its node's allow (runner.spec.judge): refused here when this machine
    is the node (apply), a note when another node will run it (a dry run, --detach)."""
    from grpo_run.runner.spec.judge import ALLOW_JUDGES_ENV, JUDGE_KEYS_ENV, judges_refused

    refused = judges_refused(job.environment)
    if mode == "apply":
        found.problems += refused
    elif refused:
        i = next(i for i, r in enumerate(job.environment.rewards) if r.judge is not None)
        found.notes.append(f"spec.environment.rewards.{i}.judge: the node that runs this job needs "
                           f"{ALLOW_JUDGES_ENV}=1 in its environment, and the judge's apiKeyEnv in its "
                           f"{JUDGE_KEYS_ENV}, to call the judge (this machine does not have it)")


def _reward_fix(summary: str, ref: str) -> str:
    """The grader's one line on a load failure, with what to do about it."""
    module, _, function = ref.rpartition(":")
    if " has no " in summary and "; it defines:" in summary:
        return f"{summary}: give one of those after the ':' ({Path(module).name}:FUNCTION)"
    if "SyntaxError" in summary or "IndentationError" in summary:
        return f"{summary}: fix the file (it is imported as the trainer's grader imports it)"
    return f"importing {Path(module).name if module.endswith('.py') else module} for {function} failed: {summary}"


def _quiet_grader():
    """The grader's warning that this machine cannot sandbox fully is about this machine, not the
    node the job runs on: left out of the preflight."""
    return quiet("grpo_run.trainer.grader.grader", logging.ERROR)
