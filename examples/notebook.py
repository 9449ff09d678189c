# %% [markdown]
# # GRPO from a notebook
#
# The custom-reward example in cells (`# %%`: VS Code, PyCharm and Jupytext open this file as a
# notebook; `python examples/notebook.py` runs it top to bottom). Rewards are functions defined in
# cells; `grpo_run.train` packages their source with the job, so `grpo-run resume` on another node
# scores with them. Interrupting the training cell stops the run with a durable checkpoint
# (phase Preempted); running the cell again continues from it.

# %%
import random

import grpo_run


# %% [markdown]
# Two rewards: one per completion, `(completion, task) -> float`, as in job files; one with TRL's
# batched signature, `(prompts, completions, **columns) -> list`, called once per batch with each
# task column as a list. A TRL reward function works here unchanged.

# %%
def correct(completion: str, task: dict) -> float:
    return 1.0 if completion.strip()[:1] == task["answer"] else 0.0


def close(prompts, completions, answer, **columns):
    scores = []
    for completion, want in zip(completions, answer):
        guess = completion.strip()[:1]
        scores.append(1.0 - abs(int(guess) - int(want)) / 9 if guess.isdigit() else 0.0)
    return scores


# %% [markdown]
# Tasks as a list of dicts: a `prompt` (text, or chat messages) and the columns the rewards read.

# %%
rows = [{"prompt": f"{a},{b}=", "answer": str(max(a, b))} for a in range(10) for b in range(10) if a != b]
random.Random(0).shuffle(rows)

# %% [markdown]
# Train in the foreground (the live view on stderr). With `storage="s3://bucket/prefix",
# detach=True` it is submitted instead, for a spot node to train.

# %%
job = grpo_run.train(
    model="tiny:char", name="larger-digit-notebook",
    tasks=rows[:70], eval_tasks=rows[70:],
    rewards=[correct, (close, 0.5)],
    num_generations=8, prompts_per_step=8, max_completion_length=4, learning_rate=0.002,
    max_steps=300, save_steps=50, seed=0,
)

# %%
job.status()["final"]      # held-out mean reward, and by function

# %%
job.report("larger-digit-notebook.png")
job.export("larger-digit-notebook-adapter")

# %% [markdown]
# From any other session: `grpo_run.get("larger-digit-notebook")` is the same handle (with
# `storage=` for a job in object storage).
