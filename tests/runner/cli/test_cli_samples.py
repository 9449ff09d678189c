"""`grpo-run samples` as a user runs it: after a run, on this node and from storage alone."""

import json

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from tests.runner.cli.test_cli import length_environment, write_job


def test_samples_show_each_step_s_groups_and_the_evaluations_task_by_task(tmp_path, capsys, monkeypatch):
    job = write_job(tmp_path, environment=length_environment(tmp_path), evalSteps=2, sampleGroups=2)
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    capsys.readouterr()

    assert main(["samples", "cli-job", "--last", "2"]) == EXIT_OK
    text = capsys.readouterr().out
    for step in (3, 4):
        assert f"step {step}, group 1 of 2" in text and f"step {step}, group 2 of 2" in text
    assert "step 2," not in text
    assert text.count('prompt: "') == 4 and text.count("score=") == 4 * 4     # 2 steps x 2 groups x G=4

    assert main(["samples", "cli-job", "--step", "1", "-o", "json"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 4 and {r["step"] for r in rows} == {1} and {r["group"] for r in rows} == {1, 2}
    for r in rows:
        assert r["rewards"] == {"score": float(len(r["completion"]))} and "+" in r["prompt"]
    for g in (1, 2):
        group = [r for r in rows if r["group"] == g]
        marks = [r["mark"] for r in group]
        assert ("best" in marks and "worst" in marks) or len({r["reward"] for r in group}) == 1
        assert all(r["reward"] == max(x["reward"] for x in group) for r in group if r["mark"] == "best")

    assert main(["samples", "cli-job", "--eval", "final"]) == EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith("task 1 after step 4\nprompt: \"7+8=\"\n  baseline ") and "\n  final " in text
    assert main(["samples", "cli-job", "--eval", "heldout", "--step", "2", "-o", "json"]) == EXIT_OK
    held = json.loads(capsys.readouterr().out)
    assert [(r["task"], r["eval"], r["step"]) for r in held] == [(1, "heldOut", 2), (2, "heldOut", 2)]
    assert all("baseline" in r for r in held)

    # another machine: nothing but the storage
    store = tmp_path / "grpo-run-home" / "store"
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "laptop"))
    assert main(["samples", "cli-job", "--storage", str(store), "--eval", "final", "-o", "json"]) == EXIT_OK
    final = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in final] == ["7+8=", "9+9="]
    assert all(set(r) >= {"prompt", "completion", "rewards", "baseline"} for r in final)


def test_samples_that_are_not_there_say_what_is(tmp_path, capsys):
    job = write_job(tmp_path, environment=length_environment(tmp_path), sampleGroups=1)
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    capsys.readouterr()
    assert main(["samples", "cli-job", "--step", "9"]) == EXIT_USAGE
    assert "no samples of training step 9: kept are 1-4" in capsys.readouterr().err
    assert main(["samples", "cli-job", "--step", "1", "--last", "2"]) == EXIT_USAGE
    assert "give one" in capsys.readouterr().err
    assert main(["samples", "cli-job", "--eval", "heldout"]) == EXIT_USAGE        # no evalSteps: none
    assert "no held-out evaluation samples in job 'cli-job' yet" in capsys.readouterr().err
    assert main(["samples", "no-such-job"]) == EXIT_USAGE
    assert "no-such-job" in capsys.readouterr().err
