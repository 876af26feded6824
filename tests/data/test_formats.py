"""Row -> conversation converters: every format, column mapping, system prompts, bad rows."""

from __future__ import annotations

import pytest

from tunesmith.data.formats import (
    Conversation,
    PlainText,
    PromptCompletion,
    check_columns,
    check_messages,
    convert_row,
    resolve_columns,
)
from tunesmith.data.report import BadRow, DataError


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def reason_of(row: dict, fmt: str, **kwargs) -> str:
    with pytest.raises(BadRow) as info:
        convert_row(row, fmt, **kwargs)
    return info.value.reason


# ----------------------------------------------------------------------------- formats


def test_messages_format_passes_messages_and_tools_through():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    row = {"messages": [user("hi"), assistant("hello")], "tools": tools}
    conv = convert_row(row, "messages")
    assert conv == Conversation([user("hi"), assistant("hello")], tools)


def test_messages_tools_given_as_json_string_are_parsed():
    row = {"messages": [user("hi"), assistant("yo")], "tools": '[{"type": "function"}]'}
    assert convert_row(row, "messages").tools == [{"type": "function"}]


def test_messages_with_column_map_and_system_prompt():
    row = {"conv": [user("hi"), assistant("hello")]}
    conv = convert_row(row, "messages", {"messages": "conv"}, system_prompt="Be brief.")
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        user("hi"),
        assistant("hello"),
    ]


def test_rows_own_system_message_wins_over_system_prompt():
    own = {"role": "system", "content": "Own."}
    conv = convert_row(
        {"messages": [own, user("a"), assistant("b")]}, "messages", system_prompt="X"
    )
    assert conv.messages == [own, user("a"), assistant("b")]


def test_none_valued_keys_from_arrow_are_dropped():
    msgs = [
        {"role": "user", "content": "a", "tool_calls": None, "name": None},
        {"role": "assistant", "content": "b", "tool_calls": None, "name": None},
    ]
    assert convert_row({"messages": msgs}, "messages").messages == [user("a"), assistant("b")]


def test_assistant_tool_call_without_content_and_tool_reply_are_accepted():
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    tool = {"role": "tool", "content": "42"}
    msgs = [user("q"), call, tool, assistant("it is 42")]
    assert convert_row({"messages": msgs}, "messages").messages == msgs


def test_sharegpt_roles_system_column_and_column_map():
    row = {
        "chat": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "user", "value": "again"},
            {"from": "assistant", "value": "sure"},
        ],
        "sys": "You help.",
    }
    conv = convert_row(row, "sharegpt", {"conversations": "chat", "system": "sys"})
    assert conv.messages == [
        {"role": "system", "content": "You help."},
        user("hi"),
        assistant("hello"),
        user("again"),
        assistant("sure"),
    ]


def test_sharegpt_tool_roles():
    row = {
        "conversations": [
            {"from": "human", "value": "2+2?"},
            {"from": "function_call", "value": '{"name": "add"}'},
            {"from": "observation", "value": "4"},
            {"from": "gpt", "value": "4"},
        ]
    }
    roles = [m["role"] for m in convert_row(row, "sharegpt").messages]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_alpaca_with_and_without_input_and_system_prompt():
    plain = convert_row({"instruction": "Add 2 and 2.", "output": "4"}, "alpaca")
    assert plain.messages == [user("Add 2 and 2."), assistant("4")]
    empty_input = convert_row({"instruction": "Hi", "input": "", "output": "Yo"}, "alpaca")
    assert empty_input.messages == [user("Hi"), assistant("Yo")]
    full = convert_row(
        {"q": "Translate.", "ctx": "chat", "a": "cat"},
        "alpaca",
        {"instruction": "q", "input": "ctx", "output": "a"},
        system_prompt="S",
    )
    assert full.messages == [
        {"role": "system", "content": "S"},
        user("Translate.\n\nchat"),
        assistant("cat"),
    ]


