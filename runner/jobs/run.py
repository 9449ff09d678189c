"""Applying a job: read and checked (the preflight and the estimate), then run in the foreground
on this node by the supervisor, or submitted to its storage; running one found in storage (resume).

Refusals are raised as Refused (runner/exits.py) in the words the CLI prints, with its exit status;
what a run tells as it goes (the budget's warning, a submission's lines, the summary) is written by
runner/views/outcome.py and handed to the caller's `tell` (the CLI's and the Python API's print it).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_run.state.record import RECORD_FILE
from grpo_run.runner.exits import EXIT_FAILED, EXIT_HELD, EXIT_OK, EXIT_USAGE, Refused
from grpo_run.runner.home import home, job_store_url, work_dir
from grpo_run.runner.jobs.find import before_the_lease, get_job, job_doc
from grpo_run.runner.text import dump, printable
from grpo_run.runner.views import outcome
from grpo_run.runner.views.outcome import Tell, to_terminal
from grpo_run.state.phases import Phase
from grpo_run.trainer.startup import clock


@dataclass(frozen=True)
class Checked:
    """A job file read and checked as `apply` does, before anything starts."""
    file: str                          # the job file (for the messages)
    job: Any                           # its TrainingJob
    estimate: dict[str, Any] | None    # status.estimate (None when the model's config cannot be read here)
    refusal: str | None                # why it does not fit the GPU (apply refuses it; a dry run shows it)
    sampler: dict[str, str] | None = None   # the engine that would sample it, and why (a dry run shows it)

    def dry_run_doc(self) -> dict[str, Any]:
        """The whole job with status.estimate, as `apply --dry-run -o yaml` prints it."""
        est = self.estimate
        doc = self.job.to_dict()
        doc["status"] = {"phase": str(Phase.PENDING),
                         "estimate": {**est, "refusal": self.refusal} if self.refusal and est else est}
        if self.sampler:
            doc["status"]["sampler"] = self.sampler
        return doc


def sampler_lines(sampler: dict) -> str:
    """The dry run's sampler line(s): the engine and why; for a job with storage whose run here
    (apply without --detach) would sample otherwise than a node's, that too (Checked.sampler)."""
    here = sampler.get("here")
    if here is None:
        return f"  sampler     {sampler['engine']}: {sampler['why']}"
    return (f"  sampler     on a node it is submitted to (--detach): {sampler['engine']}: {sampler['why']}\n"
            f"              here (apply without --detach): {here['engine']}: {here['why']}")


def check_job_file(file: str, *, dry_run: bool, detach: bool, live=None) -> Checked:
    """Read the job file, run apply's preflight and estimate it. Raises Refused: a job file that
    is missing or wrong (EXIT_USAGE, its problems all at once), a preflight refusal, a model
    config that a dry run cannot read. A GPU it does not fit is in Checked.refusal: a dry run
    shows the job anyway."""
    from grpo_run.runner.spec.job import JobError, load_job

    try:
        job = load_job(file)
    except FileNotFoundError:
        raise Refused(f"no such job file: {file}", EXIT_USAGE) from None
    except JobError as e:
        raise Refused(str(e), EXIT_USAGE, prefixed=False) from None
    return check_job(file, job, dry_run=dry_run, detach=detach, live=live)


def check_job(file: str, job, *, dry_run: bool, detach: bool, live=None) -> Checked:
    """check_job_file for a TrainingJob already built (the Python API builds one from arguments)."""
    from grpo_run.runner.estimate.estimate import check_fits, estimate
    from grpo_run.runner.jobs.preflight import check_before_apply, decided_here, sampler_choice

    check_before_apply(file, job, dry_run=dry_run, detach=detach)   # reward, tasks, storage, model: before any node
    choice = None
    try:
        choice = sampler_choice(job, here=decided_here(job, "dry-run" if dry_run else "detach" if detach else "apply"))
    except (LookupError, ValueError):
        pass                                     # refused above (ValueError) or said by the preflight
    try:
        # live: --live's prices (runner/estimate/liveprices.py)
        est = estimate(job, sampler=choice.engine if choice else None, live=live)
    except (LookupError, ValueError) as e:     # config.json not found here / not readable
        if dry_run:
            raise Refused(str(e), EXIT_USAGE) from None
        est = None                               # a real run may still fetch the model
    sampler = None
    if dry_run and choice:
        sampler = {"engine": choice.engine, "why": choice.why, **({"version": choice.version} if choice.version else {})}
        if job.parameters.staleness:               # asynchronous sampling (trainer.ahead), as `get tj` shows it
            sampler["staleness"] = job.parameters.staleness
    if sampler and job.storage is not None:
        # A job with storage may run on a GPU node (the prediction above) or here (apply without
        # --detach): where the two differ (tiny:char: vLLM on a GPU node, native on this CPU), both
        # are said, so the dry run never contradicts the run that follows it here.
        try:
            here = sampler_choice(job, here=True)
        except (LookupError, ValueError) as e:
            here = None
            sampler["here"] = {"engine": "none", "why": str(e)}
        if here is not None and here.engine != choice.engine:
            sampler["here"] = {"engine": here.engine, "why": here.why}
    return Checked(file, job, est, check_fits(est) if est else None, sampler)


