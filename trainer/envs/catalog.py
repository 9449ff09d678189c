"""Environments: tasks to train and evaluate on, and the reward that scores a completion.

An environment is data (train tasks, held-out eval tasks) plus one or more reward functions,
each named by a `module:function` (or `file.py:function`) reference and weighted, because
rewards are computed in the grader's own process, never in the trainer's. A reward has the
signature `reward(completion: str, task: dict) -> float`; the step's reward of a completion is
the weighted sum. Every task is a JSON object with a `prompt`: a string, or a list of chat
messages (`{"role": ..., "content": ...}`) that the tokenizer's chat template renders.

Catalog environments make their tasks deterministically from a seed, train and eval from
disjoint sets, so the held-out score is honest. `arithmetic` and `graph-coloring` speak a
compact format only the tiny demo model answers; `gsm8k` is GSM8K in natural language, for real
instruct models, loaded with `datasets` (from the hub, or offline from `dataFiles`). `code` runs
the completion's code against unit tests (`grpo_run.trainer.envs.code`): twelve built-in tasks,
or your own (MBPP, HumanEval or `{prompt, tests}`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping

from grpo_run.trainer.envs.code import tests_problem
from grpo_run.trainer.envs.codetasks import code_tasks
from grpo_run.trainer.envs.tasks import Task

@dataclass(frozen=True)
class JudgeSettings:
    """An LLM judge over HTTP (trainer.grader.judge): an OpenAI-compatible chat completions
    endpoint, called from the trainer's process. Never the API key, only its variable's name."""
    url: str                       # the API's base, e.g. https://api.openai.com/v1 (POST {url}/chat/completions)
    model: str
    prompt: str                    # {prompt} and {completion} are replaced
    low: float                     # the reply's first number is clipped to [low, high]
    high: float
    timeout_s: float
    retries: int                   # further tries of a call the server did not answer
    max_calls: int | None = None   # answered calls the whole run may make (None: no limit)
    max_tokens: int | None = None  # the reply's length limit (None: the server's default)
    concurrency: int = 1           # calls in flight at once
    api_key_env: str | None = None  # the node's environment variable holding the key (Authorization: Bearer)
    usd_per_call: float | None = None  # the price of one answered call (None: not priced per call)
    usd_per_mtok: tuple[float, float] | None = None   # (input, output) per million tokens, from each reply's usage


@dataclass(frozen=True)
class Reward:
    name: str          # how metrics and the record name it
    ref: str           # "module:function" or "/path/file.py:function", run by the grader
    weight: float = 1.0
    group: bool = False  # scores a prompt's G completions together: fn(completions, task) -> G numbers
    model: bool = False  # ref is a reward model (a hub id or a folder), scored in the trainer's process
    judge: JudgeSettings | None = None   # an LLM judge over HTTP, called from the trainer's process (ref: its url)


# The environment of a job with tools and no episodes class: the first reply that calls no tool is
# the answer (grpo_run.trainer.grader.tools, which the sandboxed worker imports).
ANSWER_AFTER_TOOLS = "grpo_run.trainer.grader.tools:AnswerAfterTools"


@dataclass(frozen=True)
class EpisodeSettings:
    """Multi-turn episodes (trainer.episodes): the environment's class, run in the grader's sandbox."""
    ref: str                   # "module:Class" or "/path/file.py:Class": reset(task, seed), step(reply)
    max_turns: int = 6         # replies per episode at most (spec.environment.maxTurns)
    tools: tuple[str, ...] = ()            # "file.py:function" each, answering the model's tool calls
    tool_timeout_s: float | None = None    # one tool call at most (None: rewardTimeoutSeconds)
    step_timeout_s: float | None = None    # one step at most, past it the episode ends (None: the job fails)

    @property
    def rewards_itself(self) -> bool:
        """The environment's step rewards are a reward of the run ("episode"); not tools' own loop,
        whose episodes only the job's reward functions score."""
        return self.ref != ANSWER_AFTER_TOOLS


@dataclass(frozen=True)
class Environment:
    name: str
    rewards: tuple[Reward, ...]      # the first is the primary one: `solved` counts its 1.0s (may be () with episodes)
    train_tasks: tuple[Task, ...]
    eval_tasks: tuple[Task, ...]
    search_path: tuple[str, ...] = ()  # prepended to sys.path in the grader for user modules
    episodes: EpisodeSettings | None = None   # each task is an episode's (handed to reset); None: single-turn


# --- arithmetic: (a + b) mod 10 ------------------------------------------------------------

