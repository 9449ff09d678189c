"""Preflight (runner/jobs/preflight.py): the mistakes that used to pass `--dry-run` and cost a node
boot each (issue 22's "Seen" list) are refused by `apply`, `apply --dry-run` and `apply --detach`
in the job file's error format with exit 2, naming the field and the fix; and a hub model's dry
run reads (or fetches) its config.json only, keeping the hub id in the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main

# Qwen/Qwen3-0.6B's config.json (as tests/runner/jobs/test_dryrun.py): a model folder without weights
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen3"}
HUB_ID = "grpo-run-tests/qwen3-0.6b"          # a hub id no test ever reaches the real hub for
REWARDS = "def score(completion, task):\n    return float(completion.strip() == task['answer'])\n"


@pytest.fixture
def folder(tmp_path) -> Path:
    """A job's folder: a config-only model, a reward file, train and held-out task files."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN3_0_6B))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "3+3=", "answer": "6"}\n')
    return tmp_path


def write_job(folder: Path, *, environment: dict | None = None, parameters: dict | None = None, **spec) -> Path:
    env = {"name": "mine", "reward": "rewards.py:score", "tasks": "train.jsonl", "evalTasks": "eval.jsonl"}
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "mine"},
           "spec": {"model": "./model",
                    "environment": {k: v for k, v in {**env, **(environment or {})}.items() if v is not None},
                    "parameters": {"maxSteps": 100, "saveSteps": 25, **(parameters or {})}, **spec}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def dry_run(capsys, job: Path, *more: str) -> tuple[int, str, str]:
    return run(capsys, "apply", "-f", str(job), "--dry-run", *more)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No AWS credentials anywhere botocore looks (the metadata service is off in every test)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


# --- the "Seen" list: each one exit 2 from --dry-run, naming the field and the fix ---------------------


def test_a_reward_file_with_a_syntax_error_is_refused_with_its_file_and_line(capsys, folder):
    (folder / "rewards.py").write_text("import math\n\ndef score(completion, task)\n    return 1.0\n")

    code, out, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE and out == ""
    assert f"{folder / 'job.yaml'}: 1 problem:" in err
    assert f"spec.environment.reward: {folder / 'rewards.py'}:3: SyntaxError" in err
    assert "fix the file" in err and "Traceback" not in err


def test_a_wrong_function_name_names_the_functions_the_file_has_and_no_internal_module(capsys, folder):
    (folder / "rewards.py").write_text(REWARDS + "from math import sqrt\n\ndef helper(x):\n    return x\n")

    code, _, err = dry_run(capsys, write_job(folder, environment={"reward": "rewards.py:scor"}))

    assert code == EXIT_USAGE
    assert f"spec.environment.reward: {folder / 'rewards.py'} has no 'scor'; it defines: helper, score" in err
    assert "give one of those after the ':' (rewards.py:FUNCTION)" in err
    assert "grader_reward" not in err and "sqrt" not in err          # no internal module, no imported names


def test_the_reward_is_imported_inside_the_sandbox_as_the_trainer_imports_it(capsys, folder, tmp_path_factory):
    # A reward whose import reads a file outside its folder works in plain Python, and fails in the
    # grader's sandbox (only its own folder and the Python installation are readable): the
    # preflight sees what the node will see.
    secret = tmp_path_factory.mktemp("elsewhere") / "answers.txt"
    secret.write_text("42\n")
    (folder / "rewards.py").write_text(f"ANSWERS = open({str(secret)!r}).read()\n" + REWARDS)
    plain = subprocess.run([sys.executable, "-c", "import rewards"], cwd=folder, capture_output=True)
    assert plain.returncode == 0, plain.stderr

    code, _, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE
    assert (f"spec.environment.reward: importing rewards.py for score failed: {folder / 'rewards.py'}:1: "
            f"PermissionError: [Errno 13] reading '{secret}' was refused") in err


