"""What the record's small-values table (kv) holds: every key named once, here, with the type of
its value. Writers (runner/books) and readers (the views) go through these accessors; no key is
spelled anywhere else.

Records outlive versions: a key is never renamed or given another meaning, and one no longer
written stays listed in RETIRED (old records still hold it).
"""

from __future__ import annotations

from typing import Callable, Generic, TypedDict, TypeVar

from grpo_run.state.record import EVAL_KINDS, Record

T = TypeVar("T")


class Value(Generic[T]):
    """One key of the kv table and the type of what it holds."""

    def __init__(self, key: str, empty: Callable[[], T] | None = None) -> None:
        self.key = key
        self._empty = empty          # what get() returns for a key never written (None without it)

    def get(self, record: Record) -> T | None:
        value = record.value(self.key)
        return self._empty() if value is None and self._empty is not None else value

    def set(self, record: Record, value: T) -> None:
        record.set_value(self.key, value)

    def __repr__(self) -> str:
        return f"Value({self.key!r})"


class LedgerEntry(TypedDict):
    seconds: float                # the attempt's wall time so far
    usd: float                    # ... at its rate
    usdPerHour: float | None      # None: no rate known (spec.gpu or spec.pricing unset)


class _RewardSignal(TypedDict):
    identicalGroupFraction: float
    window: int                   # the steps it was measured over


class RewardSignal(_RewardSignal, total=False):
    solvedGroupFraction: float    # of them, solved: every completion scored 1 on the first reward
    noSignalGroupFraction: float  # ... and all failed alike (the rest)
    warning: str                  # half the groups or more failed alike: nothing to learn from
    note: str                     # half the groups or more were solved: fine


class HeldOutPoint(TypedDict, total=False):
    step: int
    meanReward: float
    rewards: dict[str, float]
    solved: int


class SavedBatches(TypedDict):
    fingerprint: str                               # what the batches were computed for
    batches: dict[str, dict[str, list[float]]]     # batch (as text: JSON) -> {reward name: a score per task}


class EvalPlan(TypedDict):
    tasks: int                    # held-out tasks
    batches: int                  # evaluation batches they make


class Generation(TypedDict):
    number: int                   # the upload's: 1 for the record's first upload, one more for each after it
    writer: str                   # the Books that uploaded it (random per supervisor run): its own upload,
                                  # seen again after an answer was lost, is not another node's


class LastNotice(TypedDict):
    source: str                   # aws | gcp | azure | signal
    noticeToDurableSeconds: float
    durableStep: int


# The run's identity, in every checkpoint's manifest: a checkpoint of an earlier run under the
# same name (its record deleted, the job submitted again) is not this run's to continue.
RUN_ID: Value[str] = Value("runId")
# Which upload of the record this is. Storage's copy carries the generation it was uploaded as;
# this node's copy the generation of its own last upload that reached storage, so the two are
# equal exactly when nobody uploaded since (this node's copy is then storage's plus what it noted
# after). Compared before every upload: a record older than storage's is never uploaded.
GENERATION: Value[Generation] = Value("generation")
# Each attempt's spend, by attempt id (as text: JSON keys): the spend so far goes up with every
# upload of the record, so a node lost later still has it counted.
LEDGER: Value[dict[str, LedgerEntry]] = Value("ledger", dict)
# Chosen by the run's first trainer and kept: another count or size would round differently.
CPU_THREADS: Value[int] = Value("cpuThreads")
MICRO_BATCH_SIZE: Value[int] = Value("microBatchSize")
# The engine the run samples with: {engine, why} chosen at its first start (every attempt keeps it),
# then {version, mode, startSeconds} as the newest trainer reported them; status.sampler
SAMPLER: Value[dict] = Value("sampler")
DEVICE: Value[str] = Value("device")                       # "cpu" or "cuda:<GPU name>": what the newest trainer ran on
EVAL_PLAN: Value[EvalPlan] = Value("evalPlan")             # the size of one held-out evaluation, for `get tj -w`
HELD_OUT: Value[list[HeldOutPoint]] = Value("heldOut", list)   # the curve every evalSteps, by step
REWARD_SIGNAL: Value[RewardSignal] = Value("rewardSignal")    # identical groups over the newest steps
BASELINE_WARNING: Value[str] = Value("baselineWarning")   # the base model scores the same on every task
LAST_NOTICE: Value[LastNotice] = Value("lastNotice")      # the newest spot notice and how fast its step was durable
# What `apply` estimated before anything was spent (the dry run's figures, ESTIMATE_KEYS of them),
# written by the apply that started or submitted the job (a resume keeps it); status.estimate
ESTIMATE: Value[dict] = Value("estimate")
ESTIMATE_KEYS = ("startTime", "gpu", "gpus", "usdPerHour", "rateKind", "steps", "stepSeconds", "stepSecondsSource",
                 "evalSeconds", "completionSeconds", "costToCompletionUSD", "firstHoldUSD", "preemption")
# the newest node's path from its process's start to its first new step, in parts (runner.supervisor.startup):
# {attempt, totalSeconds, parts: [{part, startSeconds, seconds}]}
STARTUP: Value[dict] = Value("startup")
# {judge reward: the run's answered calls}, every attempt's (a restarted trainer counts on from it)
JUDGE_CALLS: Value[dict[str, int]] = Value("judgeCalls", dict)
# {priced judge reward: the run's spend on its calls, USD}, likewise: part of the run's cost (spent_usd)
JUDGE_USD: Value[dict[str, float]] = Value("judgeCostUSD", dict)
# Episodes: each step's episode digests ({step (as text): ["REPLIES:WHOLE", ...]}) until a durable
# checkpoint holds the step: a resume replays those steps and checks its environment answers alike.
EPISODE_DIGESTS: Value[dict[str, list[str]]] = Value("episodeDigests", dict)
# Evaluation batches a stopped attempt finished, kept for a resume to reuse.
EVAL_BATCHES: dict[str, Value[SavedBatches]] = {kind: Value(f"evalBatches.{kind}") for kind in EVAL_KINDS}
# The trackers' own continuity across attempts (runner.books.trackers).
MLFLOW_RUN_ID: Value[str] = Value("tracking.mlflowRunId")
WANDB_STEPS: Value[dict[str, int]] = Value("tracking.wandbSteps", dict)   # tag -> newest step written


def gpu_usd(record: Record) -> float:
    """Every attempt's GPU time at its rate, as the ledger has it."""
    return sum(v["usd"] for v in LEDGER.get(record).values())


def judges_usd(record: Record) -> float:
    """The run's spend on its LLM judges' priced calls."""
    return sum(JUDGE_USD.get(record).values())


def spend_usd(record: Record) -> float:
    """What the run has cost as the record has it: the GPU's time and the judges' calls."""
    return gpu_usd(record) + judges_usd(record)


# Written by earlier versions and never read: old records may still hold them.
RETIRED = ("restartLimit", "baselineCache", "resumedFrom")
