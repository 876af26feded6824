"""Config errors and issues, and the "did you mean" wording they share.

Example::

    >>> issue = ConfigIssue("optimizer.lrr", "unknown argument; did you mean 'lr'?")
    >>> str(issue)
    "optimizer.lrr: unknown argument; did you mean 'lr'?"
    >>> print(ConfigError.from_issues([issue, ConfigIssue("model", "value is missing")]))
    optimizer.lrr: unknown argument; did you mean 'lr'?
    model: value is missing
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "did_you_mean",
    "join_path",
    "override_hint",
    "qualify_hints",
    "type_name",
]

ROOT_NAME = "<root>"


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: the dotted path of the node and what is wrong there."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or ROOT_NAME}: {self.message}"


class ConfigError(Exception):
    """A config could not be loaded, overridden, validated or instantiated.

    The message is one line naming the file and/or dotted path (``path: message``), except
    for :meth:`from_issues`, which puts one issue per line. ``issues`` holds the issues an
    error was built from (empty for a single plain error).
    """

    def __init__(
        self, message: str, *, path: str | None = None, issues: Sequence[ConfigIssue] = ()
    ) -> None:
        self.path = path
        self.message = message
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        super().__init__(f"{path or ROOT_NAME}: {message}" if path is not None else message)

    @classmethod
    def from_issues(cls, issues: Iterable[ConfigIssue], header: str | None = None) -> ConfigError:
        """One error listing every issue, one per line (after an optional header line)."""
        issues = list(issues)
        if not issues:
            raise ValueError("ConfigError.from_issues needs at least one issue")
        lines = ([header] if header else []) + [str(issue) for issue in issues]
        return cls("\n".join(lines), issues=issues)


def join_path(path: str, key: object) -> str:
    """``join_path("optimizer", "lr") == "optimizer.lr"``; ``join_path("", "lr") == "lr"``."""
    return f"{path}.{key}" if path else str(key)


def override_hint(argument: str, value: object) -> str:
    """A hint, in an error a component raises, naming the value of its own ``argument`` that
    fixes it, as Python writes it (what a caller of the component types). When the component
    is built from a config, :func:`qualify_hints` rewrites it as the override a config and
    the command line take (``prompts.answer_column=null``).

    >>> override_hint("answer_column", None)
    '`answer_column=None`'
    """
    return f"`{argument}={value!r}`"


_HINT = re.compile(r"`([A-Za-z_]\w*)=([^`]*)`")


def qualify_hints(message: str, path: str, arguments: Collection[str]) -> str:
    """``message`` with each :func:`override_hint` of one of ``arguments`` (the parameters
    of the component at ``path``) written as the override of the command line: the full
    dotted key, the value as YAML writes it, a mapping one key at a time.

    >>> qualify_hints("set `answer_column=None`", "prompts", ["answer_column"])
    'set `prompts.answer_column=null`'
    >>> qualify_hints("set `column_map={'text': '<column>'}`", "dataset", ["column_map"])
    'set `dataset.column_map.text=<column>`'
    """

    def full(match: re.Match[str]) -> str:
        name, text = match.groups()
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return match.group(0)
        if not path or name not in arguments:
            return match.group(0)
        return " ".join(f"`{item}`" for item in _overrides(f"{path}.{name}", value))

    return _HINT.sub(full, message)


def _overrides(key: str, value: object) -> list[str]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _overrides(f"{key}.{k}", v)]
    if value is None or isinstance(value, bool):
        return [f"{key}={str(value).lower() if value is not None else 'null'}"]
    return [f"{key}={value}"]


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (case-insensitive), or None when none is close."""
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        by_lower.setdefault(str(candidate).lower(), str(candidate))
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest candidate, or ``""``."""
    best = did_you_mean(name, candidates)
    return f"; did you mean '{best}'?" if best is not None else ""


def type_name(value: object) -> str:
    """A user-facing type name: ``"list"`` / ``"mapping"`` for config containers too."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return "list"
    if isinstance(value, dict) or type(value).__name__ == "DictConfig":
        return "mapping"
    return type(value).__name__
