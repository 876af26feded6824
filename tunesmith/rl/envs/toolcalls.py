"""Tool calls parsed from the policy's text, in the format its chat template renders them.

Each parser turns one assistant reply (decoded with its special tokens kept, without the
end-of-turn token) into a :class:`ParsedTurn`: the text that is not a call, the well-formed
calls, and one error line per malformed call (never an exception):

``"qwen"`` (Qwen2.5, Qwen3: ``tunesmith/data/templates/qwen2_5.jinja``, ``qwen3.jinja``)
    any number of ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks;
    ``arguments`` may also be a JSON string holding the object.
``"llama3"`` (Llama 3.1/3.3: ``llama3.jinja``)
    the whole reply is the call: ``{"name": ..., "parameters": {...}}`` (several separated by
    ``;`` are accepted), optionally after ``<|python_tag|>``; or the built-in-tool form
    ``<|python_tag|>name.call(key="value", ...)`` (keyword arguments that are literals). A
    reply that starts with neither ``{`` nor ``<|python_tag|>`` is a plain answer.
``"plain"`` (any model; the fallback this library defines)
    one call per line: ``CALL name {"key": value, ...}`` (the JSON object may span lines and
    may be left out for no arguments); other lines are the answer.

Example::

    >>> turn = parse_tool_calls(
    ...     'Let me compute.\\n<tool_call>\\n{"name": "calculator", "arguments": '
    ...     '{"expression": "2*3"}}\\n</tool_call>', "qwen")
    >>> turn.content, turn.calls, turn.errors
    ('Let me compute.', [ToolCall(name='calculator', arguments={'expression': '2*3'})], [])
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_CALL_FORMATS",
    "ParsedTurn",
    "ToolCall",
    "parse_llama3",
    "parse_plain",
    "parse_qwen",
    "parse_tool_calls",
    "template_tool_format",
]

_NAME = re.compile(r"[A-Za-z_][\w.\-]*\Z")
_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_PLAIN_CALL = re.compile(r"^[ \t]*CALL[ \t]+(\S+)[ \t]*", re.MULTILINE)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its arguments (a JSON object).

    Example::

        >>> ToolCall("calculator", {"expression": "1+1"}).as_message_call()
        {'type': 'function', 'function': {'name': 'calculator', 'arguments': {'expression': '1+1'}}}
    """

    name: str
    arguments: dict[str, Any]

    def as_message_call(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI/transformers form)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """One assistant reply, parsed.

    Attributes:
        content: the reply without its calls (stripped).
        attempts: every attempted call in the order written: a :class:`ToolCall` when
            well-formed, else a line saying what is wrong (for the error observation).

    Example::

        >>> turn = ParsedTurn("", [ToolCall("f", {}), "tool call 2: not JSON"])
        >>> turn.calls, turn.errors, ParsedTurn("4").is_final
        ([ToolCall(name='f', arguments={})], ['tool call 2: not JSON'], True)
    """

    content: str
    attempts: list[ToolCall | str] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        """The well-formed calls, in order."""
        return [a for a in self.attempts if isinstance(a, ToolCall)]

    @property
    def errors(self) -> list[str]:
        """What is wrong with each malformed call, in order."""
        return [a for a in self.attempts if isinstance(a, str)]

    @property
    def is_final(self) -> bool:
        """No call and no attempted call: the reply is the answer."""
        return not self.attempts

    def as_message(self) -> dict[str, Any]:
        """The reply as a structured assistant message (``tool_calls`` when it made calls).

        Example::

            >>> ParsedTurn("", [ToolCall("f", {})]).as_message()["tool_calls"][0]["function"]
            {'name': 'f', 'arguments': {}}
        """
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [call.as_message_call() for call in self.calls]
        return message