def test_a_task_file_without_prompt_says_which_columns_it_has_and_how_columns_maps_them(capsys, folder):
    (folder / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')

    code, _, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE
    assert ('spec.environment.tasks: train.jsonl has no column "prompt" (row 1 has question, answer): '
            "spec.environment.columns maps a column to it, e.g. columns: {prompt: question}") in err


def test_the_columns_mapping_is_applied_to_the_first_rows_and_a_missing_column_is_named(capsys, folder):
    (folder / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (folder / "eval.jsonl").write_text('{"question": "3+3=", "answer": "6"}\n')

    code, _, err = dry_run(capsys, write_job(folder, environment={"columns": {"prompt": "question"}}))
    assert code == EXIT_OK, err

    code, _, err = dry_run(capsys, write_job(folder, environment={"columns": {"prompt": "qestion"}}))
    assert code == EXIT_USAGE
    assert ("spec.environment.columns.prompt: train.jsonl has no column 'qestion' (row 1 has question, answer): "
            "map prompt to one of those") in err


def test_a_parquet_task_file_is_read_through_the_columns_too(capsys, folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": ["1+1=", "2+2="], "answer": ["2", "4"]}), folder / "train.parquet")

    code, _, err = dry_run(capsys, write_job(folder, environment={"tasks": "train.parquet"}))

    assert code == EXIT_USAGE
    assert 'spec.environment.tasks: train.parquet has no column "prompt" (row 1 has problem, answer)' in err
    assert "columns: {prompt: problem}" in err


def test_a_task_file_that_is_not_what_its_suffix_says_is_named(capsys, folder):
    (folder / "train.parquet").write_text('{"prompt": "1+1="}\n')

    code, _, err = dry_run(capsys, write_job(folder, environment={"tasks": "train.parquet"}))

    assert code == EXIT_USAGE and "Traceback" not in err
    assert "spec.environment.tasks: train.parquet cannot be read as parquet: " in err


def test_a_task_line_that_is_not_json_is_named_by_file_and_line(capsys, folder):
    (folder / "eval.jsonl").write_text('{"prompt": "3+3=", "answer": "6"}\n{"prompt": "4+4=", answer: 8}\n')

    code, _, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE
    assert "spec.environment.evalTasks: eval.jsonl:2: not JSON" in err


def test_an_empty_task_file_is_refused(capsys, folder):
    (folder / "eval.jsonl").write_text("\n")

    code, _, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE and "spec.environment.evalTasks: eval.jsonl has no rows" in err


def test_a_local_data_set_folder_is_checked_for_its_splits_and_columns(capsys, folder):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": ["1+1="], "answer": ["2"]})}).save_to_disk(
        str(folder / "data"))
    env = {"tasks": None, "evalTasks": None, "dataset": "./data"}

    code, _, err = dry_run(capsys, write_job(folder, environment=env))
    assert code == EXIT_USAGE
    assert (f"spec.environment.evalSplit: {folder / 'data'} has no split 'test' for held-out tasks (it has "
            "train): set evalSplit, or heldOutFraction") in err
    assert "data split 'train' has no column \"prompt\" (row 1 has question, answer)" in err

    code, _, err = dry_run(capsys, write_job(folder, environment={**env, "trainSplit": "training"}))
    assert code == EXIT_USAGE
    assert f"spec.environment.trainSplit: {folder / 'data'} has no split 'training' (it has train)" in err

    env.update(columns={"prompt": "question"}, heldOutFraction=0.5)
    code, _, err = dry_run(capsys, write_job(folder, environment=env))
    assert code == EXIT_OK, err


def test_a_data_set_on_the_hub_is_not_read_and_says_so(capsys, folder):
    env = {"tasks": None, "evalTasks": None, "dataset": "grpo-run-tests/no-such-data", "columns": {"prompt": "q"}}

    code, _, err = dry_run(capsys, write_job(folder, environment=env))

    assert code == EXIT_OK, err
    assert "note: spec.environment.dataset: grpo-run-tests/no-such-data is a data set on the hub, not read here" in err


def test_gsm8k_data_files_without_gsm8k_s_columns_are_refused(capsys, folder):
    (folder / "gsm-train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    (folder / "gsm-test.jsonl").write_text('{"question": "2+2?", "answer": "so #### 4"}\n')
    env = {"name": "gsm8k", "reward": None, "tasks": None, "evalTasks": None,
           "dataFiles": {"train": "gsm-train.jsonl", "test": "gsm-test.jsonl"}}

    code, _, err = dry_run(capsys, write_job(folder, environment=env))

    assert code == EXIT_USAGE
    assert ("spec.environment.dataFiles.train: gsm-train.jsonl row 1 is not GSM8K's: gsm8k needs the columns "
            "question and answer (ending in '#### N'); it has question, answer") in err
    assert "dataFiles.test" not in err


def test_a_model_the_estimate_cannot_read_is_said_on_detach_not_passed_over(capsys, folder, tmp_path):
    config = json.loads((folder / "model" / "config.json").read_text())
    (folder / "model" / "config.json").write_text(json.dumps({**config, "num_experts": 8}))

    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage=str(tmp_path / "store"))), "--detach")

    assert code == EXIT_OK, err
    assert ("warning: spec.model: the memory fit on spec.gpu is not checked: model config: mixture-of-experts "
            "models are not estimated yet") in err


