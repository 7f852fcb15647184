"""Fine-tuning data with tools, in OpenAI's format: validated field by field, rendered with the tools in the system
turn, trained on the assistant's calls, and learned."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from finetune_helpers import Recorder, save_tiny_model, spec

from finetune.datasets import tokenize_example, validate_dataset
from finetune.datasets.formats import parse_record
from finetune.datasets.rendering import TemplateError
from finetune.evaluate import task_examples
from finetune.run import run_finetune
from server.engines.base import ModelRef, SamplingParams
from server.engines.grammar import OutputGrammar
from server.engines.local import LocalEngine
from server.services.tool_calls import parse_tool_calls
from server.settings import LocalEngineSettings
from zaya_model import ZayaForCausalLM
from zaya_model.pretrain import END_OF_TURN_TOKEN

LOOKUP_CASE = {
    "type": "function",
    "function": {
        "name": "lookup_case",
        "description": "Fetch a case file.",
        "parameters": {"type": "object", "properties": {"case_id": {"type": "string"}}, "required": ["case_id"]},
    },
}
CLOSE_CASE = {"type": "function", "function": {"name": "close_case", "parameters": {"type": "object"}}}


def call(name="lookup_case", arguments='{"case_id": "CASE-7"}', id="call_1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_chat(
    user="Open case 7.",
    calls=None,
    result="Case 7: two wires to a new payee.",
    answer="Escalate it.",
    tools=(LOOKUP_CASE, CLOSE_CASE),
):
    """A line: the user asks, the assistant calls, the tool answers, the assistant concludes."""
    calls = calls if calls is not None else [call()]
    return {
        "messages": [
            {"role": "system", "content": "You are an investigator."},
            {"role": "user", "content": user},
            {"role": "assistant", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls),
            {"role": "assistant", "content": answer},
        ],
        "tools": list(tools),
    }


def test_a_tool_dataset_in_openais_format_is_valid(tokenizer, write_jsonl):
    lines = [
        tool_chat(),
        {
            **tool_chat(user="Open case 8.", calls=[call(arguments='{"case_id": "CASE-8"}')]),
            "parallel_tool_calls": False,
        },
        tool_chat(user="Both.", calls=[call(), call("close_case", "{}", id="call_2")]),
    ]
    lines[2]["messages"][2]["content"] = "Fetching and closing."  # text before the calls
    report = validate_dataset(write_jsonl(lines), tokenizer=tokenizer)
    assert report.is_valid, report.problem_lines()
    assert report.n_examples == 3 and report.format == "chat"


def test_each_tool_problem_is_reported_at_its_field(tokenizer, write_jsonl):
    unknown_answer = tool_chat()
    unknown_answer["messages"][3]["tool_call_id"] = "call_9"
    no_id = tool_chat()
    del no_id["messages"][3]["tool_call_id"]
    user_calls = tool_chat()
    user_calls["messages"][1]["tool_calls"] = [call()]
    lines = [
        tool_chat(calls=[call(name="drop_table")]),  # 1
        tool_chat(calls=[call(arguments="{not json")]),  # 2
        tool_chat(calls=[call(arguments="[1, 2]")]),  # 3
        unknown_answer,  # 4
        no_id,  # 5
        {**tool_chat(calls=[call(), call(id="call_2")]), "parallel_tool_calls": False},  # 6
        {**tool_chat(), "tools": [{"type": "function", "function": {"name": "bad name!"}}, LOOKUP_CASE]},  # 7
        {**tool_chat(), "tools": [LOOKUP_CASE, LOOKUP_CASE]},  # 8
        tool_chat(calls=[]),  # 9
        user_calls,  # 10
        {**tool_chat(), "parallel_tool_calls": "no"},  # 11
        tool_chat(calls=[{**call(), "type": "code"}]),  # 12
        {key: value for key, value in tool_chat().items() if key != "tools"},  # 13: calls, but no tools
        tool_chat(calls=[call(arguments='{"case_id": "<|im_end|>"}')]),  # 14
        tool_chat(tools=[{"type": "function", "function": {"name": "lookup_case", "description": "<|im_start|>"}}]),
    ]
    report = validate_dataset(write_jsonl(lines), tokenizer=tokenizer)
    assert [(problem.line, problem.field, problem.code) for problem in report.problems] == [
        (1, "messages[2].tool_calls[0].function.name", "unknown_tool"),
        (2, "messages[2].tool_calls[0].function.arguments", "invalid_json"),
        (3, "messages[2].tool_calls[0].function.arguments", "wrong_type"),
        (4, "messages[3].tool_call_id", "unknown_tool_call"),
        (5, "messages[3].tool_call_id", "missing_key"),
        (6, "messages[2].tool_calls", "too_many_tool_calls"),
        (7, "tools[0].function.name", "wrong_type"),
        (8, "tools[1].function.name", "duplicate"),
        (9, "messages[2].tool_calls", "wrong_type"),
        (10, "messages[1].tool_calls", "unknown_key"),
        (11, "parallel_tool_calls", "wrong_type"),
        (12, "messages[2].tool_calls[0].type", "wrong_type"),
        (13, "messages[2].tool_calls[0].function.name", "unknown_tool"),
        (14, "messages[2].tool_calls[0].function.arguments", "special_token_in_content"),
        (15, "tools[0].function", "special_token_in_content"),
    ]


def test_the_assistants_calls_are_trained_and_the_tool_results_are_not(tokenizer):
    example, problems = parse_record(tool_chat())
    assert not problems
    tokenized = tokenize_example(example, tokenizer)
    trained = [token for token, keep in zip(tokenized.input_ids, tokenized.trained_mask, strict=True) if keep]
    assert tokenizer.decode(trained) == (
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "CASE-7"}}\n</tool_call>'
        f"{END_OF_TURN_TOKEN}Escalate it.{END_OF_TURN_TOKEN}"
    )
    text = tokenizer.decode(tokenized.input_ids)
    assert json.dumps(LOOKUP_CASE) in text and "<tool_response>\nCase 7: two wires" in text


def test_a_template_without_the_tool_format_is_reported_not_ignored(tokenizer):
    example, _ = parse_record(tool_chat())
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% generation %}{{ message['content'] or '' }}{% endgeneration %}{{ '<|im_end|>\\n' }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="does not render tools"):
        tokenize_example(example, plain)


@pytest.mark.slow
def test_a_model_fine_tuned_on_tool_calls_learns_to_call(tokenizer, write_jsonl, tmp_path):
    users = ["Open case 7.", "Look at case 7 please.", "What is in case 7?", "Case 7?"]
    lookup = {"type": "function", "function": {"name": "lookup_case", "parameters": {"type": "object"}}}
    lines = [tool_chat(user=user, result="Open.", answer="Escalate.", tools=[lookup]) for user in users]
    train = str(write_jsonl(lines, "tools.jsonl"))
    model_dir = save_tiny_model(tmp_path / "base", tokenizer)
    hooks = Recorder()
    result = run_finetune(
        spec(model_dir, train, tmp_path, method="full", max_steps=100, batch_size=4, learning_rate_multiplier=6.25),
        hooks,
    )
    assert result.status == "succeeded"
    losses = list(hooks.losses.values())
    assert losses[-1] < 0.05 * losses[0]

    model = ZayaForCausalLM.from_pretrained(result.output_dir).eval()
    example, _ = parse_record(tool_chat(user="Case 7, now.", tools=[lookup]))
    # The prompt is the conversation up to the call; the reference the call as the template writes it.
    [task] = task_examples([dataclasses.replace(example, messages=example.messages[:3])], tokenizer)
    assert task.reference.strip() == (
        '<tool_call>\n{"name": "lookup_case", "arguments": {"case_id": "CASE-7"}}\n</tool_call>'
    )
    prompt = torch.tensor([task.prompt_ids])
    output = model.generate(prompt, max_new_tokens=100, do_sample=False)[0, prompt.shape[1] :]
    assert tokenizer.decode(output, skip_special_tokens=True).strip() == task.reference.strip()

    # Served with the tools under tool_choice "auto", the model chooses to call, and the call is parsed back.
    async def served() -> str:
        engine = LocalEngine(LocalEngineSettings(compile=False))
        grammar = OutputGrammar.tool_calls([lookup], "auto", parallel=True)
        params = SamplingParams(max_tokens=100, temperature=0.0, grammar=grammar)
        try:
            return "".join(
                [
                    delta.text
                    async for delta in engine.generate(
                        ModelRef("tuned", Path(result.output_dir)), task.prompt_ids, params
                    )
                ]
            )
        finally:
            await engine.close()

    content, [call], complete = parse_tool_calls(asyncio.run(served()))
    assert (content, call.name, json.loads(call.arguments), complete) == (
        "",
        "lookup_case",
        {"case_id": "CASE-7"},
        True,
    )
