"""Tool-call parsing (tunesmith.rl.envs.toolcalls): each format well-formed, malformed and with
several calls per turn, and round trips through the shipped chat templates: an assistant
message with ``tool_calls`` rendered by the family's template (by tunesmith and by
transformers' own renderer, which agree), cut where the model's reply would be (after the
generation prompt, before the end-of-turn token), parses back to the same calls."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tunesmith.data.chat_template import load_template, render
from tunesmith.rl.envs import (
    Calculator,
    ParsedTurn,
    Retrieve,
    ToolCall,
    parse_llama3,
    parse_plain,
    parse_qwen,
    parse_tool_calls,
)

CALLS = [
    ToolCall("calculator", {"expression": "123456 * 654321"}),
    ToolCall("retrieve", {"query": 'bm25 "ranking" — Spärck', "top": [1, 2.5, None, True]}),
]
TOOLS = [Calculator.schema, Retrieve.schema]
LLAMA_KWARGS = {"bos_token": "<|begin_of_text|>"}


def _transformers_render(template: str, messages: list, **kwargs) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, **kwargs)
    return rendered[0]


def _reply(template: str, message: dict, end: str, **kwargs) -> str:
    """What the model would have generated for ``message``: the rendered conversation after
    the generation prompt, up to the end-of-turn token (rendered by tunesmith and by
    transformers, which agree)."""
    opening = [{"role": "user", "content": "Compute and look it up."}]
    full = render(template, [*opening, message], tools=TOOLS, **kwargs)
    prompt = render(template, opening, tools=TOOLS, add_generation_prompt=True, **kwargs)
    assert full == _transformers_render(template, [*opening, message], tools=TOOLS, **kwargs)
    assert full.startswith(prompt)
    reply = full[len(prompt) :]
    return reply[: reply.index(end)]


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_qwen_templates_round_trip_several_calls(name: str) -> None:
    message = ParsedTurn("Let me check.", list(CALLS)).as_message()
    reply = _reply(load_template(name), message, "<|im_end|>")
    assert reply.count("<tool_call>") == 2  # the template really rendered both calls
    turn = parse_tool_calls(reply, "qwen")
    assert turn.calls == CALLS and turn.errors == []
    # Qwen3 opens the final turn with an empty think block; the text itself is kept
    assert turn.content.removeprefix("<think>\n\n</think>").strip() == "Let me check."
    assert turn.as_message()["tool_calls"] == message["tool_calls"]


def test_llama3_template_round_trips_a_json_call() -> None:
    message = ParsedTurn("", CALLS[:1]).as_message()
    reply = _reply(load_template("llama3"), message, "<|eot_id|>", **LLAMA_KWARGS)
    assert reply.startswith('{"name": "calculator", "parameters": ')
    turn = parse_tool_calls(reply, "llama3")
    assert turn == ParsedTurn("", CALLS[:1])


def test_llama3_template_round_trips_a_builtin_python_tag_call() -> None:
    call = ToolCall("retrieve", {"query": "bm25 ranking"})
    message = ParsedTurn("", [call]).as_message()
    kwargs = {**LLAMA_KWARGS, "builtin_tools": ["retrieve"]}
    reply = _reply(load_template("llama3"), message, "<|eom_id|>", **kwargs)
    assert reply == '<|python_tag|>retrieve.call(query="bm25 ranking")'
    assert parse_llama3(reply) == ParsedTurn("", [call])


def test_qwen_malformed_calls_are_errors_and_good_ones_survive() -> None:
    text = (
        'Plan.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expr\n</tool_call>'
        '\n<tool_call>{"name": 7, "arguments": {}}</tool_call>'
        '\n<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}", "extra": 1}</tool_call>'
        '\n<tool_call>{"name": "g", "arguments": "{\\"x\\": 2}"}</tool_call>'
        '\n<tool_call>{"name": "h"'
    )
    turn = parse_qwen(text)
    assert turn.calls == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("g", {"x": 2})]
    assert len(turn.errors) == 4, turn.errors
    assert turn.errors[0].startswith("tool call 2: not JSON")
    assert turn.errors[1] == "tool call 3: 'name' must be a tool name, got 7"
    assert turn.errors[2].startswith("tool call 4: unexpected keys ['extra']")
    assert "<tool_call> tag is not closed" in turn.errors[3]
    assert turn.content == 'Plan.\n\n\n\n\n\n{"name": "h"'
    assert not turn.is_final


def test_qwen_plain_answer_is_final() -> None:
    turn = parse_qwen("<think>\nsimple\n</think>\n\nThe answer is 4.")
    assert turn.is_final and turn.content.endswith("The answer is 4.")


def test_llama3_forms() -> None:
    several = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse_llama3(several).calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    tagged = '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}'
    assert parse_llama3(tagged).calls == [ToolCall("a", {"x": [1, 2]})]
    assert parse_llama3("The answer is 42.") == ParsedTurn("The answer is 42.")
    bad = parse_llama3('{"name": "a", "arguments": {}}')  # Llama says "parameters"
    assert bad.calls == [] and bad.errors[0].startswith("tool call 1: unexpected keys")
    broken = parse_llama3('{"name": "a", "parameters": {"x": 1}}; {"name": ')
    assert broken.calls == [ToolCall("a", {"x": 1})] and broken.errors[0].startswith(
        "tool call 2: not JSON"
    )
    for text in (
        "<|python_tag|>retrieve.call(query=open('x'))",
        "<|python_tag|>print(1)",
        "<|python_tag|>retrieve.call('positional')",
        "<|python_tag|>x.call(a==",
    ):
        turn = parse_llama3(text)
        assert turn.calls == [] and len(turn.errors) == 1, (text, turn)


def test_plain_format() -> None:
    text = (
        "I will use two tools.\n"
        'CALL calculator {"expression": "2 ** 64"}\n'
        'CALL retrieve {\n  "query": "multi\\nline"\n}\n'
        "CALL clock\n"
        "CALL broken {not json}\n"
        'CALL trailing {"a": 1} and more\n'
        "Done."
    )
    turn = parse_plain(text)
    assert turn.calls == [
        ToolCall("calculator", {"expression": "2 ** 64"}),
        ToolCall("retrieve", {"query": "multi\nline"}),
        ToolCall("clock", {}),
    ]
    assert [e.split(":")[0] for e in turn.errors] == ["tool call 4", "tool call 5"]
    assert "not JSON" in turn.errors[0] and "unexpected text" in turn.errors[1]
    assert turn.content == "I will use two tools.\nDone."
    assert parse_plain("No calls here; CALL is mid-line.").is_final


def test_unknown_format_is_named() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'hermes'.*llama3"):
        parse_tool_calls("", "hermes")