@pytest.mark.parametrize(("line", "says"), [
    ('["1+1=", "2"]', "eval.jsonl row 1 is not an object (got list)"),
    ('{"prompt": 12, "answer": "2"}', 'eval.jsonl row 1: "prompt" must be a string or a list of chat messages'),
])
def test_a_task_that_is_not_one_is_named_by_its_row(capsys, folder, line, says):
    (folder / "eval.jsonl").write_text(line + "\n")

    code, _, err = dry_run(capsys, write_job(folder))

    assert code == EXIT_USAGE and f"spec.environment.evalTasks: {says}" in err


def test_a_task_folder_written_by_save_to_disk_is_read_through_the_columns(capsys, folder):
    import datasets

    datasets.Dataset.from_dict({"question": ["1+1="], "answer": ["2"]}).save_to_disk(str(folder / "train-data"))

    code, _, err = dry_run(capsys, write_job(folder, environment={"tasks": "./train-data"}))
    assert code == EXIT_USAGE and 'spec.environment.tasks: train-data has no column "prompt"' in err

    (folder / "eval.jsonl").write_text('{"question": "3+3=", "answer": "6"}\n')
    code, _, err = dry_run(capsys, write_job(folder, environment={"tasks": "./train-data",
                                                                  "columns": {"prompt": "question"}}))
    assert code == EXIT_OK, err


def test_gs_and_az_storage_pass_the_dry_run_with_a_note_that_credentials_were_not_tried(capsys, folder, monkeypatch):
    code, _, err = dry_run(capsys, write_job(folder, storage="gs://my-bucket/grpo"))
    assert code == EXIT_OK, err
    assert "spec.storage: credentials not tried on a dry run" in err and "gs://my-bucket/grpo/mine" in err

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "myaccount")
    code, _, err = dry_run(capsys, write_job(folder, storage="az://my-container/grpo"))
    assert code == EXIT_OK, err


def test_az_storage_without_an_account_is_refused_naming_the_variables(capsys, folder):
    code, _, err = dry_run(capsys, write_job(folder, storage="az://my-container/grpo"))

    assert code == EXIT_USAGE and "Traceback" not in err
    assert "spec.storage: storage az://my-container/grpo/mine: no Azure storage account: set AZURE_STORAGE_ACCOUNT" in err


def test_a_cloud_store_whose_library_is_missing_names_the_extra(capsys, folder, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    code, _, err = dry_run(capsys, write_job(folder, storage="gs://my-bucket/grpo"))

    assert code == EXIT_USAGE and "Traceback" not in err
    assert "pip install 'grpo-run[gcs]'" in err


def test_a_missing_bucket_is_refused_before_anything_is_submitted(capsys, folder, gcs_env):
    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage=f"gs://no-{gcs_env.bucket}/grpo")),
                       "--detach")
    assert code == EXIT_USAGE and "Traceback" not in err
    assert f"bucket 'no-{gcs_env.bucket}' does not exist (create it, or fix spec.storage)" in err