def start(checked: Checked, *, detach: bool, output: str | None, stop: threading.Event,
          progress: bool | None = None, nodes: tuple[int | None, int | None, str | None] = (None, None, None),
          tell: Tell = to_terminal) -> int:
    """What `apply` does once the job is checked: refuse a GPU it does not fit, record its files'
    hashes, then train it here in the foreground (run_job) or submit it (submit_job). Returns
    the exit status; raises Refused."""
    from grpo_run.runner.jobs.envfiles import with_file_hashes

    if checked.refusal:                        # refused before anything starts, with the numbers
        raise Refused(checked.refusal, EXIT_USAGE, prefixed=False)
    if checked.estimate:                       # it runs, but the budget ends training early: said first
        from grpo_run.runner.estimate.summary import budget_warning

        if short := budget_warning(checked.job.name, checked.estimate, checked.job.maxCostUSD):
            tell(short, err=True)
    try:
        job = with_file_hashes(checked.job)    # what the job's files are now, recorded in its spec
    except ValueError as e:
        raise Refused(str(e), EXIT_USAGE) from None
    if detach:
        return submit_job(job, checked.estimate, output, tell=tell)
    return run_job(job, output=output, stop=stop, progress=progress, job_file=checked.file, nodes=nodes, tell=tell,
                   estimate=checked.estimate)


def submit_job(job, est: dict | None, output: str | None, *, tell: Tell = to_terminal) -> int:
    """`apply --detach`: write the job (and the installed grpo-run's wheel) into its storage,
    Pending, for a node to train; nothing runs here. Raises Refused."""
    from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable
    from grpo_run.runner.jobs.find import remember
    from grpo_run.runner.jobs.submit import SubmitRefused, submit
    from grpo_run.runner.supervisor.supervisor import node_name
    from grpo_run.runner.deploy.wheel import WheelError, build_wheel

    storage = job.storage
    if storage is None:
        raise Refused(f"{job.name}: spec.storage is not set, so the job would stay in this machine's own store, where "
                      "no node can reach it: set spec.storage (e.g. s3://bucket/prefix) to submit it with --detach",
                      EXIT_USAGE)
    with tempfile.TemporaryDirectory(prefix="grpo-run-wheel-") as tmp:
        try:
            wheel = build_wheel(Path(tmp))       # nodes install exactly this grpo-run (runner/deploy/wheel.py)
            done = submit(job, job_store_url(storage, job.name), holder=f"submit@{node_name()}", wheel=wheel,
                          estimate=est)
        except SubmitRefused as e:
            raise Refused(printable(str(e)), EXIT_USAGE) from None       # it names the phase storage holds
        except (StorageConfigError, StorageUnavailable, LookupError, ValueError, WheelError) as e:
            raise Refused(str(e), EXIT_FAILED) from None
    remember(home(), job.name, storage)
    if output:
        tell(dump(get_job(job.name, storage), output))
        return EXIT_OK
    tell(outcome.submitted(job.name, done.outcome, done.url, done.phase, est, nodes=job.nodes or 1, storage=storage))
    return EXIT_OK


