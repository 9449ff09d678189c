"""The seam between the supervisor (runner/) and one trainer process: everything both sides must
agree on, in one file. The trainer speaks through it, the supervisor listens through it, and
neither learns anything else about the other. Light to import (pydantic, no torch): the
supervisor never loads the trainer's machinery.

    plan.json     PLAN_FILE in the work folder: the `Plan`, written by the supervisor before it
                  starts the trainer (`python -m grpo_run.trainer.child WORK/plan.json`)
    events        one JSON object per line, each a `TrainerEvent`, on the descriptor named by
                  EVENTS_FD_ENV (under accelerate's launcher, the path in EVENTS_PATH_ENV); the
                  supervisor reads them with `parse_event`
    signals       STOP_SIGNAL: stop at the last completed step, seal it, exit CHILD_STOPPED;
                  CHECKPOINT_SIGNAL: checkpoint at the next step boundary and keep training
                  (sent only after the trainer's first event: before its handler is installed
                  the default action would kill it)
    exit status   CHILD_*: how the process ended

Events, in the order they happen (rank 0 reports all of them, other ranks only `Failed`):

    Started        the trainer is up, its signal handlers installed; resumed from `step` (0: none)
    PhaseStarted   BaselineEval | Training | FinalEval
    EvalBatch      one held-out evaluation batch finished (a stopped evaluation resumes by batch)
    Evaluated      a whole baseline or final evaluation
    Samples        what the model wrote: a step's first groups (just before its Step), or an
                   evaluation's first held-out tasks (before that batch's EvalBatch, or HeldOut)
    Step           a completed training step and its metrics
    JudgeCalls     the run's answered calls of each LLM judge, after a step or evaluation batch that called one
    HeldOut        the held-out evaluation every evalSteps, while training
    Sealed         a checkpoint sealed on the local disk (its manifest hashed once, trusted after)
    Final          the final weights sealed on the local disk
    Stopped        stopped on request or at the plan's budget, the last completed step sealed
    Failed         what went wrong, just before a CHILD_CODE_ERROR or CHILD_CRASHED exit
"""

from __future__ import annotations

import enum
import json
import signal
import threading
from typing import IO, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, model_serializer, model_validator

from grpo_run.checkpoint.manifest import KEEP_CHECKPOINTS
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import Environment

# --- the work folder and the environment ---------------------------------------------------------

PLAN_FILE = "plan.json"
CHECKPOINTS_DIR = "checkpoints"             # the supervisor restores into it, the trainer resumes from and seals into it
# In every checkpoint: each step's metrics so far ([{"step": n, **metrics}], oldest first), the
# record's steps for a restore to fill in when a node was lost before its record reached storage.
# The trainer's own state in a checkpoint (optimizer's layout, scheduler, RNG, and the number of
# completed steps it resumes after): the supervisor checks that step against the manifest's.
TRAINER_STATE = "trainer_state.json"
STEP_METRICS = "metrics.json"
# ... and the samples of its newest CHECKPOINT_SAMPLE_STEPS steps ({step: [group, ...]}), which the
# restore fills in likewise for the steps it fills in (the steps a lost record upload left out).
STEP_SAMPLES = "samples.json"
CHECKPOINT_SAMPLE_STEPS = 100
EVENTS_FD_ENV = "GRPO_RUN_EVENTS_FD"        # the events pipe's write end, inherited
EVENTS_PATH_ENV = "GRPO_RUN_EVENTS_PATH"    # ... by path: torchrun closes inherited descriptors
PARENT_ENV = "GRPO_RUN_PARENT_PID"          # the pid the trainer dies with (the supervisor, or the launcher)
# One trainer process alone (not under a launcher): the read end of a pipe from the supervisor, which
# starts it before its plan is final. Lines: CONTROL_PLAN and a JSON object ("the plan is written: load
# the model, the graders, the engine"; the object sets, or with null unsets, variables of LATE_ENV)
# once plan.json is there; CONTROL_GO ("the checkpoint is restored and plan.json rewritten for the
# attempt: go on") once the checkpoint fetch beside the load has ended. End of file instead: the
# supervisor gave the process up; it exits without a word.
CONTROL_FD_ENV = "GRPO_RUN_CONTROL_FD"
# ... and, started before its plan, asked to build a tiny demo model ({"name", "path"}: trainer.model.tinymodel)
# while it waits (it has torch and transformers imported; the supervisor has not): one line on the pipe
# PREBUILT_FD_ENV names, "ok" or "error ...", once the model is there or could not be built.
PREBUILD_ENV, PREBUILT_FD_ENV = "GRPO_RUN_PREBUILD", "GRPO_RUN_PREBUILT_FD"
CONTROL_PLAN, CONTROL_GO = "plan", "go"
PROGRESS_ENV = "GRPO_RUN_PROGRESS"          # "1": a progress bar on the terminal (also a user's switch for the CLI)
HOME_ENV = "GRPO_RUN_HOME"                  # the node's grpo-run folder (runner.home); an empty value: ~/.grpo-run
SHARE_ENV = "GRPO_RUN_CPU_SHARE"            # the node's pool of threads to share (trainer.threads); absent: torch's own
# Variables a trainer reads only once its plan is there (never at import): a trainer started before its
# plan (runner.supervisor.spawn) is given these with CONTROL_PLAN; any other must be the same from its start.
# TORCHINDUCTOR_CACHE_DIR: torch's inductor writes its own default into os.environ when first asked.
LATE_ENV = (SHARE_ENV, "TORCHINDUCTOR_CACHE_DIR")
# Several nodes (runner.jobs.nodes): how many, this node's rank, rank 0's node's host:port for the
# rendezvous, and how long a node waits there for the others
NODES_ENV, NODE_RANK_ENV, MASTER_ENV = "GRPO_RUN_NODES", "GRPO_RUN_NODE_RANK", "GRPO_RUN_MASTER"
RENDEZVOUS_TIMEOUT_ENV = "GRPO_RUN_RENDEZVOUS_TIMEOUT_S"
NODES_SECRET_ENV = "GRPO_RUN_NODES_SECRET"   # several nodes: the same secret on each, from its launcher (trainer.distributed)
TORCH_MASTER_PORT = 29500                   # torch.distributed's default MASTER_PORT, where no launcher names one
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")   # torchrun's