def test_a_storage_url_that_does_not_parse_is_a_problem_not_a_traceback(capsys, folder):
    code, _, err = dry_run(capsys, write_job(folder, storage="s3://[my-bucket/grpo"))

    assert code == EXIT_USAGE and "Traceback" not in err
    assert "spec.storage: not a URL (got s3://[my-bucket/grpo): Invalid IPv6 URL" in err


def test_s3_storage_without_credentials_is_refused_by_the_dry_run(capsys, folder, no_aws):
    code, _, err = dry_run(capsys, write_job(folder, storage="s3://my-bucket/grpo"))

    assert code == EXIT_USAGE
    assert ("spec.storage: no AWS credentials found for s3://my-bucket/grpo: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY") in err


def test_an_aws_profile_that_does_not_exist_is_named(capsys, folder, no_aws, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")

    code, _, err = dry_run(capsys, write_job(folder, storage="s3://my-bucket/grpo"))

    assert code == EXIT_USAGE and "Traceback" not in err
    assert "spec.storage: the AWS credentials for s3://my-bucket/grpo cannot be read: " in err
    assert "no-such-profile" in err


def test_save_steps_past_max_steps_on_a_job_with_storage_is_warned_about(capsys, folder, tmp_path):
    parameters = {"maxSteps": 20, "saveSteps": 25}

    code, _, err = dry_run(capsys, write_job(folder, parameters=parameters, storage=str(tmp_path / "store")))

    assert code == EXIT_OK, err                   # a warning: a short job may mean it
    assert ("warning: spec.parameters.saveSteps: 25 >= maxSteps (20): no checkpoint is saved before the last "
            "step") in err and "set saveSteps below maxSteps" in err

    code, _, err = dry_run(capsys, write_job(folder, parameters=parameters))     # no storage: nothing to resume
    assert code == EXIT_OK and "saveSteps" not in err


def test_dry_run_and_detach_together_are_refused(capsys, folder):
    code, out, err = dry_run(capsys, write_job(folder), "--detach")

    assert code == EXIT_USAGE and out == ""
    assert "error: --dry-run and --detach together" in err


def test_every_problem_is_reported_at_once(capsys, folder, no_aws):
    (folder / "rewards.py").write_text("def score(completion, task)\n    return 1.0\n")
    (folder / "train.jsonl").write_text('{"question": "1+1="}\n')

    code, _, err = dry_run(capsys, write_job(folder, storage="s3://my-bucket/grpo"))

    assert code == EXIT_USAGE
    assert "3 problems:" in err
    said = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert [line.split(":")[0].strip() for line in said[1:]] == [
        "spec.storage", "spec.environment.tasks", "spec.environment.reward"]


def test_a_model_folder_is_noted_for_a_job_another_node_runs_and_not_for_this_machine(capsys, folder):
    """A folder of this machine is on no node unless put there: said by --detach and by a dry run
    of a job with storage; a dry run without storage (this machine runs it) says nothing."""
    where = f"note: spec.model: {folder / 'model'} is a folder on this machine: a node runs this job only if"
    assert where in dry_run(capsys, write_job(folder, storage=str(folder / "bucket")))[2]
    assert where not in dry_run(capsys, write_job(folder))[2]
    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage=str(folder / "bucket"))), "--detach")
    assert code == EXIT_OK and where in err


# --- apply and --detach: the same checks, and the storage probe ------------------------------------


def test_a_real_apply_refuses_a_task_file_without_prompt_as_a_bad_job_file(capsys, folder):
    (folder / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')

    code, _, err = run(capsys, "apply", "-f", str(write_job(folder)))

    assert code == EXIT_USAGE                      # it exited 1 after starting the supervisor
    assert 'spec.environment.tasks: train.jsonl has no column "prompt"' in err


def test_detach_refuses_s3_storage_without_credentials_and_writes_nothing(capsys, folder, no_aws):
    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage="s3://my-bucket/grpo")), "--detach")

    assert code == EXIT_USAGE
    assert "spec.storage: no AWS credentials found for s3://my-bucket/grpo" in err