def _call(name: Any, arguments: Any, where: str) -> ToolCall:
    """A checked :class:`ToolCall`, or a ValueError saying what is wrong with it."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: 'name' must be a tool name, got {name!r}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: arguments of {name!r} are not JSON: {exc}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        raise ValueError(f"{where}: arguments of {name!r} must be an object, got {kind}")
    return ToolCall(name, arguments)


def _json_call(text: str, where: str, arguments_key: str) -> ToolCall:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(value, dict) or "name" not in value:
        raise ValueError(f"{where}: expected an object with 'name' and {arguments_key!r}")
    unknown = sorted(set(value) - {"name", arguments_key})
    if unknown:
        raise ValueError(f"{where}: unexpected keys {unknown} (expected 'name', {arguments_key!r})")
    return _call(value["name"], value.get(arguments_key), where)


def _collect(turn: ParsedTurn, make: Callable[[], ToolCall]) -> None:
    try:
        turn.attempts.append(make())
    except ValueError as exc:
        turn.attempts.append(str(exc))


def parse_qwen(text: str) -> ParsedTurn:
    """Qwen2.5/Qwen3 ``<tool_call>`` blocks (see the module docs).

    Example::

        >>> parse_qwen("<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": [1]}\\n</tool_call>").errors
        ["tool call 1: arguments of 'f' must be an object, got list"]
    """
    turn = ParsedTurn("")
    for index, match in enumerate(_QWEN_BLOCK.finditer(text), start=1):
        body = match.group(1).strip()
        _collect(turn, lambda body=body, i=index: _json_call(body, f"tool call {i}", "arguments"))
    rest = _QWEN_BLOCK.sub("", text)
    if "<tool_call>" in rest or "</tool_call>" in rest:
        tag = "<tool_call>" if "<tool_call>" in rest else "</tool_call>"
        turn.attempts.append(f"a {tag} tag is not closed/opened: write <tool_call>JSON</tool_call>")
        rest = rest.replace("<tool_call>", "").replace("</tool_call>", "")
    turn.content = rest.strip()
    return turn


def _llama_json_calls(text: str, turn: ParsedTurn) -> None:
    """One or more ``{"name": ..., "parameters": ...}`` objects separated by ``;``."""
    decoder, position, index = json.JSONDecoder(), 0, 1
    while position < len(text):
        where = f"tool call {index}"
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            turn.attempts.append(f"{where}: not JSON ({exc})")
            return
        _collect(turn, lambda t=text[position:end], w=where: _json_call(t, w, "parameters"))
        position, index = end, index + 1
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1


def _builtin_call(text: str) -> ToolCall:
    """``name.call(key="value", ...)``: parsed with :mod:`ast`, literal arguments only."""
    where = "tool call 1"
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"{where}: not name.call(key=value, ...) ({exc.msg})") from None
    ok = (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "call"
        and isinstance(node.func.value, ast.Name)
        and not node.args
        and all(keyword.arg for keyword in node.keywords)
    )
    if not ok:
        raise ValueError(f"{where}: not name.call(key=value, ...)")
    arguments = {}
    for keyword in node.keywords:
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            raise ValueError(f"{where}: argument {keyword.arg!r} is not a literal") from None
    return _call(node.func.value.id, arguments, where)


def parse_llama3(text: str) -> ParsedTurn:
    """Llama 3.1 JSON calls and the ``<|python_tag|>`` forms (see the module docs).

    Example::

        >>> parse_llama3('<|python_tag|>search.call(query="BM25")').calls
        [ToolCall(name='search', arguments={'query': 'BM25'})]
    """
    stripped = text.strip()
    tagged = stripped.startswith(_PYTHON_TAG)
    body = stripped.removeprefix(_PYTHON_TAG).strip()
    turn = ParsedTurn("")
    if body.startswith("{"):
        _llama_json_calls(body, turn)
    elif tagged:
        _collect(turn, lambda: _builtin_call(body))
    else:
        turn.content = stripped
    return turn


def parse_plain(text: str) -> ParsedTurn:
    """``CALL name {json}`` lines (see the module docs).

    Example::

        >>> turn = parse_plain('Checking.\\nCALL retrieve {"query": "tokenizers"}\\nCALL clock')
        >>> turn.content, [c.name for c in turn.calls]
        ('Checking.', ['retrieve', 'clock'])
    """
    turn, kept, position = ParsedTurn(""), [], 0
    decoder = json.JSONDecoder()
    for index, match in enumerate(_PLAIN_CALL.finditer(text), start=1):
        if match.start() < position:
            continue  # inside the previous call's JSON
        kept.append(text[position : match.start()])
        where, name, end = f"tool call {index}", match.group(1), match.end()
        arguments: Any = None
        if text[end : end + 1] == "{":
            try:
                arguments, end = decoder.raw_decode(text, end)
            except json.JSONDecodeError as exc:
                turn.attempts.append(f"{where}: arguments are not JSON ({exc})")
                end = len(text) if "\n" not in text[end:] else text.index("\n", end)
                position = end
                continue
        trailing = text[end:].split("\n", 1)[0]
        if trailing.strip():
            turn.attempts.append(f"{where}: unexpected text after the call: {trailing.strip()!r}")
        else:
            _collect(turn, lambda n=name, a=arguments, w=where: _call(n, a, w))
        position = end + len(trailing)
    kept.append(text[position:])
    turn.content = "\n".join(line for line in "".join(kept).splitlines() if line.strip()).strip()
    return turn


TOOL_CALL_FORMATS: dict[str, Callable[[str], ParsedTurn]] = {
    "qwen": parse_qwen,
    "llama3": parse_llama3,
    "plain": parse_plain,
}
"""Parser of each tool-call format, by name (what ``ToolEnv(format=...)`` accepts)."""


def parse_tool_calls(text: str, format: str) -> ParsedTurn:
    """Parse ``text`` in ``format`` (one of :data:`TOOL_CALL_FORMATS`).

    Example::

        >>> parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3").calls
        [ToolCall(name='f', arguments={'x': 1})]
    """
    try:
        parser = TOOL_CALL_FORMATS[format]
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {format!r}; choose one of {sorted(TOOL_CALL_FORMATS)}"
        ) from None
    return parser(text)


def template_tool_format(*templates: str) -> str:
    """The tool-call format that chat ``templates`` (a tokenizer's, ``tool_use`` included)
    render calls in: ``qwen`` (``<tool_call>`` blocks), ``llama3`` (``<|python_tag|>`` or an
    ``ipython`` role), else ``plain`` (the fallback, described in the system prompt).

    Example::

        >>> from tunesmith.data.chat_template import load_template
        >>> [template_tool_format(load_template(n)) for n in ("qwen3", "llama3", "gemma")]
        ['qwen', 'llama3', 'plain']
    """
    text = "\n".join(templates)
    if "<tool_call>" in text:
        return "qwen"
    if _PYTHON_TAG in text or "ipython" in text:
        return "llama3"
    return "plain"