def arithmetic_tasks(seed: int, n_train: int | None, n_eval: int | None) -> tuple[list[Task], list[Task]]:
    """Single-digit operands: `3+5=` -> `8`, `7+6=` -> `3`. 100 distinct tasks in all.

    The held-out tasks are pairs never trained on; a policy can only get them right by learning
    the rule (commutativity included: it may have seen `5+3=` but never `3+5=`), not by
    remembering answers. Defaults: 30 held out, the other 70 for training. Raises ValueError when
    the split does not fit in 100 tasks.
    """
    n_eval = 30 if n_eval is None else n_eval
    n_train = 100 - n_eval if n_train is None else n_train
    if n_eval < 1 or n_train < 1 or n_train + n_eval > 100:
        raise ValueError(f"arithmetic has 100 distinct tasks; cannot hold out {n_eval} and train on {n_train}")
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    tasks = [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a, b in pairs]
    return tasks[n_eval:n_eval + n_train], tasks[:n_eval]


def arithmetic_reward(completion: str, task: Task) -> float:
    """1 for exactly the answer digit, else 0."""
    return 1.0 if completion.strip() == task["answer"] else 0.0


# --- graph colouring -------------------------------------------------------------------------

def _random_colourable_graph(rng: random.Random, nodes: int, colours: int) -> list[tuple[int, int]]:
    """Edges of a random graph that has a proper colouring with `colours` colours (planted)."""
    planted = [rng.randrange(colours) for _ in range(nodes)]
    candidates = [(u, v) for u in range(nodes) for v in range(u + 1, nodes) if planted[u] != planted[v]]
    rng.shuffle(candidates)
    edges = sorted(candidates[: max(1, min(len(candidates), nodes + rng.randrange(nodes)))])
    return edges


def graph_coloring_tasks(seed: int, n_train: int | None, n_eval: int | None) -> tuple[list[Task], list[Task]]:
    """Small graphs (4-6 nodes) and k colours (3): prompt `3|01,12,23=`, answer one digit per node.

    Defaults: 2,000 train and 100 held-out graphs; eval graphs are never among the train graphs.
    """
    n_train = 2000 if n_train is None else n_train
    n_eval = 100 if n_eval is None else n_eval
    rng = random.Random(seed)
    seen: set[str] = set()
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < n_train + n_eval:
        attempts += 1
        if attempts > 100 * (n_train + n_eval) + 1000:
            raise ValueError(f"graph-coloring cannot make {n_train + n_eval} distinct tasks")
        nodes, colours = rng.randint(4, 6), 3
        edges = _random_colourable_graph(rng, nodes, colours)
        prompt = f"{colours}|" + ",".join(f"{u}{v}" for u, v in edges) + "="
        if prompt in seen:
            continue
        seen.add(prompt)
        tasks.append({"prompt": prompt, "nodes": nodes, "colours": colours, "edges": edges})
    return tasks[n_eval:], tasks[:n_eval]


def graph_coloring_reward(completion: str, task: Task) -> float:
    """Fraction of edges whose endpoints differ; 0 unless the answer is one valid colour per node."""
    answer = completion.strip()
    if len(answer) != task["nodes"] or not all(c.isdigit() and int(c) < task["colours"] for c in answer):
        return 0.0
    edges = task["edges"]
    ok = sum(1 for u, v in edges if answer[u] != answer[v])
    return ok / len(edges)


# --- gsm8k: grade-school math in words ---------------------------------------------------------

GSM8K_HUB = ("openai/gsm8k", "main")
GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_tasks(seed: int, n_train: int | None, n_eval: int | None,
                data_files: Mapping[str, str] | None = None) -> tuple[list[Task], list[Task]]:
    """GSM8K (`question`, `answer` ending in `#### N`): the prompt is the question and the
    instruction to box the answer, as Qwen's math models are prompted. Train from the `train`
    split, held out from `test`; `data_files` ({train: PATH, test: PATH}, Parquet / JSON(L) /
    CSV) instead of the hub. None: every task; a count takes a seeded sample."""
    from grpo_run.trainer.envs.data import load_split, sample

    def tasks(split: str, n: int | None, salt: int) -> list[Task]:
        rows = load_split(data_files or GSM8K_HUB[0], split, config=None if data_files else GSM8K_HUB[1])
        for i, row in enumerate(rows):
            if not isinstance(row.get("question"), str) or "####" not in str(row.get("answer", "")):
                raise ValueError(f"gsm8k {split} row {i}: needs GSM8K's columns question and answer "
                                 f"(ending in '#### N'); got columns {', '.join(row)}")
        try:
            chosen = sample(rows, n, seed + salt)
        except ValueError as e:
            raise ValueError(f"spec.parameters.{'trainTasks' if split == 'train' else 'evalTasks'}: {e} "
                             f"in gsm8k's {split} split") from None
        return [{"prompt": f"{r['question']}\n{GSM8K_INSTRUCTION}", "question": r["question"], "answer": r["answer"]}
                for r in chosen]

    return tasks("train", n_train, 0), tasks("test", n_eval, 1)