def test_the_dry_run_says_credentials_were_found_and_writes_nothing(capsys, folder, s3_env):
    code, _, err = dry_run(capsys, write_job(folder, storage=s3_env.url))

    assert code == EXIT_OK, err
    assert "note: spec.storage: AWS credentials found (env); not tried on a dry run" in err
    assert s3_env.server.client().list_objects_v2(Bucket=s3_env.bucket).get("KeyCount") == 0


def test_detach_probes_the_storage_and_refuses_a_bucket_that_does_not_exist(capsys, folder, s3_env):
    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage="s3://no-such-bucket-grpo/run")),
                       "--detach")

    assert code == EXIT_USAGE
    assert "spec.storage: " in err and "no-such-bucket-grpo" in err
    assert "submitted" not in err


def test_detach_to_a_bucket_that_works_leaves_only_the_job_there(capsys, folder, s3_env):
    code, out, err = run(capsys, "apply", "-f", str(write_job(folder, storage=s3_env.url)), "--detach")

    assert code == EXIT_OK, err
    keys = [o["Key"] for o in s3_env.server.client().list_objects_v2(Bucket=s3_env.bucket).get("Contents", [])]
    # the job's folder, and the grpo-run wheel the nodes install (runner/deploy/wheel.py), nothing else
    assert keys and all(k.startswith(("run/mine/", "run/_dist/")) for k in keys)
    assert not any("probe" in k for k in keys)     # the preflight's object was deleted


# --- a real model: the hub id is kept, its config.json read from (or fetched into) the cache -----------


def _fill_cache(cache: Path, repo_id: str, config: dict) -> None:
    """The Hugging Face cache's layout for one file, as hf_hub_download leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path) -> Path:
    """HF_HUB_OFFLINE=1 with an empty cache of this test's own (huggingface_hub reads both at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_offline_a_hub_model_not_in_the_cache_says_how_to_fill_it_without_changing_model(capsys, folder, offline_hub):
    code, _, err = dry_run(capsys, write_job(folder, model=HUB_ID))

    assert code == EXIT_USAGE
    assert f"spec.model: no config.json for '{HUB_ID}' in the Hugging Face cache, and HF_HUB_OFFLINE is set" in err
    assert f"`hf download {HUB_ID} config.json`" in err
    assert f"hf_hub_download('{HUB_ID}', 'config.json')" in err
    assert f"keep spec.model: {HUB_ID}" in err and "--local-dir" not in err


def test_offline_a_hub_model_in_the_cache_is_estimated_and_keeps_its_hub_id(capsys, folder, offline_hub):
    _fill_cache(offline_hub, HUB_ID, QWEN3_0_6B)

    code, out, err = dry_run(capsys, write_job(folder, model=HUB_ID, gpu="L4"), "-o", "json")

    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert doc["spec"]["model"] == HUB_ID
    assert doc["status"]["estimate"]["memory"]["parameters"] == 596_049_920 and doc["status"]["estimate"]["memory"]["fits"]


def test_a_model_that_is_neither_a_folder_nor_a_hub_id_is_said_before_any_network(capsys, folder, closed_port):
    code, _, err = dry_run(capsys, write_job(folder, model="grpo-run-tests/qwen/0.6b"))

    assert code == EXIT_USAGE
    assert "spec.model: 'grpo-run-tests/qwen/0.6b' is neither a local folder nor a Hugging Face hub id" in err


def test_a_real_apply_never_skips_the_fit_check_of_a_hub_model(capsys, folder, offline_hub):
    # before: `est = None  # a real run may still fetch the model`, and the run started unchecked
    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, model=HUB_ID, gpu="L4")))

    assert code == EXIT_USAGE
    assert f"spec.model: no config.json for '{HUB_ID}'" in err


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """grpo-run in a child process: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE at import."""
    return subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", *args], env={**os.environ, **env},
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_hub_that_cannot_be_reached_is_said_at_once_with_how_to_fill_the_cache(folder, closed_port):
    job = write_job(folder, model=HUB_ID)
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port}", "HF_HUB_CACHE": str(folder / "hf-cache"),
           "HF_HUB_OFFLINE": "0"}

    done = _cli(["apply", "-f", str(job), "--dry-run"], env, folder)

    assert done.returncode == EXIT_USAGE, done.stderr
    assert "and fetching it failed (" in done.stderr and f"`hf download {HUB_ID} config.json`" in done.stderr
    assert "Retrying" not in done.stderr          # one try: huggingface_hub's own five would take 23 s


