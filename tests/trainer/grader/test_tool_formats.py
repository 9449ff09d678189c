"""Tool calls in each common format, on tiny tokenizers built here that carry each family's REAL
chat template (tests/trainer/grader/data/templates, where each came from is in its README.md): the
format is read from the template, a reply written the family's way is parsed into the right
calls by the sandboxed worker, and the tools' results are rendered back with that template as
the episode's next turn. A template with no tool format grpo-run reads is refused with why."""

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_run.trainer.envs.catalog import ANSWER_AFTER_TOOLS
from grpo_run.trainer.episodes.host import EnvironmentHost
from grpo_run.trainer.episodes.loop import run_episodes
from grpo_run.trainer.episodes.tokens import ToolFormatUnknown, TurnRenderer, tool_format_of
from grpo_run.trainer.grader.tools import template_tool_format, tool_calls
from grpo_run.trainer.model.prompts import PromptEncoder

TEMPLATES = Path(__file__).parent / "data" / "templates"
ADD = {"name": "add", "arguments": {"a": 2, "b": 3}}

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''

# Each family: its template file, its special tokens (as its real tokenizer has them: special, so a
# decode without special tokens drops them), a reply calling add(2, 3) the family's way, and what
# the template renders after that reply for the tool's result "5" (and the next turn's opening).
FAMILIES = {
    "llama-3.1": dict(
        template="llama-3.1-instruct.jinja", format="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>",
        specials=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        reply='{"name": "add", "parameters": {"a": 2, "b": 3}}',
        result='<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
               '<|start_header_id|>assistant<|end_header_id|>\n\n'),
    "llama-3.2": dict(
        template="llama-3.2-instruct.jinja", format="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>",
        specials=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        reply='<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
        result='<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
               '<|start_header_id|>assistant<|end_header_id|>\n\n'),
    "mistral-v0.3": dict(
        template="mistral-7b-instruct-v0.3.jinja", format="mistral", bos="<s>", eos="</s>",
        specials=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        reply='[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]',
        result=' [TOOL_RESULTS] {"call_id": "call00000", "content": 5} [/TOOL_RESULTS] '),
    "hermes-2-pro": dict(
        template="hermes-2-pro-llama-3-8b-tool-use.jinja", format="hermes", bos="<|begin_of_text|>",
        eos="<|im_end|>", specials=["<|im_start|>"],
        reply='<tool_call>\n{"arguments": {"a": 2, "b": 3}, "name": "add"}\n</tool_call>',
        result='\n<|im_start|>tool\n<tool_response>\n{"name": "add", "content": "5"}\n</tool_response> <|im_end|>\n'
               '<|im_start|>assistant\n'),
}


