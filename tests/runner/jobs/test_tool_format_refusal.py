"""A job with tools on a model whose chat template has no tool-call format grpo-run reads is
refused at apply with the reason, never run with its calls read as answers: a template that does
not render tools at all, and one that renders them in a format grpo-run does not read."""

import json

import pytest
import yaml

from tests.runner.jobs.test_examples import copy_example
from tests.runner.jobs.test_resume import grpo_run
from tests.runner.jobs.test_tools_example import EXAMPLE

PLAIN = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
OTHER = "{% if tools %}<|im_start|>system\n{{ tools | tojson }}\nCall one as <function=NAME>{ARGS}</function>" \
        "<|im_end|>\n{% endif %}" + PLAIN


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    from grpo_run.trainer.model.tinymodel import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("models") / "chat")


@pytest.mark.parametrize("template, why", [
    (PLAIN, "its chat template does not render tools"),
    (OTHER, "its chat template renders tools, but in a tool-call format grpo-run does not read"),
])
def test_a_model_without_a_tool_format_grpo_run_reads_is_refused_at_apply(chat_folder, tmp_path, template, why):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(chat_folder, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(template)
    job = copy_example(EXAMPLE, tmp_path / "calc")
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["model"] = str(model)
    job.write_text(yaml.safe_dump(spec))
    refused = grpo_run(tmp_path / "home", "apply", "-f", str(job), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "spec.environment.tools: the model" in refused.stderr and why in refused.stderr, refused.stderr[-2000:]
    assert "Succeeded" not in refused.stdout
