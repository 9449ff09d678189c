"""`spec.parameters.staleness` (asynchronous GRPO, trainer.ahead): bad values and the jobs that
cannot sample asynchronously are refused at apply time, naming the field and the reason; the dry
run shows it as status.sampler.staleness."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo_run.runner.cli.commands import main
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.sampling.choice import decide
from tests.runner.spec.test_episodes_spec import folder, write_job as write_episodes_job  # noqa: F401
from tests.runner.spec.test_job import job, problems


@pytest.mark.parametrize("value, says", [(-1, "must be between 0 and 8 (got -1)"), (9, "must be between 0 and 8 (got 9)"),
                                         (1.5, "must be an integer (got 1.5)"), ("2", "must be an integer (got '2')")])
def test_a_bad_staleness_is_refused_naming_the_field(value, says):
    found = problems(job(parameters={"staleness": value}))
    assert len(found) == 1 and found[0].startswith("spec.parameters.staleness: " + says), found


@pytest.mark.parametrize("parameters, says", [
    ({"method": "Full"}, "method Full cannot sample asynchronously: every policy version in flight would be a whole"),
    ({"sampler": "vllm"}, "sampler: vllm (colocate) cannot sample asynchronously: a colocated engine shares"),
    ({"sampler": "vllm", "vllm": {"mode": "server", "server": "http://127.0.0.1:8000"}},
     "sampler: vllm (server) cannot sample asynchronously: grpo-run does not sample a server asynchronously yet"),
])
def test_staleness_with_a_method_or_engine_that_cannot_overlap_is_refused_with_the_reason(parameters, says):
    found = problems(job(parameters={"staleness": 1, **parameters}))
    assert len(found) == 1 and found[0].startswith("spec.parameters.staleness: is 1, and " + says), found


def test_staleness_on_several_processes_is_refused_with_the_reason():
    found = problems(job(parameters={"staleness": 1, "promptsPerStep": 8}, resources={"processes": 2}))
    assert found == ["spec.parameters.staleness: is 1, and asynchronous sampling runs on one trainer process yet "
                     "(its producer is a thread beside the update); set spec.resources.processes: 1 without nodes, "
                     "or staleness: 0"]


def test_staleness_with_episodes_is_refused_with_the_reason(folder, capsys):  # noqa: F811
    path = write_episodes_job(folder)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["parameters"]["staleness"] = 1
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--dry-run"]) != 0
    err = capsys.readouterr().err
    assert "spec.parameters.staleness: is 1, and an environment with episodes or tools cannot sample" in err


def test_auto_samples_an_asynchronous_run_natively_and_says_why():
    choice = decide(GRPOParams(staleness=2), lambda: {}, gpu=True, processes=1)
    assert choice.engine == "native" and "staleness is 2" in choice.why


def test_the_dry_run_shows_the_staleness_as_status_sampler_staleness(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(parameters={"staleness": 2, "maxSteps": 4})))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--dry-run", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"]["sampler"]["staleness"] == 2 and doc["spec"]["parameters"]["staleness"] == 2
