"""`grpo_run.train(...)`: rewards written as Python functions travel with the job (packaged as
source, grpo_run.package), tasks given as rows are written as Parquet, and the job is the one a
YAML file would describe, run by the same supervisor: here, or on a node that has nothing but the
storage URL."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import grpo_run
from grpo_run.package import package_reward
from grpo_run.runner.cli.commands import main
from tests.runner.jobs.test_resume import grpo_run as cli

SCALE = 2.0
LIVE = object()
WORD = r"[a-z]+"
WORDS = re.compile(WORD)
ONE_WORD = re.compile(f"^{WORD}$")


def _helper(text: str) -> int:
    return len(text.split())


def uses_its_module(completion: str, task: dict, scale: float = SCALE) -> float:
    return scale * _helper(completion) + float(json.loads(task["n"]))


def counts_words(completion, task):
    return float(len(WORDS.findall(completion))) + float(bool(ONE_WORD.match(completion)))


def reads_a_live_object(completion, task):
    return float(LIVE is None)


@functools.lru_cache
def decorated(completion, task):
    return 0.0


def _closure():
    offset = 1.0

    def inner(completion, task):
        return offset

    return inner


def _nested():
    def inner(completion, task):
        return 1.0

    return inner


def register(fn):
    return fn


@register
def registered(completion, task):
    return 0.0


def uses_its_module_too(completion, task):       # renamed below: two rewards of one name
    return 0.0


class Scorer:
    def method(self, completion, task):
        return 0.0


def test_a_packaged_reward_is_its_source_and_what_it_uses():
    source = package_reward(uses_its_module)
    namespace: dict = {}
    exec(compile(source, "packaged.py", "exec"), namespace)     # a fresh module: nothing of this one's
    assert namespace["uses_its_module"]("a b c", {"n": "1"}) == uses_its_module("a b c", {"n": "1"}) == 7.0
    assert "import json" in source and "SCALE = 2.0" in source and "def _helper" in source
    assert package_reward(uses_its_module) == source                # the same bytes every time
    source = package_reward(counts_words)                           # stdlib objects: their module's statement
    assert "WORDS = re.compile(WORD)" in source and source.index("WORD = ") < source.index("WORDS = ")
    namespace = {}
    exec(compile(source, "packaged.py", "exec"), namespace)
    assert namespace["counts_words"]("ab cd", {}) == counts_words("ab cd", {}) == 2.0
    assert namespace["counts_words"]("ab", {}) == 2.0


def helper_module(tmp_path: Path):
    (tmp_path / "my_helpers.py").write_text("def clean(text):\n    return text.strip()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import my_helpers
    finally:
        sys.path.remove(str(tmp_path))
    code = "def uses_a_local_module(completion, task):\n    return float(bool(my_helpers.clean(completion)))\n"
    namespace = {"my_helpers": my_helpers, "__name__": "tests_local"}
    exec(compile(code, str(tmp_path / "local.py"), "exec"), namespace)
    (tmp_path / "local.py").write_text(code)
    return namespace["uses_a_local_module"]


@pytest.mark.parametrize("reward, said", [
    (lambda completion, task: 1.0, "is a lambda: give it a name with def"),
    (_closure(), "closes over offset"),
    (_nested(), "is defined inside another function"),
    (registered, "registered is decorated"),
    (reads_a_live_object, "uses the global LIVE (a object), a live object"),
    (decorated, "is a _lru_cache_wrapper, not a Python function"),
    (len, "is a builtin_function_or_method, not a Python function"),
    (Scorer().method, "is a bound method"),
    ("local", "a module that is not installed"),
])
def test_a_reward_that_cannot_travel_is_refused_before_anything_is_written(tmp_path, reward, said):
    if reward == "local":
        reward = helper_module(tmp_path)
    storage = tmp_path / "bucket"
    with pytest.raises(grpo_run.JobError) as e:
        grpo_run.train(model="tiny:char", name="refused", tasks=[{"prompt": "1+1="}], held_out_fraction=0.5,
                       rewards=[uses_its_module, (reward, 0.5)], storage=str(storage), detach=True)
    assert str(e.value).startswith("grpo_run.train(): rewards[1]: ") and said in str(e.value)
    assert "\n" not in str(e.value)
    assert not storage.exists() and not (tmp_path / "grpo-run-home" / "python").exists()


def test_bad_arguments_are_refused_by_their_python_names(tmp_path):
    with pytest.raises(grpo_run.JobError, match=r"unknown argument num_generation; did you mean num_generations\?"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], rewards=[uses_its_module],
                       num_generation=4)
    with pytest.raises(grpo_run.JobError, match=r"tasks: give a list of dicts"):
        grpo_run.train(model="tiny:char", name="x", tasks=[], rewards=[uses_its_module])
    with pytest.raises(grpo_run.JobError, match=r"rewards: give a list of functions"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], rewards=uses_its_module)
    twin = uses_its_module_too
    twin.__name__ = "uses_its_module"
    with pytest.raises(grpo_run.JobError, match=r"rewards\[1\]: two rewards are named uses_its_module"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], rewards=[uses_its_module, twin])
    with pytest.raises(grpo_run.JobError, match=r"spec.parameters.numGenerations: must be >= 2"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], held_out_fraction=0.5,
                       rewards=[uses_its_module], num_generations=1)
    # a task without a prompt: the fix a Python caller can make, not a job file's columns:
    with pytest.raises(grpo_run.JobError) as refused:
        grpo_run.train(model="tiny:char", name="x", tasks=[{"question": "1+1=", "answer": "2"}],
                       held_out_fraction=0.5, rewards=[uses_its_module])
    assert str(refused.value) == ('grpo_run.train(): tasks: row 0 has no "prompt" key (it has question, answer): give '
                                  'every task its prompt under "prompt", e.g. [{**t, "prompt": t[\'question\']} for t '
                                  'in rows]')
    # the accepted names read as Python: reward_memory_mb (it was listed as reward_memory_m_b)
    with pytest.raises(grpo_run.JobError, match=r"unknown argument reward_memory_m_b; did you mean reward_memory_mb\?"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], rewards=[uses_its_module],
                       reward_memory_m_b=512)


# The user's script: two rewards in __main__, one per completion and one copied from TRL's
# documentation, and tasks as a list of dicts.
SCRIPT = textwrap.dedent(r'''
    import re
    import sys

    import grpo_run


    def correct(completion: str, task: dict) -> float:
        return float(completion.strip().startswith(task["answer"]))


    def reward_func(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


    def length_penalty(prompts, completions, **columns):
        return [-len(c) / 1000 for c in completions]


    tasks = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "ground_truth": str(a + b)}
             for a in range(5) for b in range(5)]
    job = grpo_run.train(model="tiny:char", name="from-python", tasks=tasks[:20], eval_tasks=tasks[20:],
                         rewards=[correct, reward_func, (length_penalty, 0.1)],
                         num_generations=4, prompts_per_step=2, max_completion_length=4, max_steps=4,
                         save_steps=2, seed=3, storage=sys.argv[1], detach=sys.argv[2] == "detach")
    if sys.argv[2] == "here":
        job.report(sys.argv[3] + "/run.png")
        job.export(sys.argv[3] + "/adapter")
    print(job.status()["phase"])
''')


def run_script(tmp_path: Path, home: Path, *args: str) -> str:
    (tmp_path / "train_script.py").write_text(SCRIPT)
    env = {**os.environ, "GRPO_RUN_HOME": str(home)}
    proc = subprocess.run([sys.executable, str(tmp_path / "train_script.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_script_submits_with_its_rewards_and_a_fresh_node_trains_it(tmp_path, s3_env):
    assert run_script(tmp_path, tmp_path / "laptop", s3_env.url, "detach") == "Pending"
    assert not (tmp_path / "laptop" / "runs").exists()                  # nothing trained on the laptop
    node = tmp_path / "node"                                              # an empty GRPO_RUN_HOME
    cli(node, "resume", "from-python", "--storage", s3_env.url)
    status = json.loads(cli(node, "get", "tj", "from-python", "--storage", s3_env.url, "-o", "json").stdout)["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 4
    assert set(status["final"]["rewards"]) == {"correct", "reward_func", "length_penalty"}
    assert status["final"]["rewards"]["length_penalty"] < 0               # each mean under its own name


def test_a_script_trains_in_the_foreground_and_reports_and_exports(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_script(tmp_path, tmp_path / "home", str(tmp_path / "bucket"), "here", str(out)) == "Succeeded"
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG" and (out / "run.md").exists()
    assert (out / "adapter" / "adapter_model.safetensors").exists()


def test_a_trl_reward_runs_unchanged_in_a_yaml_job(tmp_path):
    reward = SCRIPT[SCRIPT.index("def reward_func"):SCRIPT.index("def length_penalty")]
    (tmp_path / "trl_reward.py").write_text("import re\n\n\n" + reward)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "ground_truth": str(2 * a)}) + "\n"
                                                  for a in range(8)))
    job = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "trl-yaml"},
           "spec": {"model": "tiny:char",
                    "environment": {"name": "trl", "rewards": [{"function": "trl_reward.py:reward_func"}],
                                    "tasks": "train.jsonl", "heldOutFraction": 0.25},
                    "parameters": {"numGenerations": 2, "promptsPerStep": 2, "maxCompletionLength": 4,
                                   "maxSteps": 2, "saveSteps": 1}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["apply", "-f", str(tmp_path / "job.yaml")]) == 0
    status = grpo_run.get("trl-yaml").status()
    assert status["phase"] == "Succeeded" and set(status["final"]["rewards"]) == {"reward_func"}


def test_an_interrupted_run_stops_like_sigint_and_running_it_again_resumes(tmp_path):
    """Jupyter's interrupt is a SIGINT to the kernel: the run stops as on a spot notice (checkpoint
    durable, Preempted) and train() returns; the same call again continues from that checkpoint."""
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT.replace("max_steps=4", "max_steps=40").replace("save_steps=2", "save_steps=10"))
    env = {**os.environ}                                         # GRPO_RUN_HOME: this test's (conftest)
    args = [sys.executable, str(script), str(tmp_path / "bucket"), "here-again"]
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            try:
                if grpo_run.get("from-python").status()["step"] >= 2:
                    break
            except grpo_run.JobError:                            # not started yet
                pass
            time.sleep(0.1)
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "Preempted"
    stopped = grpo_run.get("from-python").status()
    assert 2 <= stopped["step"] < 40 and stopped["checkpoints"]["latestDurable"] == stopped["step"]
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == "Succeeded", again.stderr[-3000:]
    done = grpo_run.get("from-python").status()
    assert done["step"] == 40 and len(done["attempts"]) == 2 and done["baseline"]["runs"] == 1


def test_in_a_jupyter_kernel_the_trainers_progress_bar_is_drawn(tmp_path):
    """A kernel's stderr is no terminal, so the CLI's rule would draw no bar; ipykernel (6+) shows
    in the cell what child processes write to fd 2, so in a kernel the trainer draws it. The
    kernel is stood in for by its module's name in sys.modules, which is what is looked at."""
    script = SCRIPT.replace("import grpo_run\n", "import types\nsys.modules['ipykernel'] = types.ModuleType('ipykernel')\n"
                                                  "import grpo_run\n", 1)
    (tmp_path / "kernel.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "kernel.py"), str(tmp_path / "bucket"), "here-too"],
                          cwd=tmp_path, env={**os.environ, "GRPO_RUN_PROGRESS": "0"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "Succeeded", proc.stderr[-3000:]
    assert re.search(r"training: +100%\|.*\| 4/4", proc.stderr), proc.stderr[-3000:]


def test_tasks_as_a_dataset_or_chat_rows_are_written_as_parquet_the_trainer_reads(tmp_path):
    from datasets import Dataset

    from grpo_run.training import _task_file
    from grpo_run.trainer.envs.data import load_split

    chat = [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+1="}],
             "answer": str(a + 1)} for a in range(3)]
    for given, name in ((chat, "rows.parquet"), (Dataset.from_list(chat), "dataset.parquet")):
        path = _task_file(given, tmp_path / name, "tasks")
        assert load_split(path, "train") == chat                 # as the trainer reads a task file
    first = (tmp_path / "rows.parquet").read_bytes()
    _task_file(chat, tmp_path / "rows.parquet", "tasks")
    assert (tmp_path / "rows.parquet").read_bytes() == first     # the same rows, the same bytes: the same job
    with pytest.raises(grpo_run.JobError, match=r"eval_tasks: the rows cannot be written as Parquet"):
        _task_file([{"prompt": "a", "n": 1}, {"prompt": "b", "n": "x"}], tmp_path / "mixed.parquet", "eval_tasks")
    with pytest.raises(grpo_run.JobError, match=r"tasks: give a list of dicts"):
        _task_file(["just a prompt"], tmp_path / "bad.parquet", "tasks")


def test_a_reward_model_and_a_judge_are_given_as_the_job_file_gives_them(tmp_path, monkeypatch):
    from tests.trainer.grader.test_reward_model import build_reward_model

    build_reward_model(tmp_path / "rm")              # a folder beside the script
    monkeypatch.chdir(tmp_path)
    tasks = [{"prompt": f"{a}+{b}=", "n": "1"} for a in range(3) for b in range(3)]
    job = grpo_run.train(model="tiny:char", name="with-rm", tasks=tasks, held_out_fraction=0.3,
                         rewards=[uses_its_module, {"model": "rm", "weight": 0.5, "name": "rm"}],
                         num_generations=2, prompts_per_step=2, max_completion_length=4, max_steps=2, save_steps=2)
    status = job.status()
    assert status["phase"] == "Succeeded" and set(status["lastStep"]["rewards"]) == {"uses_its_module", "rm"}
    # the folder, given relative to where the script runs, is the job's by its absolute path
    assert job.doc()["spec"]["environment"]["rewards"][1] == {"model": str(tmp_path / "rm"), "weight": 0.5,
                                                               "name": "rm"}
    judge = {"url": "http://127.0.0.1:9/v1", "model": "m", "prompt": "Rate {completion}"}
    monkeypatch.delenv("GRPO_RUN_ALLOW_JUDGES", raising=False)
    with pytest.raises(grpo_run.JobError, match="this node does not allow LLM judges"):
        grpo_run.train(model="tiny:char", name="judged", tasks=tasks, held_out_fraction=0.3,
                       rewards=[uses_its_module, {"judge": judge, "name": "quality"}], max_steps=2)
    with pytest.raises(grpo_run.JobError, match=r"rewards\[1\]: a reward model or judge takes judge, model, name, "
                                                r"weight \(got group\)"):
        grpo_run.train(model="tiny:char", name="judged", tasks=tasks, held_out_fraction=0.3,
                       rewards=[uses_its_module, {"model": "rm", "group": True}], max_steps=2)


@pytest.mark.parametrize("trl_name, says", [
    ("num_train_epochs", "TRL's num_train_epochs: grpo-run counts steps, not epochs: max_steps"),
    ("per_device_train_batch_size", "TRL's per_device_train_batch_size: TRL's counts completions per device; "
                                    "grpo-run counts prompts: prompts_per_step"),
    ("max_prompt_length", "TRL's max_prompt_length: grpo-run takes prompts whole"),
    ("use_vllm", "TRL's use_vllm: sampler='vllm'"),
])
def test_trls_names_get_grpo_runs_own_never_a_look_alike_setting(tmp_path, trl_name, says):
    """difflib matched num_train_epochs to num_iterations (GRPO's inner iterations), 
    per_device_train_batch_size to eval_batch_size and max_prompt_length to max_completion_length:
    a TRL user took the hint and changed another setting. TRL's names answer from their table."""
    with pytest.raises(grpo_run.JobError) as refused:
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], rewards=[uses_its_module],
                       **{trl_name: 1})
    said = str(refused.value)
    assert said.startswith(f"grpo_run.train(): unknown argument {trl_name}; {says}"), said
    assert "did you mean" not in said and "docs/python-api.md" in said


