"""``Unavailable``: a tool that is named and described like another but answers every call
with an error, for the control run of an ablation ("the same run without the tool").

The policy sees the same prompt and may call the same name with the same arguments; it only
never gets a result. ``tunesmith demo agent`` trains its control with it in place of the
calculator.

Example::

    >>> from tunesmith.rl.envs.calculator import Calculator
    >>> tool = Unavailable(Calculator.schema)
    >>> tool.name, tool.schema == Calculator.schema
    ('calculator', True)
    >>> tool(expression="2*3")
    Traceback (most recent call last):
    ...
    tunesmith.rl.envs.tool.ToolError: calculator: not available
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from tunesmith.config.registry import component
from tunesmith.rl.envs.calculator import Calculator
from tunesmith.rl.envs.tool import ToolError

__all__ = ["Unavailable"]


@component
class Unavailable:
    """A tool with ``schema``'s name and arguments whose every call is a
    :class:`~tunesmith.rl.envs.tool.ToolError` (``"<name>: not available"``).

    Args:
        schema: the schema of the tool it stands in for (default: the calculator's).

    Example (YAML, in a ``ToolEnv``'s ``tools``)::

        tools:
          - {_component_: tunesmith.rl.envs.Unavailable}   # the calculator, switched off
    """

    def __init__(self, schema: Mapping[str, Any] | None = None) -> None:
        self.schema = copy.deepcopy(dict(schema if schema is not None else Calculator.schema))
        try:
            self.name = str(self.schema["function"]["name"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"Unavailable: schema has no function name ({e!r})") from e

    def __call__(self, **arguments: Any) -> str:
        raise ToolError(f"{self.name}: not available")
