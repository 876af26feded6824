"""Turn one dataset row into a conversation (or plain text), checking it on the way.

Formats and the fields they read (``column_map`` renames fields to your columns):

=====================  ===========================================  ========================
format                 required fields                              optional fields
=====================  ===========================================  ========================
``messages``           ``messages`` (OpenAI ``{role, content}``)     ``tools``
``sharegpt``           ``conversations`` (``{from, value}``)         ``system``, ``tools``
``alpaca``             ``instruction``, ``output``                   ``input``, ``system``
``prompt_completion``  ``prompt``, ``completion``                    ``system``
``text``               ``text``                                     --
=====================  ===========================================  ========================

``alpaca`` rows follow ``prompt_style`` (:data:`PROMPT_STYLES`): ``"chat_template"`` (the
default here) makes a user/assistant :class:`Conversation` (instruction, a blank line, then
the input); ``"alpaca"`` and ``"instruction_response"`` render the prompt as text
(:func:`render_prompt`) and give a :class:`PromptCompletion` of that prompt and the output,
tokenised raw (no chat template), so a base model needs no template. A system text (the
row's ``system`` column, else ``system_prompt``) has no slot in these text styles: it is
prepended, followed by a blank line, before the prompt.

Conversations are checked by :func:`check_messages`; any problem raises
:class:`~tunesmith.data.report.BadRow` with a reason code (see ``report.py``), which the
dataset turns into an error or a counted skip.

Role order (what counts as ``roles_out_of_order``): roles are ``system``, ``user``,
``assistant`` and ``tool``. ``system`` may only come first. The first other message is
``user``; a ``user`` is followed by an ``assistant``; an ``assistant`` by a ``user`` or a
``tool``; a ``tool`` by another ``tool`` or an ``assistant``. So two user turns or two
assistant turns in a row, an assistant (or tool) first, or a tool after a user are all
out of order. A conversation may end on any role; it needs at least one assistant turn.

Example::

    >>> row = {"question": "2+2?", "answer": "4"}
    >>> conv = convert_row(row, "alpaca", {"instruction": "question", "output": "answer"})
    >>> conv.messages
    [{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tunesmith.config.errors import override_hint
from tunesmith.data.report import (
    EMPTY_ASSISTANT_TURN,
    EMPTY_TEXT,
    MISSING_FIELD,
    NO_ASSISTANT_TURN,
    ROLES_OUT_OF_ORDER,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    BadRow,
    DataError,
)

__all__ = [
    "FORMATS",
    "FORMAT_FIELDS",
    "PROMPT_STYLES",
    "Format",
    "PromptStyle",
    "SHAREGPT_ROLES",
    "Conversation",
    "PlainText",
    "PromptCompletion",
    "check_columns",
    "check_messages",
    "convert_row",
    "render_prompt",
    "resolve_columns",
]

ROLES = ("system", "user", "assistant", "tool")

# Which role may follow which (None = start of the conversation).
_NEXT_ROLES: dict[str | None, tuple[str, ...]] = {
    None: ("system", "user"),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("tool", "assistant"),
}

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT ``from`` values and the role each one becomes."""

FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("tools",)),
    "sharegpt": (("conversations",), ("system", "tools")),
    "alpaca": (("instruction", "output"), ("input", "system")),
    "prompt_completion": (("prompt", "completion"), ("system",)),
    "text": (("text",), ()),
}
"""format -> (required fields, optional fields)."""

FORMATS = tuple(FORMAT_FIELDS)
Format = Literal[FORMATS]  # type: ignore[valid-type]
"""A dataset's ``format`` (a key of :data:`FORMAT_FIELDS`), as its signature declares it."""

PromptStyle = Literal["chat_template", "alpaca", "instruction_response"]
PROMPT_STYLES: tuple[str, ...] = get_args(PromptStyle)
"""How ``alpaca`` rows become a prompt: through the chat template, or as text."""