@dataclass(frozen=True)
class CatalogEnvironment:
    make: Callable[..., tuple[list[Task], list[Task]]]   # (seed, n_train, n_eval[, data_files]) -> tasks
    rewards: Mapping[str, str]                          # the rewards it offers, by name
    default: tuple[tuple[str, float], ...]              # (name, weight) used when the job names none
    data: bool = False                                  # loads a data set: dataFiles, else the hub
    # takes your tasks too (spec.environment.tasks, dataset, ...), each checked by this (what is
    # wrong with a task, or None); without them, `make`'s
    task_problem: Callable[[Task], str | None] | None = None


CATALOG: dict[str, CatalogEnvironment] = {
    "arithmetic": CatalogEnvironment(arithmetic_tasks, {"correct": "grpo_run.trainer.envs.catalog:arithmetic_reward"},
                                     (("correct", 1.0),)),
    "graph-coloring": CatalogEnvironment(graph_coloring_tasks, {"proper": "grpo_run.trainer.envs.catalog:graph_coloring_reward"},
                                         (("proper", 1.0),)),
    "gsm8k": CatalogEnvironment(gsm8k_tasks, {"correct": "grpo_run.trainer.envs.rewards:math_correct",
                                              "format": "grpo_run.trainer.envs.rewards:boxed_format"},
                                (("correct", 1.0),), data=True),
    "code": CatalogEnvironment(code_tasks, {"passed": "grpo_run.trainer.envs.code:fraction_passed",
                                            "all_passed": "grpo_run.trainer.envs.code:all_passed"},
                               (("passed", 1.0),), task_problem=tests_problem),
}


def catalog_environment(name: str, *, seed: int, n_train: int | None = None, n_eval: int | None = None,
                        rewards: tuple[tuple[str, float], ...] | None = None,
                        data_files: Mapping[str, str] | None = None,
                        tasks: tuple[list[Task], list[Task]] | None = None) -> Environment:
    """A catalog environment's tasks (None: the environment's default counts), or your (train,
    held-out) `tasks` where it takes them, with its rewards by (name or ref, weight) (None: its
    default). Raises ValueError for counts that do not fit or data that is not the environment's."""
    entry = CATALOG[name]
    if tasks is not None:
        if entry.task_problem is None:
            raise ValueError(f"catalog environment {name!r} makes its own tasks")
        train, held_out = tasks
    else:
        train, held_out = (entry.make(seed, n_train, n_eval, data_files) if entry.data
                           else entry.make(seed, n_train, n_eval))
    return Environment(name=name, rewards=catalog_rewards(name, rewards), train_tasks=tuple(train),
                       eval_tasks=tuple(held_out))


def catalog_rewards(name: str, rewards: tuple[tuple[str, float], ...] | None = None) -> tuple[Reward, ...]:
    """A catalog environment's rewards by (name or ref, weight) (None: its default)."""
    entry = CATALOG[name]
    return tuple(Reward(reward_name(r), entry.rewards.get(r, r), w) for r, w in (rewards or entry.default))


def reward_name(ref: str) -> str:
    """A reward's name in metrics: a catalog name as is, a ref by its function's name."""
    return ref.rpartition(":")[2] if ":" in ref else ref


# --- user environments -----------------------------------------------------------------------

def user_environment(*, name: str, rewards: tuple[Reward, ...] | None = None, reward_ref: str | None = None,
                     tasks: list[Task], eval_tasks: list[Task], search_path: tuple[str, ...] = (),
                     episodes: EpisodeSettings | None = None) -> Environment:
    """Your own environment: `rewards`, or one `reward_ref` (weight 1); with `episodes`, neither
    is needed (the episode's reward is the sum of its steps' rewards, plus any rewards')."""
    if rewards is None:
        if reward_ref is None and episodes is None:
            raise ValueError("an environment needs rewards or a reward_ref (or episodes)")
        rewards = (Reward(reward_name(reward_ref), reward_ref, 1.0),) if reward_ref is not None else ()
    return Environment(name=name, rewards=tuple(rewards), train_tasks=tuple(tasks),
                       eval_tasks=tuple(eval_tasks), search_path=search_path, episodes=episodes)
