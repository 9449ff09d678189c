"""Environments: tasks to train and evaluate on, and the reward that scores a completion.

An environment is data (train tasks, held-out eval tasks) plus a reward function named by a
`module:function` (or `file.py:function`) reference, because rewards are computed in the
grader's own process, never in the trainer's. A reward has the signature
`reward(completion: str, task: dict) -> float`; every task is a JSON object with a `prompt`.

Catalog environments generate their tasks deterministically from a seed, train and eval from
disjoint sets, so the held-out score is honest.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Task = dict[str, Any]


@dataclass(frozen=True)
class Environment:
    name: str
    reward_ref: str                  # "module:function" or "/path/file.py:function", run by the grader
    train_tasks: tuple[Task, ...]
    eval_tasks: tuple[Task, ...]
    search_path: tuple[str, ...] = ()  # prepended to sys.path in the grader for user modules


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


CATALOG = {
    "arithmetic": (arithmetic_tasks, "trainer.envs:arithmetic_reward"),
    "graph-coloring": (graph_coloring_tasks, "trainer.envs:graph_coloring_reward"),
}


def catalog_environment(name: str, *, seed: int, n_train: int | None = None, n_eval: int | None = None) -> Environment:
    """A catalog environment's tasks (None: the environment's default counts). Raises ValueError."""
    make, ref = CATALOG[name]
    train, held_out = make(seed, n_train, n_eval)
    return Environment(name=name, reward_ref=ref, train_tasks=tuple(train), eval_tasks=tuple(held_out))


# --- user environments -----------------------------------------------------------------------

def read_tasks(path: Path) -> list[Task]:
    """Tasks from a JSONL file, one JSON object with a string `prompt` per line.

    Raises ValueError naming the file and line for anything else.
    """
    tasks: list[Task] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(task, dict) or not isinstance(task.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each task must be a JSON object with a string \"prompt\"")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def user_environment(*, name: str, reward_ref: str, tasks: list[Task], eval_tasks: list[Task],
                     search_path: tuple[str, ...] = ()) -> Environment:
    return Environment(name=name, reward_ref=reward_ref, train_tasks=tuple(tasks),
                       eval_tasks=tuple(eval_tasks), search_path=search_path)