# The Stanford Alpaca prompts (https://github.com/tatsu-lab/stanford_alpaca, README and
# ``PROMPT_DICT`` in train.py): a data convention, quoted word for word. train.py's strings
# stop at "### Response:" (the output follows it directly); the README shows the response
# on the next line, as most tools that train and serve Alpaca-style models do, so these end
# with "### Response:\n".
_ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
_PLAIN_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_PLAIN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass
class Conversation:
    """Checked chat messages (and tool schemas) ready for the chat template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class PromptCompletion:
    """A prompt and its completion, tokenised raw (no chat template)."""

    prompt: str
    completion: str


@dataclass
class PlainText:
    """A text trained on in full (continued pre-training style)."""

    text: str


def render_prompt(
    style: str, instruction: str, input: str | None = None, system: str | None = None
) -> str:
    """The text prompt of a text ``style`` (``"alpaca"`` or ``"instruction_response"``).

    ``input`` that is None, empty or only whitespace selects the no-input variant (as the
    Stanford Alpaca code does for an empty input). ``system``, when not empty, comes first,
    followed by a blank line.

    Example::

        >>> render_prompt("instruction_response", "Name a colour.")
        '### Instruction:\\nName a colour.\\n\\n### Response:\\n'
        >>> render_prompt("alpaca", "Add.", "2 and 3").startswith("Below is an instruction")
        True
    """
    templates = {
        "alpaca": (_ALPACA_WITH_INPUT, _ALPACA_NO_INPUT),
        "instruction_response": (_PLAIN_WITH_INPUT, _PLAIN_NO_INPUT),
    }
    if style not in templates:
        raise ValueError(f"render_prompt: style must be one of {tuple(templates)}, got {style!r}")
    with_input, no_input = templates[style]
    if input is not None and input.strip():
        text = with_input.format(instruction=instruction, input=input)
    else:
        text = no_input.format(instruction=instruction)
    return f"{system}\n\n{text}" if system else text


def resolve_columns(
    format: str,
    column_map: Mapping[str, str] | None = None,
    formats: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = FORMAT_FIELDS,
) -> dict[str, str]:
    """Map each field of ``format`` to its column name (the field itself unless renamed).
    ``formats`` is the table of ``format -> (required fields, optional fields)``.

    Example::

        >>> resolve_columns("prompt_completion", {"completion": "answer"})
        {'prompt': 'prompt', 'completion': 'answer', 'system': 'system'}
    """
    if format not in formats:
        raise ValueError(f"unknown dataset format {format!r}; choose one of {tuple(formats)}")
    required, optional = formats[format]
    fields = required + optional
    column_map = dict(column_map or {})
    unknown = sorted(set(column_map) - set(fields))
    if unknown:
        raise ValueError(
            f"column_map has keys {unknown} that format {format!r} does not read; "
            f"its fields are {list(fields)} (map field -> your column name)"
        )
    return {f: str(column_map.get(f, f)) for f in fields}


def check_columns(
    format: str,
    columns: Mapping[str, str],
    available: Sequence[str],
    source: str,
    formats: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = FORMAT_FIELDS,
) -> None:
    """Raise :class:`DataError` if a required column is absent from the whole dataset."""
    required, _ = formats[format]
    missing = [f for f in required if columns[f] not in available]
    if missing:
        names = ", ".join(
            f"{columns[f]!r}" + ("" if columns[f] == f else f" (for field {f!r})") for f in missing
        )
        raise DataError(
            f"{source}: format {format!r} needs column {names}, but the data has columns "
            f"{sorted(available)}; to read it from another column set "
            f"{override_hint('column_map', {missing[0]: '<column>'})}"
        )


def _type_name(value: object) -> str:
    return type(value).__name__


def _field(row: Mapping[str, Any], column: str, required: bool) -> Any:
    value = row.get(column)
    if value is None and required:
        raise BadRow(MISSING_FIELD, f"column {column!r} is missing or null")
    return value


def _string(row: Mapping[str, Any], column: str, required: bool = True) -> str | None:
    value = _field(row, column, required)
    if value is not None and not isinstance(value, str):
        raise BadRow(WRONG_TYPE, f"column {column!r} is {_type_name(value)}, expected str")
    return value


def _tools(row: Mapping[str, Any], column: str) -> list[dict[str, Any]] | None:
    tools = row.get(column)
    if tools is None:
        return None
    if isinstance(tools, str):  # many datasets store the tool schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow(WRONG_TYPE, f"column {column!r} is a string but not JSON: {e}") from e
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise BadRow(WRONG_TYPE, f"column {column!r} must be a list of tool schemas (objects)")
    return [dict(t) for t in tools] or None


def check_messages(messages: object, column: str = "messages") -> list[dict[str, Any]]:
    """Check roles, types, order and content; return clean copies of the messages.

    Keys whose value is ``None`` are dropped (Arrow fills absent keys with ``None``).
    ``content`` must be a string; an assistant message may instead carry ``tool_calls``.

    Example::

        >>> check_messages([{"role": "user", "content": "hi"},
        ...                 {"role": "assistant", "content": "hello", "tool_calls": None}])
        [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise BadRow(
            WRONG_TYPE, f"column {column!r} is {_type_name(messages)}, expected a list of messages"
        )
    out: list[dict[str, Any]] = []
    prev: str | None = None
    for i, message in enumerate(messages):
        where = f"{column}[{i}]"
        if not isinstance(message, Mapping):
            raise BadRow(WRONG_TYPE, f"{where} is {_type_name(message)}, expected an object")
        msg = {k: v for k, v in message.items() if v is not None}
        role = msg.get("role")
        if role is None:
            raise BadRow(MISSING_FIELD, f"{where} has no 'role'")
        if not isinstance(role, str):
            raise BadRow(WRONG_TYPE, f"{where}.role is {_type_name(role)}, expected str")
        if role not in ROLES:
            raise BadRow(UNKNOWN_ROLE, f"{where}.role is {role!r}; known roles are {ROLES}")
        content = msg.get("content")
        has_calls = role == "assistant" and bool(msg.get("tool_calls"))
        if content is None and not has_calls:
            raise BadRow(MISSING_FIELD, f"{where} ({role}) has no 'content'")
        if content is not None and not isinstance(content, str):
            raise BadRow(WRONG_TYPE, f"{where}.content is {_type_name(content)}, expected str")
        if role == "assistant" and not has_calls and not content.strip():
            raise BadRow(EMPTY_ASSISTANT_TURN, f"{where} is an empty assistant turn")
        if role not in _NEXT_ROLES[prev]:
            after = "at the start" if prev is None else f"after {prev!r}"
            raise BadRow(
                ROLES_OUT_OF_ORDER,
                f"{where} is {role!r} {after}; allowed there: {_NEXT_ROLES[prev]}",
            )
        out.append(msg)
        prev = role
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow(NO_ASSISTANT_TURN, f"column {column!r} has no assistant turn")
    return out


def _with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    if system is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _sharegpt_messages(turns: object, column: str) -> list[dict[str, Any]]:
    if not isinstance(turns, Sequence) or isinstance(turns, (str, bytes)):
        raise BadRow(
            WRONG_TYPE, f"column {column!r} is {_type_name(turns)}, expected a list of turns"
        )
    messages = []
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, Mapping):
            raise BadRow(WRONG_TYPE, f"{where} is {_type_name(turn)}, expected an object")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker is None or value is None:
            key = "from" if speaker is None else "value"
            raise BadRow(MISSING_FIELD, f"{where} has no {key!r}")
        if not isinstance(speaker, str):
            raise BadRow(WRONG_TYPE, f"{where}.from is {_type_name(speaker)}, expected str")
        if speaker not in SHAREGPT_ROLES:
            raise BadRow(
                UNKNOWN_ROLE, f"{where}.from is {speaker!r}; known: {sorted(SHAREGPT_ROLES)}"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    return messages


def convert_row(
    row: Mapping[str, Any],
    format: str,
    column_map: Mapping[str, str] | None = None,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    prompt_style: str = "chat_template",
) -> Conversation | PromptCompletion | PlainText:
    """Convert one row to a :class:`Conversation` (or raw text), raising :class:`BadRow`.

    ``system_prompt`` is added as the first message of conversations that have no system
    message of their own (a row's own system message wins). ``prompt_completion`` rows
    become a user/assistant conversation when ``use_chat_template`` is true, else a
    :class:`PromptCompletion`; ``text`` rows become :class:`PlainText`. ``prompt_style``
    (:data:`PROMPT_STYLES`) applies to ``alpaca`` rows only (see the module docs); another
    format with a style other than ``"chat_template"`` is a ``ValueError``.

    Example::

        >>> convert_row({"prompt": "1+1=", "completion": "2"}, "prompt_completion",
        ...             use_chat_template=False)
        PromptCompletion(prompt='1+1=', completion='2')
        >>> convert_row({"instruction": "Say hi.", "output": "Hi."}, "alpaca",
        ...             prompt_style="instruction_response")
        PromptCompletion(prompt='### Instruction:\\nSay hi.\\n\\n### Response:\\n', completion='Hi.')
    """
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    if prompt_style != "chat_template" and format != "alpaca":
        raise ValueError(
            f"prompt_style={prompt_style!r} applies to format 'alpaca' only, not {format!r}; "
            f"set {override_hint('prompt_style', 'chat_template')} (or leave it unset)"
        )
    columns = resolve_columns(format, column_map)
    if not isinstance(row, Mapping):
        raise BadRow(WRONG_TYPE, f"row is {_type_name(row)}, expected an object")
    if format == "text":
        text = _string(row, columns["text"])
        if not text.strip():
            raise BadRow(EMPTY_TEXT, f"column {columns['text']!r} is empty")
        return PlainText(text)
    if format == "prompt_completion":
        prompt = _string(row, columns["prompt"])
        completion = _string(row, columns["completion"])
        if not completion.strip():
            raise BadRow(EMPTY_ASSISTANT_TURN, f"column {columns['completion']!r} is empty")
        if not use_chat_template:
            return PromptCompletion(prompt, completion)
        system = _string(row, columns["system"], required=False) or system_prompt
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return Conversation(check_messages(_with_system(messages, system)))
    if format == "alpaca":
        instruction = _string(row, columns["instruction"])
        extra = _string(row, columns["input"], required=False)
        output = _string(row, columns["output"])
        system = _string(row, columns["system"], required=False) or system_prompt
        if prompt_style != "chat_template":
            if not output.strip():
                raise BadRow(EMPTY_ASSISTANT_TURN, f"column {columns['output']!r} is empty")
            return PromptCompletion(render_prompt(prompt_style, instruction, extra, system), output)
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        return Conversation(check_messages(_with_system(messages, system)))
    if format == "sharegpt":
        turns = _field(row, columns["conversations"], required=True)
        messages = _sharegpt_messages(turns, columns["conversations"])
        system = _string(row, columns["system"], required=False) or system_prompt
        messages = check_messages(_with_system(messages, system), columns["conversations"])
        return Conversation(messages, _tools(row, columns["tools"]))
    # format == "messages"
    messages = _field(row, columns["messages"], required=True)
    messages = check_messages(messages, columns["messages"])
    return Conversation(_with_system(messages, system_prompt), _tools(row, columns["tools"]))
