"""Job files: defaults from SPEC, and every problem named at once."""

from pathlib import Path

import pytest
import yaml

from grpo_run.runner.spec.job import JobError, load_job, parse_job

REPO = Path(__file__).resolve().parents[3]


def job(**spec):
    base = {"model": "tiny:char", "environment": {"name": "arithmetic"}}
    base.update(spec)
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "t"}, "spec": base}


def problems(doc, base=None):
    with pytest.raises(JobError) as e:
        parse_job(doc, base=base)
    return e.value.problems


def test_parameters_default_to_the_spec_values():
    p = parse_job(job()).parameters
    assert (p.numGenerations, p.beta, p.maxCompletionLength, p.lora.r, p.method, p.saveSteps) == (4, 0.0, 64, 8, "LoRA", 25)


def test_the_demo_job_is_valid():
    j = load_job(REPO / "examples" / "tiny-arithmetic.yaml")
    assert j.name == "tiny-arithmetic" and j.model == "tiny:char"


def test_every_problem_is_reported_together_naming_field_value_and_fix():
    doc = job(parameters={"numGenerations": 1, "method": "QLoRa", "beta": "lots", "maxStep": 10})
    found = problems(doc)
    assert "spec.parameters.numGenerations: must be >= 2 (got 1): GRPO needs a group to compare" in found
    assert any(p.startswith("spec.parameters.method: must be one of LoRA, QLoRA, Full (got 'QLoRa')") for p in found)
    assert "spec.parameters.beta: must be a number (got 'lots')" in found
    assert "spec.parameters.maxStep: unknown field; did you mean maxSteps?" in found
    assert len(found) == 4


def test_unknown_keys_are_errors_at_every_level():
    doc = job(paramters={})
    doc["metadat"] = {}
    found = problems(doc)
    assert any(p.startswith("spec.paramters: unknown field; did you mean parameters?") for p in found)
    assert any(p.startswith("metadat: unknown field") for p in found)


def test_wrong_types_are_named():
    found = problems(job(parameters={"maxSteps": 2.5, "gradientCheckpointing": "yes", "lora": {"r": True}}))
    assert "spec.parameters.maxSteps: must be an integer (got 2.5)" in found
    assert "spec.parameters.gradientCheckpointing: must be true or false (got 'yes')" in found
    assert "spec.parameters.lora.r: must be an integer (got true)" in found


def test_a_missing_model_folder_is_named_with_the_fix(tmp_path):
    found = problems(job(model=str(tmp_path / "nope")))
    assert len(found) == 1 and found[0].startswith("spec.model: no such folder")
    assert "hub id" in found[0]
    (tmp_path / "empty").mkdir()
    found = problems(job(model="./empty"), base=tmp_path)
    assert "has no config.json" in found[0]


def test_hub_ids_are_accepted_without_a_network():
    assert parse_job(job(model="Qwen/Qwen3-0.6B")).model == "Qwen/Qwen3-0.6B"


def test_user_environment_paths_resolve_against_the_job_file(tmp_path):
    (tmp_path / "rewards.py").write_text("def score(c, t):\n    return 1.0\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "2+2="}\n')
    doc = job(environment={"name": "mine", "reward": "rewards.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    env = load_job(tmp_path / "job.yaml").environment
    assert env.reward == f"{tmp_path / 'rewards.py'}:score"
    assert env.tasks == str(tmp_path / "train.jsonl")


def test_user_environment_problems_are_named(tmp_path):
    found = problems(job(environment={"name": "mine", "reward": "rewards.py:score"}), base=tmp_path)
    assert any(p.startswith("spec.environment.reward: no such file") for p in found)
    assert any(p.startswith("spec.environment.tasks: required with reward") for p in found)
    assert any(p.startswith("spec.environment.evalTasks: required with reward") for p in found)


def test_unknown_catalog_environment_lists_the_catalog():
    found = problems(job(environment={"name": "chess"}))
    assert "arithmetic, graph-coloring" in found[0]


def test_catalog_task_counts_that_do_not_fit_are_refused():
    found = problems(job(parameters={"evalTasks": 100}))
    assert found[0].startswith("spec.parameters.evalTasks: arithmetic has 100 distinct tasks")


def test_envelope_problems(tmp_path):
    doc = job()
    doc.update(apiVersion="v2", kind="Job", metadata={"name": "Bad_Name"})
    found = problems(doc)
    assert found[0] == "apiVersion: must be grpo-run/v1 (got 'v2')"
    assert found[1] == "kind: must be TrainingJob (got 'Job')"
    assert found[2].startswith("metadata.name: must be lowercase letters")


def test_invalid_yaml_is_a_job_error(tmp_path):
    (tmp_path / "j.yaml").write_text("spec: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(tmp_path / "j.yaml")


def test_qlora_is_checked_before_anything_runs(monkeypatch):
    import grpo_run.trainer.model.policy as policy

    def broken(device):
        raise policy.QLoRAUnavailable("bitsandbytes has no working NF4 kernel for cpu")

    monkeypatch.setattr(policy, "check_qlora", broken)
    found = problems(job(parameters={"method": "QLoRA"}))
    assert found == ["spec.parameters.method: QLoRA cannot run here: bitsandbytes has no working NF4 kernel for cpu"]


def test_a_yaml_exponent_without_a_dot_is_named_with_the_fix(tmp_path):
    # PyYAML reads 1e-5 as the string "1e-5" (YAML 1.1 wants 1.0e-5): say so instead of "not a number".
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(job()).replace("spec:\n", "spec:\n  parameters: {learningRate: 1e-5}\n"))
    with pytest.raises(JobError) as e:
        load_job(tmp_path / "j.yaml")
    assert e.value.problems == ["spec.parameters.learningRate: must be a number (got '1e-5'): YAML reads 1e-5 "
                                "as text; write it with a dot, e.g. 1.0e-5"]


def test_task_files_on_a_catalog_environment_are_one_problem_each():
    found = problems(job(environment={"name": "arithmetic", "tasks": "nope.jsonl"}))
    assert found == ["spec.environment.tasks: only for environments with your own reward "
                     "(catalog environment 'arithmetic' makes its own tasks)"]


def test_a_valid_job_round_trips_through_its_manifest():
    first = parse_job(job(pricing={"usdPerHour": 2}, notices={"clouds": ["gcp"], "gcpMetadataURL": "http://127.0.0.1:9/"},
                          parameters={"lora": {"r": 4, "targetModules": ["q_proj"]}}))
    again = parse_job(first.to_dict())
    assert again.to_dict() == first.to_dict() and again.notices.urls == (("GRPO_RUN_GCP_METADATA_URL", "http://127.0.0.1:9"),)
    assert again.parameters.lora.targetModules == ("q_proj",)


def test_the_real_first_job_in_examples_is_valid_offline():
    j = load_job(REPO / "examples" / "gsm8k-qwen2.5-0.5b.yaml")
    assert (j.model, j.environment.name, j.parameters.maxCompletionLength) == ("Qwen/Qwen2.5-0.5B-Instruct", "gsm8k", 512)
    assert [(r.label, r.weight) for r in j.environment.rewards] == [("correct", 1.0), ("format", 0.2)]


def test_evaluating_while_training_needs_steps_to_evaluate_between():
    found = problems(job(parameters={"evalSteps": 200, "maxSteps": 200}))
    assert found == ["spec.parameters.evalSteps: must be < maxSteps (200) to evaluate while training; "
                     "the final evaluation runs after the last step anyway"]
