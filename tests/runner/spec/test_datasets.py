"""Environments from data sets: file formats, save_to_disk folders, columns, held-out splits,
the gsm8k catalog environment from local Parquet, several weighted rewards."""

import json

import pytest
import yaml

from grpo_run.runner.books.fingerprint import baseline_fingerprint
from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import JobError, load_job, parse_job
from grpo_run.trainer.config import GRPOParams

ROWS = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(6) for b in range(5)]


def job(**env):
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "d"},
            "spec": {"model": "tiny:char", "environment": env}}


def write(folder, name, rows, fmt):
    from datasets import Dataset

    path = folder / name
    ds = Dataset.from_list(rows)
    {"parquet": ds.to_parquet, "csv": ds.to_csv, "json": lambda p: ds.to_json(p, lines=False)}[fmt](str(path)) \
        if fmt != "jsonl" else path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "rewards.py").write_text("def score(c, t):\n    return 1.0\n\ndef short(c, t):\n    return -len(c)\n")
    return "rewards.py:score"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_file_format_gives_the_same_tasks(tmp_path, reward_file, fmt):
    train = write(tmp_path, f"train.{fmt}", ROWS[:20], fmt)
    held = write(tmp_path, f"eval.{fmt}", ROWS[20:], fmt)
    env = build_environment(parse_job(job(name="sums", reward=reward_file, tasks=train.name, evalTasks=held.name,
                                          columns={"prompt": "question"}), base=tmp_path))
    assert [t["prompt"] for t in env.train_tasks] == [r["question"] for r in ROWS[:20]]
    assert [t["answer"] for t in env.eval_tasks] == [r["answer"] for r in ROWS[20:]]


def test_a_save_to_disk_folder_with_its_splits(tmp_path, reward_file):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS[:25]), "validation": Dataset.from_list(ROWS[25:])}).save_to_disk(
        str(tmp_path / "sums"))
    env = build_environment(parse_job(job(name="sums", reward=reward_file, dataset="./sums", evalSplit="validation",
                                          columns={"prompt": "question"}), base=tmp_path))
    assert len(env.train_tasks) == 25 and len(env.eval_tasks) == 5


def test_held_out_tasks_are_cut_from_train_by_a_seeded_fraction(tmp_path, reward_file):
    write(tmp_path, "all.parquet", ROWS, "parquet")
    doc = job(name="sums", reward=reward_file, tasks="all.parquet", heldOutFraction=0.2, columns={"prompt": "question"})
    a, b = (build_environment(parse_job(doc, base=tmp_path)) for _ in range(2))
    assert len(a.eval_tasks) == 6 and len(a.train_tasks) == 24
    assert a.eval_tasks == b.eval_tasks                                          # seeded: the same cut
    assert not {t["question"] for t in a.eval_tasks} & {t["question"] for t in a.train_tasks}


def test_a_prompt_repeated_in_the_tasks_is_held_out_with_every_copy_or_not_at_all(tmp_path, reward_file, caplog):
    import numpy as np

    from grpo_run.trainer.envs.data import held_out

    # the newcomer's `rows = [...] * 5`: 10 prompts, 5 copies each
    rows = [{"prompt": f"say {d}{d}{d}:", "answer": str(d)} for d in range(10)] * 5
    write(tmp_path, "tasks.jsonl", rows, "jsonl")
    doc = job(name="echo", reward=reward_file, tasks="tasks.jsonl", heldOutFraction=0.2)
    env = build_environment(parse_job(doc, base=tmp_path))
    held, trained = {t["prompt"] for t in env.eval_tasks}, {t["prompt"] for t in env.train_tasks}
    assert not held & trained                                          # held out means never trained on
    assert len(env.eval_tasks) == 10 and len(held) == 2                # 2 prompts x 5 copies: the fraction, 0.2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == ["spec.environment: 10 prompts appear more than once (50 tasks, e.g. 'say 000:'); every copy "
                    "of each is on one side of the held-out split"]
    # without repeats, the same cut as before: a seeded permutation of the rows, the first k held out
    order = np.random.default_rng(0).permutation(30)
    first = [{"prompt": str(i)} for i in range(30)]
    assert held_out(first, 0.2, 0)[1] == [first[i] for i in sorted(int(j) for j in order[:6])]