class _Hub(BaseHTTPRequestHandler):
    """Enough of the Hugging Face hub's file endpoint for hf_hub_download of one config.json."""

    served: dict[str, bytes] = {}
    refused: dict[str, tuple[int, str]] = {}     # path -> (status, the hub's X-Error-Code)
    asked: list[str] = []

    def _answer(self, body: bool) -> None:
        type(self).asked.append(f"{self.command} {self.path}")
        data = self.served.get(self.path)
        if data is None:
            status, code = self.refused.get(self.path, (404, "EntryNotFound"))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", "b" * 40)
        self.send_header("ETag", '"config-etag"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self) -> None:  # noqa: N802 -- http.server's names
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def log_message(self, *args) -> None:
        pass


def test_with_network_the_dry_run_fetches_only_config_json_into_the_normal_cache(folder):
    _Hub.served = {f"/{HUB_ID}/resolve/main/config.json": json.dumps(QWEN3_0_6B).encode()}
    _Hub.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = folder / "hf-cache"
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "0"}
    try:
        done = _cli(["apply", "-f", str(write_job(folder, model=HUB_ID, gpu="L4")), "--dry-run", "-o", "yaml"],
                    env, folder)
    finally:
        server.shutdown()

    assert done.returncode == EXIT_OK, done.stderr
    assert yaml.safe_load(done.stdout)["spec"]["model"] == HUB_ID          # the job keeps the hub id
    # of the model's repository only config.json was asked for (huggingface_hub also asks the
    # endpoint for its own registry, /api/agent-harnesses, which is no file of the model)
    assert {line.split()[1] for line in _Hub.asked if HUB_ID in line} == {f"/{HUB_ID}/resolve/main/config.json"}
    cached = list(cache.glob(f"models--{HUB_ID.replace('/', '--')}/snapshots/*/*"))
    assert [p.name for p in cached] == ["config.json"]
    assert json.loads(cached[0].read_text()) == QWEN3_0_6B


@pytest.mark.parametrize(("status", "code", "says"), [
    (404, "RepoNotFound", f"spec.model: no model '{HUB_ID}' on the Hugging Face hub (or it is private"),
    (403, "GatedRepo", f"spec.model: '{HUB_ID}' is gated on the Hugging Face hub: accept its terms on "
                       f"https://huggingface.co/{HUB_ID} and log in"),
    (404, "EntryNotFound", f"spec.model: '{HUB_ID}' has no config.json on the Hugging Face hub"),
])
def test_what_the_hub_answers_is_said_in_words(tmp_path, monkeypatch, status, code, says):
    from huggingface_hub import constants

    from grpo_run.runner.estimate.config import model_config

    _Hub.served, _Hub.asked = {}, []
    _Hub.refused = {f"/{HUB_ID}/resolve/main/config.json": (status, code)}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)          # HF_ENDPOINT, read at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        with pytest.raises(LookupError) as raised:
            model_config(HUB_ID, cache_dir=tmp_path / "hf-cache")
    finally:
        server.shutdown()
        _Hub.refused = {}
    assert str(raised.value).startswith(says)


def test_a_store_that_does_not_answer_the_probe_is_a_failure_of_the_moment(capsys, folder, monkeypatch,
                                                                             closed_port):
    import grpo_run.runner.jobs.preflight as preflight

    monkeypatch.setattr(preflight, "PROBE_RETRY_S", 1.0)      # 15 s against a closed port otherwise
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "grpo-run-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")

    code, _, err = run(capsys, "apply", "-f", str(write_job(folder, storage="s3://my-bucket/grpo")), "--detach")

    assert code == 1                                  # not the job file's fault: try again
    assert err.startswith("error: spec.storage: ") and "nothing was submitted or started" in err