def family_tokenizer(template: str, *, bos: str, eos: str, specials: list[str]):
    """A byte-level BPE tokenizer with the family's special tokens and its real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    pad = "<pad>"
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[pad, bos, eos, *specials], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([template, '{"name": "add", "arguments": {"a": 2, "b": 3}} 2+3? tool call'] * 2,
                             trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=specials, chat_template=template,
                                   padding_side="left", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    spec = FAMILIES[request.param]
    template = (TEMPLATES / spec["template"]).read_text()
    tok = family_tokenizer(template, bos=spec["bos"], eos=spec["eos"], specials=spec["specials"])
    return SimpleNamespace(name=request.param, tok=tok, **spec)


def test_the_format_is_read_from_the_familys_real_template(family):
    assert tool_format_of(family.tok) == family.format


def test_a_reply_in_the_familys_format_is_parsed_from_its_decoded_text(family):
    """The trainer decodes replies without special tokens ([TOOL_CALLS] and <|python_tag|> are
    special): the calls are read from that text all the same."""
    ids = family.tok(family.reply, add_special_tokens=False).input_ids
    text = family.tok.decode(ids, skip_special_tokens=True)
    assert tool_calls(text, family.format) == [ADD]
    assert tool_calls(family.reply, family.format) == [ADD]            # and with the marker kept
    assert tool_calls("The answer is 5.", family.format) == []


def test_the_worker_answers_the_familys_call_and_the_result_is_rendered_with_its_template(family, tmp_path):
    """A whole episode on the family's tokenizer: the sampled call, answered by the sandboxed
    worker reading the family's format, its result rendered by the family's own template as the
    next turn (loss mask 0), then the answer."""
    tok = family.tok
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS))
    end = tok.convert_tokens_to_ids(family.eos)
    reply1 = tok(family.reply, add_special_tokens=False).input_ids + [end]
    reply2 = tok("5", add_special_tokens=False).input_ids + [end]
    replies = [list(reply1), list(reply2)]

    def sample(ids, mask, seeds):
        reply = replies.pop(0)
        return SimpleNamespace(ids=torch.tensor([reply]), mask=torch.ones(1, len(reply), dtype=torch.long),
                               entropy=torch.zeros(1))

    with EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tmp_path}/tools.py:add"],
                         tool_format=tool_format_of(tok)) as host:
        render = TurnRenderer(PromptEncoder(tok, template_kwargs={"tools": host.tool_schemas}), [end])
        played = run_episodes(sample, render, host, [{"prompt": [{"role": "user", "content": "2+3?"}]}], [1],
                              max_turns=4, context=4096, pad_id=tok.pad_token_id)
    first = played.prompt_ids[0][played.prompt_mask[0].bool()].tolist()
    assert "Add two integers" in tok.decode(first)                       # the template rendered the tool
    rest = played.ids[0][played.mask[0].bool()].tolist()
    learnt = played.loss_mask[0][played.mask[0].bool()].tolist()
    between = rest[len(reply1):len(rest) - len(reply2)]
    assert rest[:len(reply1)] == reply1 and rest[len(rest) - len(reply2):] == reply2
    assert tok.decode(between) == family.result
    assert learnt == [1] * len(reply1) + [0] * len(between) + [1] * len(reply2)
    assert played.tool_calls == [1] and played.tool_errors == [0] and played.turns == [2]


def test_llama_and_mistral_calls_and_their_malformed_ones():
    assert tool_calls('{"name": "add", "arguments": {"a": 2, "b": 3}}', "llama3") == [ADD]
    assert tool_calls('{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 1, '
                      '"b": 1}}', "llama3") == [ADD, {"name": "add", "arguments": {"a": 1, "b": 1}}]
    assert tool_calls('{"answer": 5}', "llama3") == []                 # JSON, but no call
    assert tool_calls("The sum is 5.", "llama3") == []
    assert tool_calls('{"name": "add", "parameters": {"a": 2', "llama3")[0].startswith("error: the tool call is "
                                                                                      "not JSON")
    assert tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', "mistral") == [ADD]
    assert tool_calls('[TOOL_CALLS] [{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}]', "mistral") == [ADD]
    assert tool_calls("[TOOL_CALLS] add(2, 3)", "mistral")[0].startswith("error: the tool calls are not one JSON")
    assert tool_calls("[1, 2, 3] are the numbers", "mistral") == []     # no marker, not a list of calls
    # each format reads only its own: a Qwen call is an answer to a Llama model, and the other way
    assert tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>', "llama3") == []
    assert tool_calls('{"name": "add", "arguments": {"a": 2, "b": 3}}', "hermes") == []


def test_a_template_with_no_tool_format_grpo_run_reads_is_refused_with_why():
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other = "{% if tools %}{{ tools | tojson }}Call as <function=NAME>{args}</function>{% endif %}" + plain
    assert template_tool_format(None)[1].startswith("the tokenizer has no chat template")
    assert "does not render tools" in template_tool_format(plain)[1]
    fmt, why = template_tool_format(other)
    assert fmt is None and "in a tool-call format grpo-run does not read" in why
    tok = family_tokenizer(other, bos="<s>", eos="</s>", specials=[])
    with pytest.raises(ToolFormatUnknown, match="read as answers"):
        tool_format_of(tok)
    with pytest.raises(ToolFormatUnknown, match="in a tool-call format grpo-run does not read"):
        TurnRenderer(PromptEncoder(tok, template_kwargs={"tools": [{"type": "function",
                                                                    "function": {"name": "add"}}]}), [0])


def test_the_template_files_are_each_familys_own():
    """The stored templates are the families' published text (see the README beside them), not
    something written to pass: each carries its family's own markers."""
    notes = (TEMPLATES / "README.md").read_text()
    for spec in FAMILIES.values():
        text = (TEMPLATES / spec["template"]).read_text()
        assert spec["template"] in notes
        assert json.dumps(text)                          # plain text
    assert "Environment: ipython" in (TEMPLATES / "llama-3.1-instruct.jinja").read_text()
    assert "[TOOL_CALLS]" in (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()
    assert "You are a function calling AI model" in (TEMPLATES / "hermes-2-pro-llama-3-8b-tool-use.jinja").read_text()


# A tokenizer that declares its response format (transformers' response parsing): a template
# teaching <function_call> JSON, which grpo-run's template reading does not know, declared by the
# tokenizer's response_template; the declaration is what the worker reads.
DECLARED_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as <function_call>{\"name\": ..., \"arguments\": ...}"
    "</function_call>. Functions: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "tool_calls": {"open": "<function_call>", "close": "</function_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function",
                                     "function": {"name": "{content.name}", "arguments": "{content.arguments}"}}},
    },
}