# --- signals and exit statuses (the trainer's own protocol, not the CLI's exit codes) -------------

STOP_SIGNAL = signal.SIGTERM
CHECKPOINT_SIGNAL = signal.SIGUSR1

CHILD_DONE = 0             # every phase the plan asked for is done; the final weights are sealed
CHILD_CRASHED = 1          # an unexpected exception: the supervisor restarts it (crash limit)
CHILD_STOPPED = 3          # stopped on request or at the plan's budget, the last completed step sealed
CHILD_CODE_ERROR = 10      # the user's code or numbers: the reward function failed on every try, or a step's
                           # rewards, loss or gradient norm is not finite (trainer.NonFiniteStep), or a model the
                           # job names is not there (model.missing.ModelMissing): restarting replays the same step
                           # or load and cannot help; the job fails (never a preemption)
CHILD_INFRA_FAILED = 11    # a service outside the node (an LLM judge) did not answer past its own retries: the job
                           # fails as an infrastructure failure (never a score; `resume` tries again)
CHILD_NO_GROUP = 12        # several nodes: the rendezvous did not complete within its timeout (rank 0's node
                           # did not answer, or the other nodes did not come): nothing was trained


class TrainerPhase(str, enum.Enum):
    """The phases a trainer reports. They are named as the record names its phases, but the
    trainer cannot import the record (state/): the supervisor maps each explicitly
    (runner.supervisor.attempt.RECORD_PHASE)."""
    BASELINE_EVAL = "BaselineEval"
    TRAINING = "Training"
    FINAL_EVAL = "FinalEval"

    def __str__(self) -> str:
        return self.value


EvalKind = Literal["baseline", "final"]


class EvalSummary(BaseModel):
    """A held-out evaluation's figures, one model wherever they go: what the trainer reports
    (Evaluated, HeldOut), what the record and storage's baseline.json keep, and what a cached
    baseline must read as before it is reused. Whoever can write the job's prefix is not trusted
    (docs/security.md): a baseline.json that does not validate is evaluated again."""
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    meanReward: float                     # of the weighted sum of the rewards
    tasks: int = Field(ge=1)
    solved: int = Field(ge=0)             # tasks the primary (first) reward scored 1.0
    batches: int = Field(1, ge=1)         # evaluation batches in all
    reusedBatches: int = Field(0, ge=0)   # of them, finished by an earlier attempt and not computed again
    rewards: dict[Annotated[str, StringConstraints(min_length=1, max_length=200)], float] | None = Field(
        None, max_length=64)              # each reward function's mean, by name

    @model_validator(mode="after")
    def _counts(self) -> "EvalSummary":
        if self.solved > self.tasks or self.reusedBatches > self.batches:
            raise ValueError("solved must be at most tasks, reusedBatches at most batches")
        return self

    def to_dict(self) -> dict[str, Any]:
        """As the record, the trackers and storage's baseline.json hold it."""
        return self.model_dump(exclude_none=True)