def test_prompt_completion_templated_and_raw():
    row = {"p": "1+1=", "c": "2"}
    cmap = {"prompt": "p", "completion": "c"}
    assert convert_row(row, "prompt_completion", cmap).messages == [user("1+1="), assistant("2")]
    raw = convert_row(row, "prompt_completion", cmap, use_chat_template=False)
    assert raw == PromptCompletion("1+1=", "2")


def test_text_format():
    assert convert_row({"body": "once upon"}, "text", {"text": "body"}) == PlainText("once upon")


def test_resolve_columns_rejects_unknown_fields_and_formats():
    with pytest.raises(ValueError, match="'answer'"):
        resolve_columns("alpaca", {"answer": "output"})
    with pytest.raises(ValueError, match="unknown dataset format 'chatml'"):
        resolve_columns("chatml")


def test_check_columns_names_missing_column_and_available_ones():
    cols = resolve_columns("alpaca", {"output": "answer"})
    with pytest.raises(DataError, match=r"f\.jsonl: .*'answer' \(for field 'output'\).*'response'"):
        check_columns("alpaca", cols, ["instruction", "response"], "f.jsonl")
    check_columns("alpaca", cols, ["instruction", "answer"], "f.jsonl")  # no error


# ----------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"instruction": "x"}, "alpaca", "missing_field"),
        ({"instruction": None, "output": "y"}, "alpaca", "missing_field"),
        ({"instruction": 3, "output": "y"}, "alpaca", "wrong_type"),
        ({"instruction": "x", "output": "  "}, "alpaca", "empty_assistant_turn"),
        ({"prompt": "x", "completion": ""}, "prompt_completion", "empty_assistant_turn"),
        ({"text": " \n"}, "text", "empty_text"),
        ({"text": ["a"]}, "text", "wrong_type"),
        ({"messages": "hi"}, "messages", "wrong_type"),
        ({"messages": [user("a"), 7]}, "messages", "wrong_type"),
        ({"messages": [user("a"), {"role": "assistant", "content": 5}]}, "messages", "wrong_type"),
        ({"messages": [user("a"), {"content": "b"}]}, "messages", "missing_field"),
        ({"messages": [user("a"), {"role": "assistant"}]}, "messages", "missing_field"),
        ({"messages": [user("a"), {"role": "bot", "content": "b"}]}, "messages", "unknown_role"),
        ({"messages": [user("a"), assistant("")]}, "messages", "empty_assistant_turn"),
        ({"messages": [user("a")]}, "messages", "no_assistant_turn"),
        ({"messages": []}, "messages", "no_assistant_turn"),
        ({"messages": [assistant("a"), user("b")]}, "messages", "roles_out_of_order"),
        ({"messages": [user("a"), user("b"), assistant("c")]}, "messages", "roles_out_of_order"),
        (
            {"messages": [user("a"), assistant("b"), assistant("c")]},
            "messages",
            "roles_out_of_order",
        ),
        (
            {"messages": [user("a"), {"role": "tool", "content": "1"}, assistant("c")]},
            "messages",
            "roles_out_of_order",
        ),
        (
            {"messages": [user("a"), assistant("b"), {"role": "system", "content": "s"}]},
            "messages",
            "roles_out_of_order",
        ),
        ({"messages": [user("a"), assistant("b")], "tools": "{not json"}, "messages", "wrong_type"),
        ({"conversations": [{"from": "human"}]}, "sharegpt", "missing_field"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", "unknown_role"),
        ({"conversations": [{"from": "gpt", "value": "x"}]}, "sharegpt", "roles_out_of_order"),
    ],
)
def test_bad_rows_raise_with_reason(row, fmt, reason):
    assert reason_of(row, fmt) == reason


def test_bad_row_detail_names_the_message():
    with pytest.raises(BadRow, match=r"messages\[1\]\.content is int, expected str"):
        check_messages([user("a"), {"role": "assistant", "content": 5}])
    with pytest.raises(BadRow, match=r"messages\[1\] is 'user' after 'user'"):
        check_messages([user("a"), user("b"), assistant("c")])


def test_row_that_is_not_an_object_is_wrong_type():
    with pytest.raises(BadRow, match="row is list"):
        convert_row([1, 2], "text")  # type: ignore[arg-type]