def test_held_out_tasks_that_are_also_training_tasks_are_reported(tmp_path, reward_file, caplog):
    write(tmp_path, "train.jsonl", [{"prompt": f"{i}+1="} for i in range(8)], "jsonl")
    write(tmp_path, "eval.jsonl", [{"prompt": "3+1="}, {"prompt": "9+1="}], "jsonl")
    build_environment(parse_job(job(name="e", reward=reward_file, tasks="train.jsonl", evalTasks="eval.jsonl"),
                                base=tmp_path))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "spec.environment: 1 of the 2 held-out prompts are also training tasks, so they are not held out "
        "(e.g. '3+1='): remove them from one side"]


def test_a_missing_column_or_split_is_named(tmp_path, reward_file):
    write(tmp_path, "all.parquet", ROWS, "parquet")
    with pytest.raises(ValueError, match="no column 'prompt_text'.*it has question, answer"):
        build_environment(parse_job(job(name="s", reward=reward_file, tasks="all.parquet", heldOutFraction=0.1,
                                        columns={"prompt": "prompt_text"}), base=tmp_path))
    with pytest.raises(ValueError, match="no split 'test'.*heldOutFraction"):
        build_environment(parse_job(job(name="s", reward=reward_file, dataFiles={"train": "all.parquet"},
                                        columns={"prompt": "question"}), base=tmp_path))


def test_gsm8k_runs_offline_from_local_parquet_with_two_weighted_rewards(tmp_path):
    write(tmp_path, "train.parquet", ROWS[:24], "parquet")
    write(tmp_path, "test.parquet", ROWS[24:], "parquet")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(
        name="gsm8k", dataFiles={"train": "train.parquet", "test": "test.parquet"},
        rewards=[{"function": "correct"}, {"function": "format", "weight": 0.2}])))
    env = build_environment(load_job(tmp_path / "job.yaml"))
    assert [(r.name, r.ref, r.weight) for r in env.rewards] == [
        ("correct", "grpo_run.trainer.envs.rewards:math_correct", 1.0), ("format", "grpo_run.trainer.envs.rewards:boxed_format", 0.2)]
    assert len(env.train_tasks) == 24 and len(env.eval_tasks) == 6
    assert env.train_tasks[0]["prompt"].startswith("What is 0 plus 0?\nPlease reason step by step")
    assert env.train_tasks[0]["answer"].endswith("#### 0")


def test_gsm8k_rejects_data_that_is_not_gsm8k(tmp_path):
    write(tmp_path, "train.parquet", [{"q": "x"}], "parquet")
    write(tmp_path, "test.parquet", [{"q": "y"}], "parquet")
    with pytest.raises(ValueError, match="needs GSM8K's columns question and answer"):
        build_environment(parse_job(job(name="gsm8k", dataFiles={"train": "train.parquet", "test": "test.parquet"}),
                                    base=tmp_path))


def test_reward_problems_are_named_together(tmp_path, reward_file):
    with pytest.raises(JobError) as e:
        parse_job(job(name="gsm8k", rewards=[{"function": "corect"}, {"function": "format", "weight": "x"}]))
    assert e.value.problems == [
        "spec.environment.rewards.1.weight: must be a number (got 'x')",
        "spec.environment.rewards.0.function: gsm8k has no reward 'corect': it has correct, format; or give module:function"]
    with pytest.raises(JobError) as e:
        parse_job(job(name="mine", reward=reward_file, rewards=["rewards.py:short"], tasks="t.jsonl"), base=tmp_path)
    assert "spec.environment.rewards: give reward (one function) or rewards (several, weighted), not both" in e.value.problems


