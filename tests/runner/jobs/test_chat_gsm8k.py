"""A real workload's shape end to end, offline: an instruct-style model (byte-level BPE, Qwen's
chat template) runs the gsm8k environment from local Parquet files through `grpo-run apply`,
with a correctness and a format reward, a system prompt and a held-out curve while training."""

import json

import yaml

from grpo_run.runner.cli.commands import EXIT_OK, main
from grpo_run.trainer.model.prompts import PromptEncoder
from grpo_run.runner.home import ensure_model

ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
         "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"} for a in range(1, 5) for b in range(1, 4)]


def test_gsm8k_from_local_parquet_runs_end_to_end_with_both_rewards_per_step(tmp_path, capsys):
    from datasets import Dataset

    Dataset.from_list(ROWS[:8]).to_parquet(str(tmp_path / "train.parquet"))
    Dataset.from_list(ROWS[8:]).to_parquet(str(tmp_path / "test.parquet"))
    job = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "chat-gsm8k"},
           "spec": {"model": "tiny:chat",
                    "environment": {"name": "gsm8k", "dataFiles": {"train": "train.parquet", "test": "test.parquet"},
                                    "rewards": [{"function": "correct"}, {"function": "format", "weight": 0.2}]},
                    "parameters": {"numGenerations": 4, "promptsPerStep": 2, "maxCompletionLength": 8,
                                   "maxSteps": 2, "saveSteps": 1, "evalSteps": 1, "microBatchSize": 3,
                                   "systemPrompt": "You are a careful math tutor.",
                                   "chatTemplateKwargs": {"enable_thinking": False}}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))

    assert main(["apply", "-f", str(tmp_path / "job.yaml")]) == EXIT_OK
    capsys.readouterr()
    assert main(["get", "tj", "chat-gsm8k", "-o", "json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)["status"]

    assert status["phase"] == "Succeeded" and status["step"] == 2
    assert set(status["lastStep"]["rewards"]) == {"correct", "format"}
    learning = status["lastStep"]["learningCompletions"]                # of 8: the others carried no signal
    assert status["lastStep"]["microBatches"] == -(-learning // 3)        # in micro-batches of 3
    assert set(status["baseline"]["rewards"]) == {"correct", "format"} and status["baseline"]["tasks"] == 4
    assert [e["step"] for e in status["heldOut"]] == [1]                # every evalSteps, before the end
    assert set(status["final"]["rewards"]) == {"correct", "format"}


def test_the_prompt_the_trainer_feeds_is_the_chat_template_token_for_token():
    from transformers import AutoTokenizer

    path = ensure_model("tiny:chat")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    encoder = PromptEncoder(tok, system_prompt="Be brief.", template_kwargs={"enable_thinking": False})
    question = ROWS[0]["question"]
    ids, mask = encoder.encode([question])
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False,
                                       enable_thinking=False)
    assert ids[0].tolist() == expected and mask[0].tolist() == [1] * len(expected)