# --- the plan ------------------------------------------------------------------------------------

class Budget(BaseModel):
    """spec.maxCostUSD as what this attempt may still spend: the GPU's time at `usd_per_hour`
    from `since`, and the priced calls of the run's LLM judges. `since` is a time.monotonic()
    taken in the supervisor's process: CLOCK_MONOTONIC is one clock for the whole machine on Linux."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    usd_left: float                       # maxCostUSD less every earlier attempt's spend and what the stop costs
    usd_per_hour: float | None = None     # the GPU's rate (None: GPU time is not charged)
    since: float                          # when this attempt's GPU time started counting

    def late(self, at: float, judges_usd: float = 0.0) -> bool:
        """Whether the spend would pass the budget by time.monotonic() `at` with `judges_usd`
        spent on judges in this attempt by then."""
        gpu = max(0.0, at - self.since) * (self.usd_per_hour or 0.0) / 3600
        return gpu + judges_usd > self.usd_left


class Plan(BaseModel):
    """What the supervisor asks of one trainer process, everything resolved."""
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    name: str
    model: str                            # what from_pretrained takes: a hub id or a folder
    env: Environment
    params: GRPOParams
    model_name: str | None = None         # the model as the user named it (saved adapters say this)
    keep_checkpoints: int = KEEP_CHECKPOINTS
    baseline: bool = True                 # evaluate the baseline (False: the supervisor has it)
    # batches an earlier attempt finished, by kind: {batch: {reward name: a score per task}}
    eval_done: dict[str, dict[int, dict[str, list[float]]]] = Field(default_factory=dict)
    budget: Budget | None = None          # spec.maxCostUSD: no step or evaluation may end past it (None: no limit)
    run_id: str | None = None             # the run's identity, written into each checkpoint's manifest
    # every layer of the reward sandbox must be in force, or no reward function runs (the job
    # fails, saying which layer is missing and how to get it); False: run with what the node allows
    sandbox_strict: bool = False
    judge_calls: dict[str, int] = Field(default_factory=dict)   # {judge reward: the run's answered calls so far}
    judge_usd: dict[str, float] = Field(default_factory=dict)   # {priced judge reward: the run's spend on it so far}
    # episodes: the digests recorded for the steps this attempt may replay ({step: [digest, ...]})
    episode_digests: dict[int, list[str]] = Field(default_factory=dict)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Raises pydantic.ValidationError for a plan this version did not write."""
        return cls.model_validate_json(text)


# --- the events ----------------------------------------------------------------------------------

class _Event(BaseModel):
    # Field names are the wire's (camelCase, as the record and the job file name things).
    model_config = ConfigDict(frozen=True, extra="forbid")


class Started(_Event):
    event: Literal["started"] = "started"
    step: int                             # the checkpoint resumed from, 0 for none
    device: str                           # "cpu" or "cuda:<the GPU's name>"
    microBatchSize: int                   # the run keeps the first attempt's (trainer.GRPOTrainer.micro_batch_size)
    cpuThreads: int                       # likewise: another count would round the arithmetic differently
    sandbox: dict[str, str] = Field(default_factory=dict)   # the reward sandbox's layers in force (Grader.sandbox_mode)
    # the engine that samples: {engine: native | vllm, version, mode, startSeconds} (Sampler.status)
    sampler: dict[str, str | int | float] = Field(default_factory=dict)
    # the process's start in parts, on the wall clock ({part, start, end}: trainer.startup), for the node's path
    # to its first new step (runner.supervisor.startup)
    startup: list[dict[str, str | float]] = Field(default_factory=list)


class PhaseStarted(_Event):
    event: Literal["phase"] = "phase"
    phase: TrainerPhase


class EvalBatch(_Event):
    event: Literal["evalBatch"] = "evalBatch"
    kind: EvalKind
    batch: int
    rewards: dict[str, list[float]]       # {reward name: a score per task of the batch}


class Evaluated(_Event):
    event: Literal["eval"] = "eval"
    kind: EvalKind
    result: EvalSummary
    noSignal: bool                        # every held-out reward equal: GRPO's groups would all be identical


# A kept prompt's or completion's text is at most SAMPLE_CHARS characters, and a note of how many
# more there were (trainer.kept_samples.capped); one longer did not come from a trainer (a cached
# baseline's samples are read back from storage) and does not validate.
SAMPLE_CHARS = 1000
CappedText = Annotated[str, Field(max_length=SAMPLE_CHARS + 40)]