def test_the_docs_table_of_trls_names_is_the_one_train_answers_from():
    from grpo_run.trl_names import TRL_NAMES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.+) \|$", doc, re.M))
    assert rows == {name: advice.replace("|", "\\|") for name, advice in TRL_NAMES.items()}


def test_a_dry_run_from_python_prints_the_estimate_and_starts_nothing(tmp_path, capsys):
    doc = grpo_run.train(model="tiny:char", name="dry", tasks=[{"prompt": "1+1=", "n": "2"}] * 4,
                         held_out_fraction=0.5, rewards=[uses_its_module], max_steps=5, dry_run=True)
    out = capsys.readouterr().out
    assert doc["status"]["phase"] == "Pending" and "totalGB" in doc["status"]["estimate"]["memory"]
    assert doc["spec"]["parameters"]["maxSteps"] == 5
    assert out.startswith("dry:") and "sampler" in out, out
    home = tmp_path / "grpo-run-home"
    assert not (home / "runs").exists()                                # nothing ran, no record anywhere
    with pytest.raises(grpo_run.JobError, match="--dry-run and --detach together"):
        grpo_run.train(model="tiny:char", name="dry", tasks=[{"prompt": "1+1=", "n": "2"}] * 4, held_out_fraction=0.5,
                       rewards=[uses_its_module], storage=str(tmp_path / "store"), detach=True, dry_run=True)
