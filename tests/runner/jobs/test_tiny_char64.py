"""`tiny:char64`, the demo's model that vLLM's CPU build serves, and the dry run refusing
`sampler: vllm` exactly when apply would (docs/sampling.md, "Trying it on a CPU")."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_USAGE, main
from grpo_run.runner.home import ensure_model
from grpo_run.trainer.sampling.choice import vllm_refusal

REPO = Path(__file__).resolve().parents[3]


def demo_job(tmp_path: Path, **parameters) -> Path:
    job = yaml.safe_load((REPO / "examples" / "tiny-arithmetic.yaml").read_text())
    job["spec"]["parameters"].update(parameters)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_the_dry_run_refuses_sampler_vllm_on_the_head_dim_16_model_as_apply_does(tmp_path, capsys):
    job = demo_job(tmp_path, sampler="vllm")
    assert main(["apply", "-f", str(job), "--dry-run"]) == EXIT_USAGE
    dry = capsys.readouterr()
    assert main(["apply", "-f", str(job)]) == EXIT_USAGE
    applied = capsys.readouterr()
    said = "spec.parameters.sampler: vllm cannot sample this job: the model's head_dim is 16"
    assert said in dry.err and dry.err == applied.err
    assert not (tmp_path / "grpo-run-home" / "runs").exists()          # nothing started


def test_tiny_char64_is_the_demo_model_with_head_dim_64_and_the_cli_writes_the_same(tmp_path):
    built = Path(ensure_model("tiny:char64"))
    config = json.loads((built / "config.json").read_text())
    demo = json.loads((Path(ensure_model("tiny:char")) / "config.json").read_text())
    assert config["head_dim"] == 64 and demo["head_dim"] == 16
    assert config["vocab_size"] == demo["vocab_size"] and config["num_hidden_layers"] == demo["num_hidden_layers"]
    assert vllm_refusal("LoRA", config, gpu=False) is None and vllm_refusal("LoRA", demo, gpu=False) is not None
    assert main(["tiny-model", "--out", str(tmp_path / "cli"), "--head-dim", "64"]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (built / name).read_bytes(), name


def test_an_unknown_head_dim_is_refused_by_the_cli(tmp_path, capsys):
    assert main(["tiny-model", "--out", str(tmp_path / "m"), "--head-dim", "32"]) == EXIT_USAGE
    assert "'32' is not one of '16', '64'" in capsys.readouterr().err and not (tmp_path / "m").exists()


@pytest.mark.slow
def test_the_docs_recipe_trains_tiny_char64_with_sampler_vllm(tmp_path):
    """The bash block of docs/sampling.md's "Trying it on a CPU", run as written in a checkout-like folder."""
    text = (REPO / "docs" / "sampling.md").read_text()
    section = text.split("## Trying it on a CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "tiny-arithmetic.yaml", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = {**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home")}
    run = subprocess.run(["bash", "-euc", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = subprocess.run([str(tmp_path / ".venv" / "bin" / "grpo-run"), "get", "tj", "tiny-arithmetic", "-o", "json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    status = json.loads(got.stdout)["status"]
    assert status["phase"] == "Succeeded" and status["sampler"]["engine"] == "vllm"