class SampleCompletion(_Event):
    text: CappedText                      # capped (trainer.kept_samples.capped)
    rewards: dict[str, float]             # by reward name
    reward: float                         # the weighted sum
    advantage: float | None = None        # training steps only
    length: int                           # tokens
    truncated: bool                       # cut at maxCompletionLength; an episode: ended by a limit
    turns: int | None = None              # an episode's replies (None: single-turn)
    truncatedBy: Literal["maxTurns", "context", "toolTime", "stepTime"] | None = None   # the limit that ended an episode
    toolCalls: int | None = None          # an episode with tools: the calls it made
    toolErrors: int | None = None         # ... and how many were answered with an error
    # an episode turn by turn: its replies and the environment's answers, alternating, each capped
    exchange: list[CappedText] | None = Field(None, max_length=64)

    @model_serializer(mode="wrap")
    def _single_turn_as_before(self, handler: Any) -> dict[str, Any]:
        """A single-turn completion is written without the episode's fields (records, samples
        and events read as they did before episodes)."""
        out = handler(self)
        if self.turns is None:
            out.pop("turns", None)
            out.pop("truncatedBy", None)
        if self.exchange is None:
            out.pop("exchange", None)
        if self.toolCalls is None:
            out.pop("toolCalls", None)
            out.pop("toolErrors", None)
        return out


class SampleGroup(_Event):
    item: int                             # a step's group (0-based), or the held-out task's place among them
    prompt: CappedText                    # capped; chat messages as `role: content` lines
    completions: list[SampleCompletion]   # a group's G; an evaluation's one per task
    solved: bool                          # every completion scored 1 on the first reward (an evaluation's "solved")


SampleKind = Literal["step", "baseline", "final", "heldOut"]


class Samples(_Event):
    event: Literal["samples"] = "samples"
    kind: SampleKind
    step: int                             # the training step (1-based) they came from or were evaluated after
    groups: list[SampleGroup]             # a step's: all its kept groups (a redone step's replace them)


class JudgeCalls(_Event):
    event: Literal["judgeCalls"] = "judgeCalls"
    calls: dict[str, int]                 # {judge reward: the run's answered calls so far (Plan.judge_calls + this process's)}
    usd: dict[str, float] = Field(default_factory=dict)   # {priced judge reward: the run's spend so far (likewise)}


class Step(_Event):
    event: Literal["step"] = "step"
    step: int                             # completed steps
    metrics: dict[str, Any]
    # episodes: each one's "REPLIES:WHOLE" digests, in the step's order (trainer.episodes.replay)
    episodeDigests: list[str] | None = None


class HeldOut(_Event):
    event: Literal["heldOut"] = "heldOut"
    step: int
    result: EvalSummary


class Sealed(_Event):
    event: Literal["sealed"] = "sealed"
    step: int
    path: str                             # the checkpoint's folder on the local disk


class Final(_Event):
    event: Literal["final"] = "final"
    step: int
    path: str                             # the final weights' folder on the local disk


class Stopped(_Event):
    event: Literal["stopped"] = "stopped"
    step: int | None                      # the last completed step (None: stopped in the baseline evaluation)
    phase: TrainerPhase
    reason: Literal["requested", "deadline"]   # STOP_SIGNAL, or the next step would end past Plan.budget


class Failed(_Event):
    event: Literal["failed"] = "failed"
    message: str
    code: bool                            # the user's reward function or the job's numbers: restarting cannot help
    diskFull: bool = False                # the local disk is full: restarting cannot help either


TrainerEvent = Annotated[Union[Started, PhaseStarted, EvalBatch, Evaluated, Samples, JudgeCalls, Step, HeldOut, Sealed,
                               Final, Stopped, Failed], Field(discriminator="event")]
_EVENT = TypeAdapter(TrainerEvent)


def parse_event(line: str) -> TrainerEvent:
    """One line of the events pipe as its event. Raises ValueError (pydantic's ValidationError
    or json's JSONDecodeError) for a line that is none."""
    return _EVENT.validate_python(json.loads(line))   # json's parser: it reads the NaN a metric may be


class Events:
    """The trainer's one channel to the supervisor: a JSON line per event on a pipe (or, in
    tests and benchmarks, any text stream)."""

    def __init__(self, stream: IO[str], only: tuple[type[_Event], ...] | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._only = only          # the events this process reports (ranks other than 0: Failed)

    def emit(self, event: _Event) -> None:
        if self._only is not None and not isinstance(event, self._only):
            return
        line = json.dumps(event.model_dump(), default=float) + "\n"    # default: numpy and torch scalars
        with self._lock:
            self._stream.write(line)
            self._stream.flush()
