"""`grpo-run` as a user runs it: apply, get, export, and the errors they see."""

import json
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_FAILED, EXIT_OK, EXIT_USAGE, cli, main
from tests.faults.harness import fault_env

SMALL = {"numGenerations": 4, "promptsPerStep": 2, "maxCompletionLength": 4, "maxSteps": 4, "saveSteps": 2,
         "evalTasks": 6, "learningRate": 0.002}


def write_job(folder: Path, name="cli-job", environment=None, **params) -> Path:
    """A small job; with a user environment, its eval file sets the held-out tasks."""
    params = {**SMALL, **params}
    if environment is not None:
        del params["evalTasks"]
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char",
                    "environment": environment or {"name": "arithmetic"},
                    "parameters": params}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def get_json(capsys, name, *extra):
    capsys.readouterr()
    assert main(["get", "tj", name, "-o", "json", *extra]) == EXIT_OK
    return json.loads(capsys.readouterr().out)


def length_environment(folder: Path) -> dict:
    """A user environment whose reward (completion length) differs between samples: every step learns."""
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(5) for b in range(5)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n')
    return {"name": "length", "reward": "length.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}


def test_apply_runs_the_phases_and_export_loads_with_plain_peft(tmp_path, capsys):
    job = write_job(tmp_path, environment=length_environment(tmp_path))
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "cli-job: Succeeded after 4 steps" in out and "baseline" in out

    doc = get_json(capsys, "cli-job")
    assert doc["kind"] == "TrainingJob" and doc["metadata"]["name"] == "cli-job"
    st = doc["status"]
    assert st["phase"] == "Succeeded" and st["step"] == 4
    assert st["baseline"]["tasks"] == 2 and st["final"]["tasks"] == 2
    assert st["baseline"]["meanReward"] >= 0 and st["baseline"]["runs"] == 1
    assert st["attempts"][0]["reason"] == "Succeeded"
    assert "rewardSignal" in st["diagnostics"]

    capsys.readouterr()
    assert main(["get", "tj", "cli-job", "-w"]) == EXIT_OK          # a finished job: drawn once, done
    watched = capsys.readouterr().out.splitlines()
    assert watched[0] == "cli-job  Succeeded  attempt 1 on " + st["attempts"][0]["node"]
    assert [line.split()[0] for line in watched[1:4]] == ["BaselineEval", "Training", "FinalEval"]
    assert "4/4" in watched[2] and "100%" in watched[2] and len(watched) == 5

    assert main(["logs", "cli-job"]) == EXIT_OK
    log = capsys.readouterr().out
    assert "step 4/4 reward" in log and "baseline held-out mean reward" in log

    assert main(["export", "cli-job", "--out", str(tmp_path / "adapter")]) == EXIT_OK
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_run.runner.home import ensure_model

    base = AutoModelForCausalLM.from_pretrained(ensure_model("tiny:char"))
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(torch.count_nonzero(p) > 0 for p in lora_b)   # trained, not the zero init


def test_apply_prints_the_job_as_yaml_with_dry_run(tmp_path, capsys):
    assert main(["apply", "-f", str(write_job(tmp_path)), "--dry-run", "-o", "yaml"]) == EXIT_OK
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["spec"]["parameters"]["beta"] == 0.0 and doc["status"]["phase"] == "Pending"


def test_piped_the_run_prints_a_progress_line_every_5_percent_with_the_loss_note_once(tmp_path, capfd):
    job = write_job(tmp_path, name="piped", environment=length_environment(tmp_path), maxSteps=20, saveSteps=10)
    assert main(["apply", "-f", str(job)]) == EXIT_OK         # under pytest stderr is no terminal: no bar is drawn
    lines = [line for line in capfd.readouterr().err.splitlines() if "grpo_run.trainer.progress" in line]
    assert [line.split()[3] for line in lines] == [f"{i}/20" for i in range(1, 21)]
    assert sum("loss ~0 by construction" in line for line in lines) == 1 and "by construction" in lines[0]


def test_a_reward_function_that_raises_fails_the_run_with_its_own_error(tmp_path, capfd):
    capsys = capfd                         # the trainer's own stderr too: the error is said once, by the CLI
    (tmp_path / "rewards.py").write_text("def score(completion, task):\n    raise ValueError('cannot parse answer 42')\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+3="}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "4+4="}\n')
    env = {"name": "raises", "reward": "rewards.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}
    job = write_job(tmp_path, name="raises", environment=env, rewardRetries=1)
    assert main(["apply", "-f", str(job)]) == EXIT_FAILED
    said = capsys.readouterr()
    err = said.err
    assert "cannot parse answer 42" in err and "ValueError" in err
    said_all = said.out + said.err      # its traceback once, with real line breaks, never flattened with \x0a
    assert said_all.count("ValueError: cannot parse answer 42") == 1 and "\\x0a" not in said_all
    assert "    ValueError: cannot parse answer 42" in err.splitlines()
    st = get_json(capsys, "raises")["status"]
    assert st["phase"] == "Failed" and "cannot parse answer 42" in st["message"]
    assert "baseline" not in st            # never recorded as a score of 0
    assert st["step"] == 0
    # the advice is the way that works: resume would replay the stored copy of the broken file
    assert f"fix {tmp_path / 'rewards.py'}, then grpo-run apply -f {job} again" in said.out
    assert "grpo-run resume" not in said.out

    (tmp_path / "rewards.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    assert main(["apply", "-f", str(job)]) == EXIT_OK        # the job continues with the fixed file
    assert "raises: Succeeded after 4 steps" in capsys.readouterr().out


def test_after_a_code_error_resume_and_the_python_api_are_told_to_run_the_fixed_files_again(tmp_path):
    from grpo_run.runner.views.outcome import code_error_advice

    message = "reward function failed: reward function '/node/work/j/files/rewards.py:score' raised on ..."
    assert code_error_advice(message, None) == (
        "fix your copy of rewards.py, then grpo-run apply -f JOB (the job file you submitted; --detach to submit "
        "it again) again (resume would replay the copy stored at submit time)")
    assert code_error_advice(message, "grpo_run.train()").startswith("fix the function the error names, then call "
                                                                      "grpo_run.train() again")


def test_apply_says_first_when_its_budget_ends_training_before_the_final_evaluation(tmp_path, capfd):
    job = write_job(tmp_path, name="short-budget")
    doc = yaml.safe_load(job.read_text())
    doc["spec"].update(gpu="L40S", pricing={"usdPerHour": 360.0, "stepSeconds": 1.0}, maxCostUSD=0.25)   # $0.10 a step
    job.write_text(yaml.safe_dump(doc))
    assert main(["apply", "-f", str(job)]) == 4                           # it still runs, and stops at the budget
    err = capfd.readouterr().err.splitlines()
    warned = [i for i, line in enumerate(err) if line.startswith("warning: short-budget: maxCostUSD $0.25 stops the "
                                                                 "run after about step 2 of 4 (BudgetExceeded)")]
    # before anything of the run (its log lines), which may not reach its baseline on a loaded machine: at
    # $0.10 a second of wall time, the supervisor stops a trainer still starting 30 s past the budget
    run = [i for i, line in enumerate(err) if line.startswith(("INFO ", "WARNING ", "ERROR "))]
    assert warned and run and warned[0] < run[0], err


def test_a_reward_function_that_hangs_fails_the_run_with_a_timeout(tmp_path, capsys):
    (tmp_path / "rewards.py").write_text("import time\ndef score(completion, task):\n    time.sleep(1e6)\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "4+4="}\n')
    env = {"name": "hangs", "reward": "rewards.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}
    job = write_job(tmp_path, name="hangs", environment=env, rewardTimeoutSeconds=0.5, rewardRetries=0)
    assert main(["apply", "-f", str(job)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "time" in err.lower() and "0.5" in err
    assert get_json(capsys, "hangs")["status"]["phase"] == "Failed"


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["spec"]["parameters"].update(numGenerations=1), "spec.parameters.numGenerations"),
    (lambda d: d["spec"]["parameters"].update(method="QLoRa"), "spec.parameters.method"),
    (lambda d: d["spec"]["parameters"].update(maxSteps="ten"), "spec.parameters.maxSteps"),
    (lambda d: d["spec"].update(modle="x"), "spec.modle"),
    (lambda d: d["spec"].update(model="/no/such/model"), "spec.model"),
])
def test_malformed_job_files_get_a_one_screen_error_naming_the_field(tmp_path, capsys, mutate, field):
    path = write_job(tmp_path)
    doc = yaml.safe_load(path.read_text())
    mutate(doc)
    path.write_text(yaml.safe_dump(doc))
    assert main(["apply", "-f", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert field + ":" in err
    assert "Traceback" not in err and len(err.splitlines()) < 25


def test_a_missing_job_file_is_a_usage_error(tmp_path, capsys):
    assert main(["apply", "-f", str(tmp_path / "nope.yaml")]) == EXIT_USAGE
    assert "no such job file" in capsys.readouterr().err


def test_every_command_documents_itself_with_an_example(capsys):
    assert set(cli.commands) >= {"apply", "resume", "get", "logs", "export", "tiny-model"}
    capsys.readouterr()
    assert main(["--help"]) == EXIT_OK
    overview = f" {' '.join(capsys.readouterr().out.split())} "   # one line, whatever the terminal's width
    for name, command in cli.commands.items():               # a new command is covered by being added
        summary = command.get_short_help_str(limit=1000)
        assert summary and "\n" not in summary and f" {name} {summary} " in overview, name
        assert main([name, "--help"]) == EXIT_OK, name
        example = capsys.readouterr().out.split("example:\n", 1)
        assert len(example) == 2, f"{name} --help has no example: block"
        assert f"grpo-run {name} " in example[1].split("\n\n", 1)[0], name
    assert " get show jobs (get tj: tj is TrainingJob, kubectl-style): " in overview     # the short name explained


@pytest.mark.parametrize("argv", [[], ["bogus"], ["get", "tj", "-o", "xml"], ["apply"],
                                  ["tiny-model", "--out", "x", "--seed", "abc"]])
def test_a_bad_command_line_is_a_usage_error_and_starts_nothing(argv, capsys):
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and "Usage: grpo-run" in err


def test_without_a_thread_setting_the_trainer_takes_the_nodes_share_and_still_checkpoints(tmp_path, capsys,
                                                                                           monkeypatch):
    import os

    from grpo_run.runner.supervisor.threads import trainer_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)      # the tests' own setting: not a user's here
    monkeypatch.setenv("TMPDIR", str(tmp_path))               # this test's node registry
    pool = trainer_threads(len(os.sched_getaffinity(0)), {})["OMP_NUM_THREADS"]
    job = write_job(tmp_path, name="shared-cpu", saveSteps=1)
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    assert get_json(capsys, "shared-cpu")["status"]["phase"] == "Succeeded"
    assert main(["logs", "shared-cpu"]) == EXIT_OK
    assert f"CPU threads: {pool} (1 trainer on this node share {pool})" in capsys.readouterr().out
    from grpo_run.state.record import Record

    with Record(tmp_path / "grpo-run-home" / "runs" / "shared-cpu" / "state.db") as record:
        assert record.value("cpuThreads") == int(pool)          # kept for the run's later attempts
    assert not list((tmp_path / f"grpo-run-{os.getuid()}" / "trainers").glob("*.lock"))   # unregistered at the end


def test_a_restarted_trainer_runs_with_the_thread_count_the_first_one_took(tmp_path, caplog, monkeypatch):
    import logging

    caplog.set_level(logging.INFO, logger="grpo_run.runner")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for var, value in fault_env("backward@3/trainer", tmp_path / "fired").items():   # the trainer alone dies once
        monkeypatch.setenv(var, value)
    job = write_job(tmp_path, name="kept-threads")
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    from grpo_run.state.record import Record

    with Record(tmp_path / "grpo-run-home" / "runs" / "kept-threads" / "state.db") as record:
        kept = record.value("cpuThreads")
    assert (tmp_path / "fired").exists()                                     # the trainer did die once
    assert kept and f"trainer threads: {kept}, as the run's first trainer took" in caplog.text


def test_get_says_when_it_answers_from_this_machines_copy_of_a_job_stored_elsewhere(tmp_path, capsys):
    """A job run here keeps a work folder, and `get tj NAME` answers from it, even for a job whose
    storage another node may have gone on with since (it answered Succeeded for a gs:// job with
    no credentials and no emulator). It says so, and which command asks storage; -o json stays JSON."""
    storage = tmp_path / "bucket"
    job = write_job(tmp_path, maxSteps=2, saveSteps=1)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["storage"] = str(storage)
    job.write_text(yaml.safe_dump(doc))
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    capsys.readouterr()
    assert main(["get", "tj", "cli-job", "-o", "json"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert json.loads(out)["status"]["phase"] == "Succeeded"
    assert err.startswith("note: cli-job: from this machine's copy (") and "another node may have gone on" in err
    assert err.rstrip().endswith(f"grpo-run get tj cli-job --storage {storage}")
    assert main(["get", "tj", "cli-job", "--storage", str(storage)]) == EXIT_OK   # asked of storage: no note
    assert capsys.readouterr().err == ""
