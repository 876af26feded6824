"""The ``python`` tool: run the model's code in the code sandbox and return what it printed.

Each call is one :func:`~tunesmith.rl.rewards.run_sandboxed` run (the sandbox of
:class:`~tunesmith.rl.rewards.CodeTests`: resource limits, no network, a throw-away folder;
nothing persists between calls). A clean exit returns its standard output (cut to
``max_output_chars``); an exception, a non-zero exit or a kill (timeout, memory, output) is a
:class:`~tunesmith.rl.envs.tool.ToolError` whose message (the end of the traceback, or why it
was killed) the model reads as an error observation.

Example::

    >>> PythonTool(timeout_s=2)(code="print(2 ** 10)")
    '1024\\n'
"""

from __future__ import annotations

import logging

from tunesmith.config.registry import component
from tunesmith.rl.envs.tool import ToolError, function_schema
from tunesmith.rl.rewards.sandbox import (
    BEST_EFFORT_GAPS,
    ISOLATION_MODES,
    SandboxResult,
    resolve_isolation,
    run_sandboxed,
)

__all__ = ["PythonTool"]

logger = logging.getLogger(__name__)


def _cut(text: str, limit: int) -> str:
    """``text`` with at most ``limit`` characters, keeping its end (where errors are)."""
    return (
        text if len(text) <= limit else f"[...{len(text) - limit} characters cut]\n" + text[-limit:]
    )


def _failure(result: SandboxResult, timeout_s: float, limit: int) -> str:
    if result.killed_reason == "wall_timeout":
        return f"python: timed out after {timeout_s:g} s"
    if result.killed_reason is not None:
        return f"python: killed ({result.killed_reason})"
    detail = result.stderr.strip() or f"exit status {result.returncode}"
    return "python: " + _cut(detail, limit)


@component
class PythonTool:
    """The ``python`` tool (see the module docs).

    Args:
        timeout_s: wall-clock limit per call, in seconds.
        memory_mb: address-space limit per call, in MiB.
        isolation: the sandbox's mode (``"auto"``, ``"namespaces"`` or ``"best_effort"``, as
            in :class:`~tunesmith.rl.rewards.CodeTests`).
        max_output_chars: most characters of output (or error) the model reads back.

    Example (YAML)::

        tools:
          - {_component_: tunesmith.rl.envs.PythonTool, timeout_s: 5, memory_mb: 256}
    """

    name = "python"
    schema = function_schema(
        "python",
        "Run a Python program (standard library only, no network, no files kept) and return "
        "what it prints.",
        {"code": {"type": "string", "description": "The program; print the results you need."}},
    )

    def __init__(
        self,
        timeout_s: float = 5,
        memory_mb: int = 256,
        isolation: str = "auto",
        max_output_chars: int = 4000,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"PythonTool: timeout_s must be a positive number, got {timeout_s!r}")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"PythonTool: isolation={isolation!r} is not one of {ISOLATION_MODES}")
        for key, value in (("memory_mb", memory_mb), ("max_output_chars", max_output_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PythonTool: {key} must be a positive int, got {value!r}")
        try:
            self.isolation = resolve_isolation(isolation)
        except RuntimeError as e:
            raise RuntimeError(f"PythonTool: {e}") from None
        if self.isolation == "best_effort":
            logger.warning("PythonTool: %s", BEST_EFFORT_GAPS)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars

    def __call__(self, code: str) -> str:
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python: 'code' must be a non-empty string")
        result = run_sandboxed(
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            isolation=self.isolation,
            max_output_bytes=4 * self.max_output_chars + 1024,
        )
        if not result.ok:
            raise ToolError(_failure(result, self.timeout_s, self.max_output_chars))
        return _cut(result.stdout, self.max_output_chars)