def test_the_baseline_fingerprint_covers_the_data_and_the_weights(tmp_path, reward_file):
    write(tmp_path, "all.parquet", ROWS, "parquet")
    doc = job(name="s", rewards=[reward_file, {"function": "rewards.py:short", "weight": 0.5}], tasks="all.parquet",
              heldOutFraction=0.2, columns={"prompt": "question"})
    p = GRPOParams()
    first = baseline_fingerprint("m", build_environment(parse_job(doc, base=tmp_path)), p)
    doc["spec"]["environment"]["rewards"][1]["weight"] = 0.25
    assert baseline_fingerprint("m", build_environment(parse_job(doc, base=tmp_path)), p) != first
    write(tmp_path, "all.parquet", [{**r, "answer": r["answer"] + " "} for r in ROWS], "parquet")
    doc["spec"]["environment"]["rewards"][1]["weight"] = 0.5
    assert baseline_fingerprint("m", build_environment(parse_job(doc, base=tmp_path)), p) != first


def test_fields_that_would_be_ignored_are_named(tmp_path, reward_file):
    write(tmp_path, "all.parquet", ROWS, "parquet")
    with pytest.raises(JobError) as e:
        parse_job(job(name="s", reward=reward_file, tasks="all.parquet", evalTasks="all.parquet", heldOutFraction=0.1,
                      datasetConfig="main", evalSplit="validation"), base=tmp_path)
    assert e.value.problems == [
        "spec.environment.heldOutFraction: give evalTasks or heldOutFraction, not both",
        "spec.environment.datasetConfig: goes with dataset (the data set's subset)",
        "spec.environment.evalSplit: goes with dataset or dataFiles; a tasks file is one split"]


def test_two_rewards_recorded_under_one_name_are_refused(tmp_path, reward_file):
    with pytest.raises(JobError) as e:
        parse_job(job(name="gsm8k", rewards=["correct", "correct"]))
    assert e.value.problems == ["spec.environment.rewards: two rewards are named 'correct': "
                                "give one of them a name (name: ...)"]
    doc = job(name="gsm8k", rewards=["correct", {"function": "correct", "name": "again", "weight": 0.5}])
    assert [r.label for r in parse_job(doc).environment.rewards] == ["correct", "again"]


def test_a_problem_inside_a_list_item_names_the_fields_it_allows():
    with pytest.raises(JobError) as e:
        parse_job(job(name="gsm8k", rewards=[{"fnction": "correct"}]))
    assert "spec.environment.rewards.0.fnction: unknown field; did you mean function?" in e.value.problems
    assert any(p.startswith("spec.environment.rewards.0.function: required: module:function") for p in e.value.problems)


def test_the_environment_s_files_reach_a_fresh_node_through_storage(tmp_path, reward_file):
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.runner.jobs.envfiles import environment_uploads, localize_environment, upload_environment, with_file_hashes

    write(tmp_path, "train.parquet", ROWS[:20], "parquet")
    write(tmp_path, "test.parquet", ROWS[20:], "parquet")
    doc = job(name="s", rewards=[reward_file, {"function": "rewards.py:short", "weight": 0.5}],
              dataFiles={"train": "train.parquet", "test": "test.parquet"}, columns={"prompt": "question"})
    here = with_file_hashes(parse_job(doc, base=tmp_path))           # what apply does
    store = Store(str(tmp_path / "store"))
    upload_environment(environment_uploads(here), store)
    for name in ("train.parquet", "test.parquet", "rewards.py"):
        (tmp_path / name).unlink()                                   # a fresh node has none of them
    there = localize_environment(parse_job(here.to_dict(), check_files=False), store, tmp_path / "node")
    env = build_environment(there)
    assert len(env.train_tasks) == 20 and len(env.eval_tasks) == 10
    assert all(r.ref.startswith(str(tmp_path / "node")) for r in env.rewards)


def test_a_save_to_disk_folder_missing_on_the_node_is_named(tmp_path, reward_file):
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.runner.jobs.envfiles import localize_environment

    doc = job(name="s", reward=reward_file, dataset=str(tmp_path / "gone"))
    with pytest.raises(LookupError, match="spec.environment.dataset: the folder .*gone is not on this node"):
        localize_environment(parse_job(doc, check_files=False), Store(str(tmp_path / "store")), tmp_path / "node")
