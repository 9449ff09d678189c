"""Tools for chat models: schemas from signatures and docstrings (as transformers writes them),
Qwen's <tool_call> parsed, calls answered in the environment's sandboxed worker, errors told to
the model as the tool's result, a tool past its time limit ending the episode, and the whole
episode's ids and masks with the real chat template of tiny:chat."""

import json
import os
import textwrap
from typing import Literal, Optional

import pytest

from grpo_run.trainer.envs.catalog import ANSWER_AFTER_TOOLS
from grpo_run.trainer.episodes.host import EnvironmentFailed, EnvironmentHost, Reply
from grpo_run.trainer.episodes.limits import MAX_TOOL_CALLS, Truncation
from grpo_run.trainer.grader.tools import ToolProblem, tool_calls, tool_schema

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def slow(seconds: float) -> str:
    """Sleep a while."""
    time.sleep(seconds)
    return "awake"


def untyped(a, b: int) -> int:
    """Has no hint for a."""
    return b
'''


def add(a: int, b: float, unit: Literal["m", "km"] = "m", tags: list[str] | None = None,
        extra: Optional[dict[str, int]] = None) -> float:
    """Add two numbers.

    Longer text here.

    Args:
        a: The first number.
        b: The second
            number, continued.
        unit: The unit.
        tags: Optional tags.
        extra: More.

    Returns:
        The sum.
    """
    return a + b


def lookup(key: str, fresh: bool = False) -> dict[str, str]:
    """Look a key up in the table."""
    return {}


@pytest.mark.parametrize("fn", [add, lookup], ids=["documented", "short"])
def test_a_tools_schema_is_the_one_transformers_writes_for_it(fn):
    """What the chat template renders for a tool: the format transformers' get_json_schema writes
    (the worker cannot import transformers, so the schema is made there with the standard library)."""
    from transformers.utils import get_json_schema

    if fn is lookup:       # transformers insists on every argument described; ours does not
        pytest.importorskip("transformers")
        ours = tool_schema(fn)
        assert ours["function"]["parameters"] == {"type": "object", "properties": {
            "key": {"type": "string"}, "fresh": {"type": "boolean"}}, "required": ["key"]}
        return
    assert tool_schema(fn) == get_json_schema(fn)


def test_a_function_that_cannot_be_described_is_refused_with_its_name_and_the_fix():
    def no_hint(a, b: int):
        """Doc."""

    def no_doc(a: int):
        pass

    def odd(a: object):
        """Doc."""

    for fn, words in ((no_hint, "argument 'a' has no type hint"), (no_doc, "has no docstring"),
                      (odd, "has no JSON schema type")):
        with pytest.raises(ToolProblem, match=words):
            tool_schema(fn)


def test_tool_calls_are_parsed_from_qwens_format_and_a_bad_one_becomes_an_error_for_the_model():
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    as_text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert tool_calls("I will add. " + good) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert tool_calls(as_text) == [{"name": "add", "arguments": {"a": 1}}]
    assert tool_calls("The answer is 3.") == []
    bad = tool_calls('<tool_call>{"name": add}</tool_call>')
    assert len(bad) == 1 and bad[0].startswith("error: the tool call is not JSON")
    assert tool_calls('<tool_call>{"tool": "add"}</tool_call>')[0].startswith("error: a tool call is")
    assert tool_calls('<tool_call>{"name": "add", "arguments": {}}')[0] == \
        "error: the tool call has no closing </tool_call>"
    many = tool_calls(good * (MAX_TOOL_CALLS + 2))
    assert len(many) == MAX_TOOL_CALLS + 2 and all(isinstance(c, dict) for c in many[:MAX_TOOL_CALLS])
    assert all(c.startswith(f"error: at most {MAX_TOOL_CALLS} tool calls") for c in many[MAX_TOOL_CALLS:])


def tools_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    return str(path)


def test_the_sandboxed_worker_answers_tool_calls_and_the_reply_without_one_ends_the_episode(tmp_path):
    tools = tools_file(tmp_path)
    with EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tools}:add", f"{tools}:divide"]) as host:
        assert [t["function"]["name"] for t in host.tool_schemas] == ["add", "divide"]
        assert host.reset([{"prompt": [{"role": "user", "content": "2+3?"}]}], [1]) == \
            [[{"role": "user", "content": "2+3?"}]]
        call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        assert host.step([0], [call]) == [Reply(observation=[{"role": "tool", "name": "add", "content": "5"}],
                                                reward=0.0, done=False, tool_calls=1, tool_errors=0)]
        # a tool that raises, a tool that is not there, arguments it does not take: the model reads why
        wrong = ('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
                 '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
                 '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>')
        answer, = host.step([0], [wrong])
        assert answer.tool_calls == 3 and answer.tool_errors == 3 and not answer.done
        said = [m["content"] for m in answer.observation]
        assert said[0] == "error: ZeroDivisionError: division by zero"
        assert said[1] == "error: there is no tool 'mul'; the tools are add, divide"
        assert said[2].startswith("error: TypeError: add() got an unexpected keyword argument 'c'")
        assert host.step([0], ["It is 5."]) == [Reply(observation=None, reward=0.0, done=True)]


def test_a_tool_past_its_time_limit_ends_the_episode_by_that_limit(tmp_path):
    tools = tools_file(tmp_path)
    with EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tools}:slow"], tool_timeout_s=0.3) as host:
        host.reset([{"prompt": "p"}, {"prompt": "q"}], [1, 2])
        late = '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>'
        quick = '<tool_call>{"name": "slow", "arguments": {"seconds": 0}}</tool_call>'
        assert host.step([0, 1], [late, quick]) == [
            Reply(observation=None, reward=0.0, done=True, truncated=Truncation.TOOL_TIME, tool_calls=1,
                  tool_errors=1),
            Reply(observation=[{"role": "tool", "name": "slow", "content": "awake"}], reward=0.0, done=False,
                  tool_calls=1, tool_errors=0)]


def test_a_tool_without_type_hints_fails_to_load_naming_it(tmp_path):
    tools = tools_file(tmp_path)
    with pytest.raises(EnvironmentFailed, match="tool untyped: argument 'a' has no type hint"):
        EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tools}:untyped"])


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from grpo_run.runner.home import ensure_model
    from grpo_run.trainer.model.policy import load_tokenizer

    os.environ["GRPO_RUN_HOME"] = str(tmp_path_factory.mktemp("home"))
    return load_tokenizer(str(ensure_model("tiny:chat")))


def test_a_tool_episode_trains_the_sampled_ids_and_never_the_tools_results(chat, tmp_path):
    """The real template of tiny:chat renders the tools in the first prompt and each result as
    Qwen's <tool_response>; the episode's ids are the sampled replies and those rendered turns
    appended, the loss mask 1 on the replies alone."""
    from types import SimpleNamespace

    import torch

    from grpo_run.trainer.episodes.loop import run_episodes
    from grpo_run.trainer.episodes.tokens import TurnRenderer
    from grpo_run.trainer.model.prompts import PromptEncoder

    tok, tools = chat, tools_file(tmp_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = [tok('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                   add_special_tokens=False).input_ids + [end],
               tok("5", add_special_tokens=False).input_ids + [end]]

    def sample(ids, mask, seeds):
        reply = replies.pop(0)
        return SimpleNamespace(ids=torch.tensor([reply]), mask=torch.ones(1, len(reply), dtype=torch.long),
                               entropy=torch.zeros(1))

    with EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tools}:add"]) as host:
        render = TurnRenderer(PromptEncoder(tok, template_kwargs={"tools": host.tool_schemas}), [end])
        played = run_episodes(sample, render, host, [{"prompt": [{"role": "user", "content": "2+3?"}]}], [1],
                              max_turns=4, context=4096, pad_id=tok.pad_token_id)
    first = played.prompt_ids[0][played.prompt_mask[0].bool()].tolist()
    assert '"name": "add"' in tok.decode(first) and "<tool_call>" in tok.decode(first)
    rest = played.ids[0][played.mask[0].bool()].tolist()
    learnt = played.loss_mask[0][played.mask[0].bool()].tolist()
    reply1, reply2 = (tok('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                          add_special_tokens=False).input_ids + [end], tok("5", add_special_tokens=False).input_ids + [end])
    between = rest[len(reply1):len(rest) - len(reply2)]
    assert rest[:len(reply1)] == reply1 and rest[len(rest) - len(reply2):] == reply2     # the sampled ids, as sampled
    assert tok.decode(between) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n"
    assert learnt == [1] * len(reply1) + [0] * len(between) + [1] * len(reply2)
    # the whole sequence is the template's rendering of the conversation with the tools
    whole = tok.apply_chat_template([{"role": "user", "content": "2+3?"},
                                     {"role": "assistant", "content": tok.decode(reply1[:-1])},
                                     {"role": "tool", "name": "add", "content": "5"},
                                     {"role": "assistant", "content": "5"}], tools=render.encoder.template_kwargs["tools"],
                                    tokenize=True, return_dict=False)
    assert first + rest == list(whole)[:len(first) + len(rest)]
    assert played.turns == [2] and played.truncated == [None]
    assert played.tool_calls == [1] and played.tool_errors == [0]
    assert json.loads(json.dumps(host.tool_schemas))[0]["function"]["name"] == "add"
