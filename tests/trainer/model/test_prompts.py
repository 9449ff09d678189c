"""Prompts as the model reads them: text or chat messages, through the tokenizer's own chat
template, with a system prompt and template arguments; raw text where there is no template."""

import json

import pytest
import torch
import yaml

from grpo_run.trainer.sampling import sampler
from grpo_run.trainer.config import GRPOParams, parse_parameters, to_yaml_dict
from grpo_run.trainer.envs.catalog import user_environment
from grpo_run.trainer.trainer import GRPOTrainer, batch_indices
from grpo_run.trainer.model.policy import load_tokenizer
from grpo_run.trainer.model.prompts import PromptEncoder
from grpo_run.trainer.protocol import Plan
from grpo_run.runner.home import ensure_model

QUESTION = "How many clips did Natalia sell?"
CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_RUN_HOME", str(tmp_path_factory.mktemp("home")))
        return load_tokenizer(ensure_model("tiny:chat"))


def rendered(tok, messages, **kwargs) -> list[int]:
    """What the chat template gives, as transformers documents it."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"])


def left_padded(rows, pad):
    width = max(len(r) for r in rows)
    return ([[pad] * (width - len(r)) + r for r in rows], [[0] * (width - len(r)) + [1] * len(r) for r in rows])


def test_a_text_prompt_is_fed_as_one_user_message_through_the_chat_template(chat_tokenizer):
    ids, mask = PromptEncoder(chat_tokenizer).encode([QUESTION])
    assert ids.tolist() == [rendered(chat_tokenizer, [{"role": "user", "content": QUESTION}])]
    assert mask.tolist() == [[1] * ids.size(1)]
    assert chat_tokenizer.decode(ids[0]) == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def test_a_messages_prompt_is_fed_as_the_chat_template_renders_it(chat_tokenizer):
    ids, _ = PromptEncoder(chat_tokenizer).encode([CONVERSATION])
    assert ids.tolist() == [rendered(chat_tokenizer, CONVERSATION)]


def test_the_system_prompt_comes_first_unless_the_task_brings_its_own(chat_tokenizer):
    enc = PromptEncoder(chat_tokenizer, system_prompt="Think step by step.")
    system = {"role": "system", "content": "Think step by step."}
    own = [{"role": "system", "content": "Answer with a number."}, *CONVERSATION]
    ids, _ = enc.encode([QUESTION])
    assert ids.tolist() == [rendered(chat_tokenizer, [system, {"role": "user", "content": QUESTION}])]
    ids, _ = enc.encode([CONVERSATION])
    assert ids.tolist() == [rendered(chat_tokenizer, [system, *CONVERSATION])]
    ids, _ = enc.encode([own])
    assert ids.tolist() == [rendered(chat_tokenizer, own)]
    assert chat_tokenizer.decode(ids[0]).count("<|im_start|>system") == 1


def test_template_arguments_reach_the_template(chat_tokenizer):
    user = [{"role": "user", "content": QUESTION}]
    ids, _ = PromptEncoder(chat_tokenizer, template_kwargs={"enable_thinking": False}).encode([QUESTION])
    assert ids.tolist() == [rendered(chat_tokenizer, user, enable_thinking=False)]
    assert chat_tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids.tolist() != [rendered(chat_tokenizer, user)]


def test_a_batch_of_two_lengths_is_left_padded_with_the_pad_id(chat_tokenizer):
    system = "Be brief."
    enc = PromptEncoder(chat_tokenizer, system_prompt=system, template_kwargs={"enable_thinking": False})
    ids, mask = enc.encode(["Hi", CONVERSATION, "Hi"])
    rows = [rendered(chat_tokenizer, [{"role": "system", "content": system}, *m], enable_thinking=False)
            for m in ([{"role": "user", "content": "Hi"}], CONVERSATION, [{"role": "user", "content": "Hi"}])]
    assert len(rows[0]) < len(rows[1])
    want_ids, want_mask = left_padded(rows, chat_tokenizer.pad_token_id)
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    assert chat_tokenizer.pad_token == "<|endoftext|>"


def test_each_distinct_prompt_is_rendered_once(chat_tokenizer):
    enc = PromptEncoder(chat_tokenizer)
    first = enc.encode([QUESTION, CONVERSATION] * 4)
    again = enc.encode([CONVERSATION, QUESTION])
    info = enc._rendered.cache_info()
    assert (info.misses, info.hits) == (2, 8)
    assert torch.equal(again[0], first[0][[1, 0]])


def test_without_a_chat_template_text_prompts_stay_raw():
    tok = load_tokenizer(ensure_model("tiny:char"))
    assert not tok.chat_template
    ids, mask = PromptEncoder(tok).encode(["3+5=", "12+7="])
    # tiny:char: <pad> <eos> <unk>, then one id per character of "0123456789+=-:,| "
    assert ids.tolist() == [[0, 6, 13, 8, 14], [4, 5, 13, 10, 14]]
    assert mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    enc = tok(["3+5=", "12+7="], return_tensors="pt", padding=True)
    assert torch.equal(ids, enc.input_ids) and torch.equal(mask, enc.attention_mask)


def test_a_step_of_repeated_raw_prompts_encodes_as_one_batch_of_them_all_would():
    # a step repeats each prompt G times; each distinct one is tokenized once, rows unchanged
    tok = load_tokenizer(ensure_model("tiny:char"))
    group = [p for p in ("3+5=", "12+7=", "9+9=") for _ in range(4)] + ["3+5="]
    encoder = PromptEncoder(tok)
    ids, mask = encoder.encode(group)
    enc = tok(group, return_tensors="pt", padding=True)
    assert torch.equal(ids, enc.input_ids) and torch.equal(mask, enc.attention_mask)
    again = encoder.encode(["9+9=", "123+456=", "3+5="])     # the next step: known texts are not tokenized again
    enc = tok(["9+9=", "123+456=", "3+5="], return_tensors="pt", padding=True)
    assert torch.equal(again[0], enc.input_ids) and torch.equal(again[1], enc.attention_mask)
    assert encoder._tokenized.cache_info().misses == 4


def test_messages_without_a_chat_template_are_refused_naming_the_fix():
    enc = PromptEncoder(load_tokenizer(ensure_model("tiny:char")))
    with pytest.raises(ValueError, match="no chat template.*give the prompts as text, or use a model whose "
                                         "tokenizer has a chat template"):
        enc.encode(["3+5=", [{"role": "user", "content": "3+5="}]])
    with pytest.raises(ValueError, match="systemPrompt needs a chat template"):
        PromptEncoder(enc.tokenizer, system_prompt="Add.").encode(["3+5="])
    with pytest.raises(ValueError, match="must be text or a list of chat messages"):
        PromptEncoder(enc.tokenizer).encode([{"content": "3+5="}])


def test_the_trainer_feeds_sampling_the_rendered_prompts(tmp_path, monkeypatch):
    reward = tmp_path / "reward.py"
    reward.write_text("def score(completion, task):\n    return 0.0\n")
    tasks = [{"prompt": "Hi"}, {"prompt": CONVERSATION}]
    env = user_environment(name="chat", reward_ref=f"{reward}:score", tasks=tasks, eval_tasks=tasks[::-1])
    params = GRPOParams(numGenerations=2, promptsPerStep=2, maxCompletionLength=2, systemPrompt="Be brief.",
                        chatTemplateKwargs={"enable_thinking": False})
    fed = []

    def capture(model, prompt_ids, prompt_mask, **kwargs):
        fed.append((prompt_ids.tolist(), prompt_mask.tolist()))
        raise sampler.GenerationInterrupted()

    tr = GRPOTrainer(ensure_model("tiny:chat"), env, params)
    try:
        monkeypatch.setattr(sampler, "sample", capture)
        with pytest.raises(sampler.GenerationInterrupted):
            tr.train_step(0)
        with pytest.raises(sampler.GenerationInterrupted):
            tr.evaluate(env.eval_tasks)
        tok = tr.tokenizer
    finally:
        tr.close()

    def expected(prompts):
        system = {"role": "system", "content": "Be brief."}
        rows = [rendered(tok, [system, *([{"role": "user", "content": p}] if isinstance(p, str) else p)],
                         enable_thinking=False) for p in prompts]
        return left_padded(rows, tok.pad_token_id)

    group = [tasks[i]["prompt"] for i in batch_indices(0, 0, 2, 2) for _ in range(2)]
    assert fed[0] == expected(group)
    assert fed[1] == expected([CONVERSATION, "Hi"])


# --- the parameters travel ---------------------------------------------------------------------

def test_chat_parameters_round_trip_through_yaml_and_the_trainers_plan(tmp_path):
    p = GRPOParams.model_validate({"systemPrompt": "Be brief.", "stopStrings": ["</answer>"],
                                   "chatTemplateKwargs": {"enable_thinking": False, "tools": [{"name": "calc"}]}})
    again = GRPOParams.model_validate(yaml.safe_load(yaml.safe_dump(to_yaml_dict(p))))
    assert again.chatTemplateKwargs == {"enable_thinking": False, "tools": [{"name": "calc"}]}
    env = user_environment(name="e", reward_ref="m:f", tasks=[{"prompt": CONVERSATION}], eval_tasks=[{"prompt": "x"}])
    plan = Plan.from_json(Plan(name="j", model="m", env=env, params=p).to_json())
    assert plan.params.model_dump(exclude={"lora"}) == p.model_dump(exclude={"lora"})
    assert plan.params.stopStrings == ("</answer>",) and plan.env.train_tasks[0]["prompt"] == CONVERSATION
    assert json.loads(Plan(name="j", model="m", env=env, params=GRPOParams()).to_json())["params"]["chatTemplateKwargs"] == {}


def test_template_arguments_must_be_a_mapping_of_what_json_carries():
    import datetime

    problems: list[str] = []
    parse_parameters({"chatTemplateKwargs": ["enable_thinking"]}, "spec.parameters", problems)
    parse_parameters({"chatTemplateKwargs": {"tokenize": False}}, "spec.parameters", problems)
    parse_parameters({"chatTemplateKwargs": {"date": datetime.date(2025, 1, 1)}}, "spec.parameters", problems)
    parse_parameters({"systemPrompt": 3}, "spec.parameters", problems)
    assert problems == [
        "spec.parameters.chatTemplateKwargs: must be a mapping like {enable_thinking: false} (got ['enable_thinking'])",
        "spec.parameters.chatTemplateKwargs: tokenize is set by the trainer itself; remove it (template arguments "
        "only, e.g. {enable_thinking: false})",
        "spec.parameters.chatTemplateKwargs: date: must be text, a number, true/false, null, or a list or mapping "
        "of those (got 2025-01-01)",
        "spec.parameters.systemPrompt: must be a string (got 3)",
    ]
