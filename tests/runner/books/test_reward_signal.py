"""diagnostics.rewardSignal in `get tj`: groups that all failed alike warn (with the fix); groups
that all solved the task are fine, and said to be."""

import json

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.books.books import REWARD_WINDOW, Books
from grpo_run.runner.cli.commands import EXIT_OK, main
from tests.runner.cli.test_cli import write_job


def signal_after(tmp_path, steps: list[dict]) -> dict:
    b = Books(Store(str(tmp_path / "store")), tmp_path / "node", name="job",
              manifest={"kind": "TrainingJob", "metadata": {"name": "job"}}, usd_per_hour=None, max_cost_usd=None)
    try:
        for i, m in enumerate(steps, 1):
            b.log_step(i, m)
        b.update_reward_signal()
        return b.record.value("rewardSignal")
    finally:
        b.close()


def test_a_model_that_solves_most_groups_gets_a_note_and_no_warning(tmp_path):
    # the demo near its end: most groups identical because every completion is right
    steps = [{"identicalGroups": 0.7, "solvedGroups": 0.6, "noSignalGroups": 0.1}] * REWARD_WINDOW
    signal = signal_after(tmp_path, steps)
    assert "warning" not in signal and "solved" in signal["note"]
    assert (signal["solvedGroupFraction"], signal["noSignalGroupFraction"]) == (0.6, 0.1)


def test_groups_that_all_fail_alike_warn_with_the_fix(tmp_path):
    signal = signal_after(tmp_path, [{"identicalGroups": 0.9, "solvedGroups": 0.0, "noSignalGroups": 0.9}] * 10)
    assert "note" not in signal and "raise numGenerations or temperature" in signal["warning"]


def test_steps_logged_before_the_split_count_their_identical_groups_as_without_signal(tmp_path):
    assert "warning" in signal_after(tmp_path, [{"identicalGroups": 0.8}] * 5)


def constant_reward_job(folder, score: float):
    (folder / "constant.py").write_text(f"def score(completion, task):\n    return {score}\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(5) for b in range(5)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n')
    env = {"name": "constant", "reward": "constant.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}
    return write_job(folder, name=f"always-{int(score)}", environment=env)


def test_get_warns_on_a_job_whose_reward_is_always_0_and_not_on_one_always_right(tmp_path, capsys):
    closing = {}
    for score in (0.0, 1.0):
        assert main(["apply", "-f", str(constant_reward_job(tmp_path, score))]) == EXIT_OK
        closing[score] = capsys.readouterr().out
    # where the user looks, not only -o yaml: the run's closing lines, the table, -w and the report
    said = ("of groups in the last 4 steps failed alike (identical rewards, not solved) and taught nothing; raise "
            "numGenerations or temperature, or use an easier task")
    assert f"  warning: 100% {said}" in closing[0.0].splitlines() and "warning" not in closing[1.0]
    assert main(["get", "tj"]) == EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert [line for line in table if line.startswith("warning:")] == [
        f"warning: always-0: 100% {said}"]
    assert main(["get", "tj", "always-0", "-w"]) == EXIT_OK
    assert f"  warning: 100% {said}" in capsys.readouterr().out.splitlines()
    assert main(["report", "always-0", "--out", str(tmp_path / "r.png")]) == EXIT_OK
    assert f"- **warning**: 100% {said}" in (tmp_path / "r.md").read_text()
    capsys.readouterr()
    signals = {}
    for name in ("always-0", "always-1"):
        assert main(["get", "tj", name, "-o", "json"]) == EXIT_OK
        signals[name] = json.loads(capsys.readouterr().out)["status"]["diagnostics"]["rewardSignal"]
    assert signals["always-0"]["noSignalGroupFraction"] == 1.0 and "warning" in signals["always-0"]
    assert signals["always-1"]["solvedGroupFraction"] == 1.0 and "warning" not in signals["always-1"]
    assert "note" in signals["always-1"]