def run_job(job, *, output: str | None, stop: threading.Event, storage: str | None = None, store=None,
            trust_urls: bool | None = None, progress: bool | None = None, job_file: str | None = None,
            nodes: tuple[int | None, int | None, str | None] = (None, None, None), tell: Tell = to_terminal,
            estimate: dict[str, Any] | None = None) -> int:
    """Supervise an attempt at `job` on this node; outputs under `storage` (default: the job's
    spec.storage, else $GRPO_RUN_HOME/store). `store`: the job's store, already checked (resume).
    What the job needs is decided from storage's record: read here to skip a finished job, then
    fetched by the supervisor once it holds the lease (this node's copy may be older).
    `trust_urls`: None for a job file applied here (the operator's own word: its files are
    uploaded once the lease is held); True or False for a job read from storage (resume: its
    files are the stored copies, and its URLs the node's unless True). `stop`: set it to stop
    the run as a SIGINT does (checkpoint durable, Preempted). `progress`: whether the trainer
    draws its progress bar on stderr (None: when stderr is a terminal, or GRPO_RUN_PROGRESS=1).
    `job_file`: where the job came from (a path, or the Python API's source), for the advice
    after a failure in the job's own code (None: a job read from storage). `nodes`: --nnodes,
    --node-rank and --master (None: from the launcher's environment, runner.jobs.nodes): on one
    of several nodes rank 0 supervises, the others run their ranks only (runner.supervisor.follower).
    `estimate`: apply's status.estimate, recorded for the spend to be set against (None: resume).
    Returns the exit status; raises Refused for a failure before or around the run (storage, a
    full disk, another node's lease)."""
    from grpo_run.runner.hubtoken import token_for_stored
    from grpo_run.runner.jobs.nodes import NodesError, resolve

    try:
        place = resolve(job, *nodes)       # before anything is taken: no lease, no download
    except NodesError as e:
        raise Refused(str(e), EXIT_USAGE) from None
    from grpo_run.trainer.protocol import PROGRESS_ENV

    if progress is None:
        progress = sys.stderr.isatty() or os.environ.get(PROGRESS_ENV) == "1"
    # resume: the stored spec chose the hub ids; this node's token goes only to those it allows
    with token_for_stored(job) if trust_urls is not None else contextlib.nullcontext():
        return _run_job(job, output=output, stop=stop, storage=storage, store=store, trust_urls=trust_urls,
                        progress=progress, job_file=job_file, nodes=place, tell=tell, estimate=estimate)


def _run_job(job, *, output: str | None, stop: threading.Event, storage: str | None, store,
             trust_urls: bool | None, progress: bool, job_file: str | None, nodes, tell: Tell,
             estimate: dict[str, Any] | None) -> int:
    """run_job's work, with the hub token as run_job decided. A trainer alone is started as soon
    as the job's store is open (runner.supervisor.spawn: its imports, and the tiny demo model's
    build, beside the rest of the node's path to its first step), for the first attempt."""
    with contextlib.ExitStack() as stack:
        return _run_job_prewarmed(job, output=output, stop=stop, storage=storage, store=store, trust_urls=trust_urls,
                                  progress=progress, job_file=job_file, nodes=nodes, stack=stack, tell=tell,
                                  estimate=estimate)