def test_a_tokenizers_declared_response_format_is_the_one_read(tmp_path):
    tok = family_tokenizer(DECLARED_TEMPLATE, bos="<s>", eos="<|im_end|>", specials=["<|im_start|>"])
    with pytest.raises(ToolFormatUnknown, match="in a tool-call format grpo-run does not read"):
        tool_format_of(tok)                                   # the template alone: unknown
    tok.response_template = RESPONSE_TEMPLATE
    fmt = tool_format_of(tok)
    reply = 'Let me add. <function_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</function_call>'
    assert tool_calls(reply, fmt) == [ADD]
    parsed = tok.parse_response(reply, prefix="")             # transformers' own reading agrees
    assert [c["function"] for c in parsed["tool_calls"]] == [ADD]
    assert tool_calls("It is 5.", fmt) == []
    assert tool_calls("<function_call>{oops}</function_call>", fmt)[0].startswith("error: the tool call is not JSON")
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS))
    with EnvironmentHost(ANSWER_AFTER_TOOLS, timeout_s=5, tools=[f"{tmp_path}/tools.py:add"], tool_format=fmt) as host:
        host.reset([{"prompt": "2+3?"}], [1])
        answer, = host.step([0], [reply])
    assert answer.tool_calls == 1 and answer.tool_errors == 0
    assert answer.observation == [{"role": "tool", "name": "add", "content": "5"}]


def test_a_declared_format_the_worker_cannot_read_is_refused_with_why():
    tok = family_tokenizer(DECLARED_TEMPLATE, bos="<s>", eos="<|im_end|>", specials=["<|im_start|>"])
    tok.response_template = {**RESPONSE_TEMPLATE, "fields": {
        "tool_calls": {**RESPONSE_TEMPLATE["fields"]["tool_calls"], "content": "xml-inline"}}}
    with pytest.raises(ToolFormatUnknown, match="reads plain JSON tool calls only"):
        tool_format_of(tok)


def test_a_turn_the_template_refuses_in_its_own_shape_is_rendered_with_the_reply_as_text():
    """Llama 3.1's template raises for two calls in one turn ("This model only supports single
    tool-calls at once!"): the turn is rendered with the reply as the assistant's text instead,
    both results after it, and the episode goes on."""
    spec = FAMILIES["llama-3.1"]
    tok = family_tokenizer((TEMPLATES / spec["template"]).read_text(), bos=spec["bos"], eos=spec["eos"],
                           specials=spec["specials"])
    schema = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                "parameters": {"type": "object", "properties": {}}}}]
    render = TurnRenderer(PromptEncoder(tok, template_kwargs={"tools": schema}), [tok.eos_token_id])
    _, conversation = render.first([{"role": "user", "content": "2+3? and 1+1?"}])
    reply = '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 1, "b": 1}}'
    ids = tok(reply, add_special_tokens=False).input_ids + [tok.eos_token_id]
    added, after = render.observation(conversation, ids, reply, [{"role": "tool", "name": "add", "content": "5"},
                                                                 {"role": "tool", "name": "add", "content": "2"}])
    assert tok.decode(added) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
                                 '<|start_header_id|>ipython<|end_header_id|>\n\n"2"<|eot_id|>'
                                 '<|start_header_id|>assistant<|end_header_id|>\n\n')
    assert after[-3] == {"role": "assistant", "content": reply}
