"""What a tool is: a name, a JSON schema for the chat template, and a call that returns text.

A tool is any object with ``name``, ``schema`` (a dict in the form ``transformers``'
``get_json_schema`` returns, which chat templates render from their ``tools`` argument) and
``__call__(**arguments) -> str``. It raises :class:`ToolError` for a call the model got wrong
(bad arguments, an expression outside the grammar, code that failed); the environment returns
the message to the model as an error observation and counts it.

Example::

    >>> schema = function_schema("echo", "Repeat a text.", {"text": {"type": "string"}})
    >>> schema["function"]["parameters"]
    {'type': 'object', 'properties': {'text': {'type': 'string'}}, 'required': ['text']}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["Tool", "ToolError", "check_arguments", "function_schema"]


class ToolError(Exception):
    """A call the model got wrong; its message is what the model reads.

    Example::

        >>> str(ToolError("division by zero"))
        'division by zero'
    """


@runtime_checkable
class Tool(Protocol):
    """A tool (see the module docs).

    Example::

        >>> class Echo:
        ...     name = "echo"
        ...     schema = function_schema("echo", "Repeat.", {"text": {"type": "string"}})
        ...     def __call__(self, text): return text
        >>> isinstance(Echo(), Tool)
        True
    """

    name: str
    schema: dict[str, Any]

    def __call__(self, **arguments: Any) -> str: ...


def function_schema(
    name: str,
    description: str,
    properties: Mapping[str, Mapping[str, Any]],
    required: list[str] | None = None,
) -> dict[str, Any]:
    """A function's JSON schema as ``transformers.utils.get_json_schema`` builds it (every
    property required unless ``required`` says otherwise).

    Example::

        >>> function_schema("clock", "The time.", {})["function"]["name"]
        'clock'
    """
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: dict(value) for key, value in properties.items()},
                "required": list(properties) if required is None else list(required),
            },
        },
    }


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Raise :class:`ToolError` naming what is wrong when ``arguments`` do not fit ``schema``
    (required keys, unknown keys, JSON types of the top-level properties).

    Example::

        >>> check_arguments(function_schema("f", "", {"n": {"type": "integer"}}), {"n": "2"})
        Traceback (most recent call last):
        ...
        tunesmith.rl.envs.tool.ToolError: f: argument 'n' must be integer, got str
    """
    function = schema["function"]
    name, parameters = function["name"], function["parameters"]
    properties = parameters.get("properties", {})
    missing = [key for key in parameters.get("required", []) if key not in arguments]
    if missing:
        raise ToolError(f"{name}: missing argument(s) {missing}")
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        raise ToolError(f"{name}: unknown argument(s) {unknown}; it takes {sorted(properties)}")
    for key, value in arguments.items():
        kind = properties[key].get("type")
        types = _JSON_TYPES.get(kind)
        is_bool = isinstance(value, bool) and kind in ("integer", "number")
        if types is not None and (not isinstance(value, types) or is_bool):
            raise ToolError(f"{name}: argument {key!r} must be {kind}, got {type(value).__name__}")
