"""Tool calls parsed out of a chat answer, whole or streamed, and the chat template check they rely on."""

from __future__ import annotations

import json

import pytest
import xgrammar

from finetune.datasets.rendering import renders_tools
from server.engines.grammar import GrammarCompiler, OutputGrammar
from server.services.tool_calls import ParsedDelta, ToolCallParser, parse_tool_calls
from zaya_model.pretrain.tokenizer import train_tokenizer

FIRST = (
    '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "CASE-1", "note": "a } and a \\" inside"}}\n'
    "</tool_call>"
)
SECOND = '<tool_call>\n{"name": "close_case", "arguments": {"ids": [1, [2]], "why": {}}}\n</tool_call>'
ANSWER = f"Looking both up.\n{FIRST}\n{SECOND}"


def streamed(text: str, size: int) -> tuple[ParsedDelta, list[ParsedDelta], ToolCallParser]:
    parser, deltas = ToolCallParser(), []
    for start in range(0, len(text), size):
        deltas.append(parser.feed(text[start : start + size]))
    deltas.append(parser.finish())
    whole = ParsedDelta()
    for delta in deltas:
        whole.add(delta)
    return whole, deltas, parser


def test_calls_are_split_from_the_text_with_their_arguments_as_json_text():
    content, calls, complete = parse_tool_calls(ANSWER)
    assert content == "Looking both up." and complete
    assert [call.name for call in calls] == ["lookup_case", "close_case"]
    assert json.loads(calls[0].arguments) == {"case_id": "CASE-1", "note": 'a } and a " inside'}
    assert json.loads(calls[1].arguments) == {"ids": [1, [2]], "why": {}}
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_in_any_pieces_it_gives_the_whole_answer_and_names_each_call_first(size):
    whole, deltas, parser = streamed(ANSWER, size)
    content, calls, _ = parse_tool_calls(ANSWER)
    assert whole.content == content
    assert [(call.index, call.name, call.arguments) for call in whole.tool_calls] == [
        (index, call.name, call.arguments) for index, call in enumerate(calls)
    ]
    firsts = {}
    for delta in deltas:
        for call in delta.tool_calls:
            firsts.setdefault(call.index, call)
            assert (call.id is not None) == (call is firsts[call.index])  # id and name only in a call's first piece
    assert [firsts[index].name for index in (0, 1)] == ["lookup_case", "close_case"]
    assert parser.completed == 2


@pytest.mark.parametrize(
    "text",
    [
        "A plain answer.\n\n  ",
        "  leading space, a < b, <tool and <tool_cal in text\n",
        "",
        "ends on a partial tag <tool_",
    ],
)
def test_text_without_calls_comes_back_unchanged(text):
    for size in (1, 4, 1000):
        whole, _, parser = streamed(text, size)
        assert whole.content == text and whole.tool_calls == [] and parser.calls == []


def test_text_between_and_after_calls_is_kept_without_the_formats_whitespace():
    content, calls, _ = parse_tool_calls(f"{FIRST}\n\nThen this.\n{SECOND}\nDone.")
    assert content == "Then this.Done." and len(calls) == 2


def test_an_answer_cut_inside_a_call_keeps_the_call_as_far_as_it_went():
    cut = FIRST[: FIRST.index("CASE-1") + 4]
    content, calls, complete = parse_tool_calls("Text " + cut)
    assert content == "Text" and not complete
    assert calls[0].name == "lookup_case" and calls[0].arguments == '{"case_id": "CASE'

    head = '<tool_call>\n{"name": "look'
    assert parse_tool_calls(head) == (head, [], True)  # no name yet: the text as generated


def test_a_block_that_is_not_a_call_stays_text():
    block = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(f"x {block} y") == (f"x{block} y", [], True)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"case {i} lookup escalate close" for i in range(50)], vocab_size=300)


def test_our_template_speaks_the_format_and_plain_chatml_does_not(tokenizer):
    assert renders_tools(tokenizer)
    tokenizer_without = train_tokenizer(["x y z"] * 10, vocab_size=270)
    tokenizer_without.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + "
        "'<|im_end|>\\n' }}{% endfor %}"
    )
    assert not renders_tools(tokenizer_without)


def test_a_call_as_the_template_renders_it_is_what_the_tool_grammar_decodes(tokenizer):
    """Rendered history and constrained decoding agree: the template's rendering of a call is accepted by the
    grammar of a forced call, and parsed back to the same call."""
    tool = {
        "type": "function",
        "function": {"name": "lookup_case", "parameters": {"type": "object", "properties": {"case_id": {}}}},
    }
    call = {"type": "function", "function": {"name": "lookup_case", "arguments": {"case_id": "CASE-1"}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    prompt = tokenizer.apply_chat_template(messages[:1], tools=[tool], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False)
    answer = rendered[len(prompt) :].removesuffix("<|im_end|>\n")

    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [stop])
    for choice in ({"type": "function", "function": {"name": "lookup_case"}}, "required", "auto"):
        grammar = OutputGrammar.tool_calls([tool], choice, parallel=False)
        matcher = xgrammar.GrammarMatcher(compiler.compile(grammar))
        assert matcher.accept_string(answer) and matcher.accept_token(stop), choice

    content, [parsed], complete = parse_tool_calls(answer)
    assert content == "" and complete and parsed.name == "lookup_case"
    assert json.loads(parsed.arguments) == {"case_id": "CASE-1"}