def _run_job_prewarmed(job, *, output: str | None, stop: threading.Event, storage: str | None, store,
                       trust_urls: bool | None, progress: bool, job_file: str | None, nodes,
                       stack: contextlib.ExitStack, tell: Tell, estimate: dict[str, Any] | None) -> int:
    """_run_job's work; `stack` ends the trainer started early unless an attempt took it."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable
    from grpo_run.runner.jobs.envfiles import environment_uploads, localize_environment
    from grpo_run.runner.supervisor.runspec import build_run_spec
    from grpo_run.runner.jobs.stored import as_this_node_runs_it
    from grpo_run.runner.supervisor.diskfull import disk_full, disk_full_message
    from grpo_run.runner.supervisor.supervisor import Supervisor
    from grpo_run.runner.supervisor.spawn import prewarmed_trainer

    storage = storage or job.storage
    url = job_store_url(storage, job.name)
    work = work_dir(job.name)
    try:
        if store is None:
            store = open_store(url, stop=stop)       # a notice stops its retries and bounds its calls
            store.check()                      # a bad bucket or credentials fail before any work
        with clock().part("record check"):     # one read: over already? the threads the run's first trainer took
            over, missing, threads = before_the_lease(job, store)
        if over is not None:        # exit 0 for a cancelled job too: a boot unit or a Job's retry ends quietly
            phase, done = over
            tell(outcome.nothing_to_do(job.name, phase, done["status"].get("message", "")))
            if output:
                tell(dump(done, output))
            return EXIT_OK
        if missing is not None:             # before the lease: the job stays for a node that has the engine
            raise Refused(missing, EXIT_FAILED)
        alone = nodes is None and (job.resources is None or job.resources.processes == 1)
        kept = threads if alone and trust_urls is not None else None   # a resume's trainer: the first trainer's
        prewarmed = stack.enter_context(prewarmed_trainer(work, alone=alone, progress=progress, model=job.model,
                                                          kept_threads=kept))
        if trust_urls is None:                 # apply: the files as the job file names them, sent under the lease
            local, uploads = job, environment_uploads(job)
        else:                                  # resume: nothing of this node's is read or sent for the job
            with clock().part("job files"):
                local = as_this_node_runs_it(localize_environment(job, store, work), trust_urls=trust_urls)
            uploads = ()
        spec = build_run_spec(job, url, local=local, uploads=uploads, nodes=nodes, estimate=estimate,
                              model_path=prewarmed.model_path if prewarmed is not None else None)
        if nodes is not None and nodes.rank > 0:      # rank 0's node holds the job: this one runs its ranks only
            from grpo_run.runner.supervisor.follower import Follower
            from grpo_run.runner.supervisor.supervisor import DEFAULT_NOTICE_WINDOW_S

            result = Follower(spec, work, watchers=watchers_for(local), notice_window_s=DEFAULT_NOTICE_WINDOW_S,
                              progress=progress, preempt=stop).run()
            tell(f"{job.name}: {result.message}", err=bool(result.exit_code))
            return result.exit_code
        with clock().part("notice watchers"):
            watchers = watchers_for(local)
        result = Supervisor(spec, work, store=store, watchers=watchers, progress=progress,
                            preempt=stop, prewarmed=prewarmed).run()
    except (StorageConfigError, StorageUnavailable, ValueError, LookupError) as e:
        raise Refused(str(e), EXIT_FAILED) from None
    except (OSError, sqlite3.OperationalError) as e:
        if not disk_full(e, work):
            raise
        raise Refused(f"{job.name}: {disk_full_message(work, str(e), _durable_here(work))}", EXIT_FAILED) from None
    if result.exit_code == EXIT_HELD:
        raise Refused(f"{job.name}: another node holds the job, so this node does not train it: "
                      f"{printable(result.message)}", EXIT_HELD)
    doc = job_doc(work / RECORD_FILE)
    if result.already_succeeded:   # finished by another node while this one waited for its lease: said as above
        tell(outcome.nothing_to_do(job.name, Phase.SUCCEEDED))
        if output:
            tell(dump(doc, output))
        return EXIT_OK
    if result.exit_code == EXIT_OK and job.gpu:
        remember_step_time(job, doc["status"])
    if result.exit_code == EXIT_FAILED:
        tell(outcome.failed(job.name, result.message or doc["status"].get("message", "")), err=True)
    if output:
        tell(dump(doc, output))
    else:
        tell(outcome.run_summary(job.name, doc["status"], result, job_file=job_file, nodes=job.nodes or 1,
                                 storage=storage))
    return result.exit_code


def _durable_here(work: Path) -> int:
    """The newest durable checkpoint this node's record knows of (0 when it cannot be read)."""
    try:
        return int(job_doc(work / RECORD_FILE)["status"]["checkpoints"].get("latestDurable") or 0)
    except Exception:           # a record the full disk left unreadable: the message goes without it
        return 0


def remember_step_time(job, status: dict) -> None:
    """A finished run on a GPU teaches the estimates its measured step time (runs on a CPU, or
    on a GPU other than spec.gpu says, would teach them wrong)."""
    from grpo_run.runner.estimate.estimate import record_measured_step_seconds
    from grpo_run.runner.estimate.measured import sampled_length

    device = status.get("device") or ""
    seconds = status.get("medianStepSeconds")
    sampler = status.get("sampler") or {}
    if device.startswith("cuda") and seconds:
        record_measured_step_seconds(job.gpu, seconds, job.name, model=job.model,
                                     completion_length=sampled_length(job.to_dict()["spec"]),
                                     sampler=sampler.get("engine") or "native",
                                     engine_start_seconds=sampler.get("startSeconds"))


def watchers_for(job):
    """Spot-notice watchers: spec.notices.clouds, else GRPO_RUN_NOTICES (auto: every cloud whose
    metadata service answers; a comma-separated list of aws, gcp, azure; none). SIGTERM and
    SIGINT always count. spec.notices.*MetadataURL override the GRPO_RUN_*_METADATA_URL variables."""
    from grpo_run.runner.notices.clouds import make_watchers

    clouds: Any = os.environ.get("GRPO_RUN_NOTICES", "auto")
    urls: dict[str, str] = {}
    if job.notices is not None:
        clouds = job.notices.clouds
        urls = dict(job.notices.urls)
    if clouds == "none":
        return []
    if isinstance(clouds, str) and clouds != "auto":
        clouds = clouds.split(",")
    return make_watchers(clouds, base_urls=urls)
