"""The ids an environment's turn adds, rendered once at the boundary by the chat template's rules:
with the real template of tiny:chat, the boundary's newline after <|im_end|> kept, and the history's
ids never re-tokenized."""

import pytest

from grpo_run.runner.home import ensure_model
from grpo_run.trainer.episodes.tokens import BoundaryMismatch, TurnRenderer
from grpo_run.trainer.model.policy import load_tokenizer
from grpo_run.trainer.model.prompts import PromptEncoder


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    import os

    os.environ["GRPO_RUN_HOME"] = str(tmp_path_factory.mktemp("home"))
    tok = load_tokenizer(str(ensure_model("tiny:chat")))
    return tok, TurnRenderer(PromptEncoder(tok), [tok.convert_tokens_to_ids("<|im_end|>")])


def template(tok, messages, generation_prompt):
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=False))


def test_the_first_prompt_is_the_templates_rendering_with_the_generation_prompt(chat):
    tok, render = chat
    ids, conversation = render.first("What is 2 + 2?")
    assert ids == template(tok, [{"role": "user", "content": "What is 2 + 2?"}], True)
    assert conversation == [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_turn_after_a_reply_that_ended_keeps_the_newline_after_its_end_of_turn_token(chat):
    tok, render = chat
    first, conversation = render.first("What is 2 + 2?")
    reply = tok("The answer is 4", add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    added, after = render.observation(conversation, reply, "The answer is 4", "Are you sure?")
    assert tok.decode(added) == "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    # the whole sequence is the template's rendering of the conversation, here where the reply's
    # ids are the tokenizer's own: the boundary is exactly the template's
    assert first + reply + added == template(tok, after, True)
    assert after[-2:] == [{"role": "assistant", "content": "The answer is 4"},
                          {"role": "user", "content": "Are you sure?"}]


def test_a_reply_cut_before_its_end_gets_the_templates_end_of_turn_as_the_environments_tokens(chat):
    tok, render = chat
    _, conversation = render.first("Count")
    reply = tok("1 2 3", add_special_tokens=False).input_ids               # cut at maxCompletionLength
    added, _ = render.observation(conversation, reply, "1 2 3", [{"role": "user", "content": "go on"}])
    assert tok.decode(added) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_the_history_is_never_re_tokenized_even_when_its_text_would_tokenize_otherwise(chat):
    tok, render = chat
    first, conversation = render.first("Count")
    # a model may spell 'answer' one character a time; the tokenizer would merge it into 3 tokens
    odd = [tok.convert_tokens_to_ids(c) for c in "answer"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(tok("answer", add_special_tokens=False).input_ids) < 6
    added, _ = render.observation(conversation, odd, tok.decode(odd, skip_special_tokens=True), "ok")
    sequence = first + odd + added
    assert sequence[:len(first) + len(odd)] == first + odd                     # the sampled ids, untouched
    assert tok.decode(added) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_renders_earlier_turns_differently_is_refused_with_the_reason(chat):
    tok, _ = chat

    class Shifty:
        """Renders the last assistant message differently when another message follows it."""
        def __init__(self):
            self.tokenizer = tok
            self.system_prompt, self.template_kwargs, self.templated = None, {}, True

        def encode(self, prompts):
            return PromptEncoder(tok).encode(prompts)

    render = TurnRenderer(Shifty(), [tok.convert_tokens_to_ids("<|im_end|>")])
    tok_template = tok.chat_template
    try:
        tok.chat_template = ("{%- for m in messages %}{{ m['role'] + (':' if loop.last else '=') + m['content'] }}"
                             "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant:' }}{%- endif %}")
        with pytest.raises(BoundaryMismatch, match="not prefix-stable"):
            render.observation([{"role": "user", "content": "a"}], [5], "b", "c")
    finally:
        tok.chat_template = tok_template


def test_text_observations_are_tokenized_on_their_own_without_a_template(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path))
    tok = load_tokenizer(str(ensure_model("tiny:char")))
    render = TurnRenderer(PromptEncoder(tok), [tok.eos_token_id])
    ids, conversation = render.first("3+4=")
    assert conversation is None and tok.decode(ids) == "3+4="
    added, _ = render.observation(None, [5, tok.eos_token_id], "x", "+|")
    assert added == tok("+|", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="no chat template"):
        render.observation(None, [5], "x", [{"role": "user", "content": "+"}])


# --- characters the tokenizer does not know (tiny:char reads 20 tokens) ------------------------------


@pytest.fixture
def char():
    from grpo_run.trainer.model.tinymodel import build_tokenizer

    tok = build_tokenizer()
    return tok, TurnRenderer(PromptEncoder(tok), [tok.eos_token_id])


def test_an_observation_the_tokenizer_cannot_read_is_warned_of_once_naming_what_it_reads(char, caplog):
    """An own environment on tiny:char: " higher:" and " lower:" reach the model as <unk>s and
    a colon, which the environment's author never sees unless told."""
    tok, render = char
    with caplog.at_level("WARNING", logger="grpo_run.trainer.episodes.tokens"):
        render.first("7+1=")                                            # all known: nothing said
        assert caplog.records == []
        for _ in range(3):                                              # every turn of every episode
            render.observation(None, [5], "5", " higher:")
            render.observation(None, [5], "5", " lower:")
        render.first("digit 15:")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said                                         # once for observations, once for prompts
    assert said[0].startswith("the environment's observation ' higher:' has characters the model's tokenizer does "
                              "not know ('h' 'i' 'g' 'e' 'r'): each becomes <unk>")
    assert "it reads only ' +,-0123456789:=|' (docs/environments.md)" in said[0]
    assert said[1].startswith("the episode's prompt 'digit 15:' has characters")


def test_a_tokenizer_without_an_unknown_token_is_never_warned_of(chat, caplog):
    tok, render = chat                                                  # byte-level BPE: every text has ids
    with caplog.at_level("WARNING", logger="grpo_run.trainer.episodes.tokens"):
        first, conversation = render.first("Ünïcode → ok")
        render.observation(conversation, [], "", "ünïcode ✓")
    assert caplog.records == []


def test_people_see_the_unknown_token_where_the_model_read_one(char):
    from grpo_run.trainer.episodes.tokens import readable

    tok, _ = char
    ids = tok(" higher:", add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == " :"            # what samples showed before
    assert readable(tok, ids) == " <unk><unk><unk><unk><unk><unk>:"
    assert readable(tok, tok("1+2", add_special_tokens=False).input_ids + [tok.eos_token_id]) == "1+2"


def test_an_episodes_exchanges_for_samples_show_the_unknown_token(char):
    """What `grpo-run samples` shows of an episode's turns (Rollouts.episode_view, through the
    episodes' decode_ids): the observation as the model read it, <unk>s and all, not " :"."""
    import threading

    import torch

    from grpo_run.trainer.rollout import MultiTurn, Text

    tok, _ = char
    episodes = MultiTurn(None, Text(tok, PromptEncoder(tok)), None, [tok.eos_token_id], max_turns=2, context=64,
                         pad_id=tok.pad_token_id, device=torch.device("cpu"), stop=threading.Event())
    assert episodes.decode_ids(tok(" lower:", add_special_tokens=False).input_ids) == " <unk><unk><unk><unk><unk>:"
