"""The tools example a user copies (examples/calculator-tools) trains to Succeeded through the
real command on tiny:chat, its tools answered in the grader's sandbox; a tool the model cannot be
told about is refused at apply, naming the field."""

import importlib.util
import json
import shutil

import yaml

from tests.runner.jobs.test_examples import copy_example
from tests.runner.jobs.test_resume import REPO, grpo_run

EXAMPLE = REPO / "examples" / "calculator-tools"


def module(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLE / f"{name}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def test_the_tools_compute_and_the_reward_reads_the_answer_after_the_last_tool_result():
    tools, rewards = module("tools"), module("rewards")
    assert tools.add(2, 3) == 5 and tools.multiply(4, 2.5) == 10
    episode = ('<tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 35}}</tool_call>user\n<tool_response>\n'
               '245\n</tool_response>assistant\nThe answer is 245.')
    assert rewards.final_answer(episode, {"answer": 245}) == 1.0
    assert rewards.final_answer(episode.replace("245.", "244."), {"answer": 245}) == 0.0
    tasks = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (EXAMPLE / "eval.jsonl").read_text().splitlines()]
    assert {t["prompt"][0]["content"] for t in tasks}.isdisjoint(t["prompt"][0]["content"] for t in held)


def test_the_example_trains_to_succeeded_as_copied_and_counts_its_tool_calls(tmp_path):
    job = copy_example(EXAMPLE, tmp_path / "calc", maxSteps=2, saveSteps=1)
    done = grpo_run(tmp_path / "home", "apply", "-f", str(job))
    assert "calculator-tools: Succeeded after 2 steps" in done.stdout, done.stdout + done.stderr
    assert "changed spec" not in done.stderr, done.stderr
    status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "calculator-tools", "-o", "json").stdout)["status"]
    last = status["lastStep"]
    assert set(last["rewards"]) == {"final_answer"}              # tools' own loop adds no "episode" reward
    # tiny:chat-tools opens every answer with a real call: multiply(7, 35), answered 245 by the tool
    assert last["toolCalls"] >= 1 and last["toolErrorRate"] == 0 and "truncatedByToolTime" in last
    shown = json.loads(grpo_run(tmp_path / "home", "samples", "calculator-tools", "-o", "json").stdout)
    assert shown and all(r["toolCalls"] >= 1 and r["toolErrors"] == 0 and 1 <= r["turns"] <= 3 for r in shown)
    said = grpo_run(tmp_path / "home", "samples", "calculator-tools").stdout
    assert "(tool call)" in said and '"name": "multiply"' in said and "tool results:" in said and "245" in said, said


def test_a_tool_without_type_hints_is_refused_at_apply_naming_the_field(tmp_path):
    folder = tmp_path / "calc"
    shutil.copytree(EXAMPLE, folder)
    with (folder / "tools.py").open("a") as f:
        f.write('\n\ndef power(a, b: int) -> float:\n    """a to the b."""\n    return a ** b\n')
    job = yaml.safe_load((folder / "job.yaml").read_text())
    job["spec"]["environment"]["tools"].append("tools.py:power")
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    refused = grpo_run(tmp_path / "home", "apply", "-f", str(folder / "job.yaml"), "--dry-run", check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "spec.environment.tools: tool power: argument 'a' has no type hint" in refused.stderr, refused.stderr
