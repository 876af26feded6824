"""Rules of config values: what a key allows, checked before anything is built.

A :class:`Rule` says what one key allows (type, range or choices); the builders
(:func:`integer`, :func:`number`, :func:`flag`, :func:`choice`, :func:`text`,
:func:`component`) make the common ones. :func:`check_rules` reports every value of a config
that breaks its rule, one ``key: expected ..., got ...`` issue each: ``tunesmith validate``
and every run (before the data is tokenised) run it. Booleans must be YAML booleans
(``true``/``false``; YAML 1.1's ``yes``/``no``/``on``/``off`` load as booleans too), never
strings such as ``"true"``; integers must be ints (``4``, not ``4.0``, ``1e3`` or ``true``);
numbers may be ints or floats, never booleans. The rules of the loop's own keys are in
:mod:`tunesmith.training.settings`.

Example::

    >>> from omegaconf import OmegaConf
    >>> rules = {"max_steps": integer(1, null="epochs decide"), "shuffle": flag()}
    >>> for issue in check_rules(OmegaConf.create({"max_steps": 0, "shuffle": "yes"}), rules):
    ...     print(issue)
    max_steps: expected an int >= 1, or null (epochs decide), got 0
    shuffle: expected true or false, got 'yes' (a string: write true or false, unquoted)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from tunesmith.config import COMPONENT_KEY, ConfigError, ConfigIssue
from tunesmith.config.errors import type_name
from tunesmith.config.nodes import has_key, read_child

__all__ = [
    "Rule",
    "check_rules",
    "choice",
    "component",
    "flag",
    "integer",
    "is_int",
    "number",
    "shown",
    "text",
    "type_name",
]


@dataclass(frozen=True)
class Rule:
    """What one key allows: ``allowed`` in words, ``fits(value)`` whether a value is one of them,
    ``extra(value)`` a further problem of a fitting value (e.g. a device this machine lacks).

    >>> integer(1).problem(0)
    'expected an int >= 1, got 0'
    """

    allowed: str
    fits: Callable[[Any], bool]
    required: bool = False
    extra: Callable[[Any], str | None] | None = None
    nested: bool = False  # an ``extra`` problem ``sub.key: ...`` is reported at ``<key>.sub.key``

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed, or None."""
        if not self.fits(value):
            return f"expected {self.allowed}, got {shown(value)}"
        return self.extra(value) if self.extra is not None else None


def _or_null(allowed: str, null: str | None) -> str:
    return allowed if null is None else f"{allowed}, or null ({null})"


def _nullable(fits: Callable[[Any], bool], null: str | None) -> Callable[[Any], bool]:
    return lambda v: (v is None and null is not None) or (v is not None and fits(v))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int, *, null: str | None = None, required: bool = False) -> Rule:
    """An int >= ``minimum`` (or null, meaning ``null``).

    >>> integer(1, null="no limit").allowed
    'an int >= 1, or null (no limit)'
    """
    fits = _nullable(lambda v: is_int(v) and v >= minimum, null)
    return Rule(_or_null(f"an int >= {minimum}", null), fits, required)


def number(
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    null: str | None = None,
    unit: str = "a number",
) -> Rule:
    """An int or float in the given bounds (never NaN or a bool).

    >>> number(at_least=0, below=1).allowed
    'a number >= 0 and < 1'
    """
    bounds = [f"> {above:g}" if above is not None else "",
              f">= {at_least:g}" if at_least is not None else "",
              f"< {below:g}" if below is not None else "",
              f"<= {at_most:g}" if at_most is not None else ""]  # fmt: skip
    words = f"{unit} {' and '.join(b for b in bounds if b)}".strip()

    def fits(v: Any) -> bool:
        return (
            _is_number(v)
            and not math.isnan(v)
            and (above is None or v > above)
            and (at_least is None or v >= at_least)
            and (below is None or v < below)
            and (at_most is None or v <= at_most)
        )

    return Rule(_or_null(words, null), _nullable(fits, null))


def flag() -> Rule:
    """``true`` or ``false`` (a YAML boolean, not a string)."""
    return Rule("true or false", lambda v: isinstance(v, bool))


def choice(*values: str, null: str | None = None) -> Rule:
    """One of ``values`` (exactly, case included).

    >>> choice("stop", "skip").problem("STOP")
    "expected one of 'stop', 'skip', got 'STOP' (a string)"
    """
    words = "one of " + ", ".join(repr(v) for v in values)
    return Rule(
        _or_null(words, null), _nullable(lambda v: isinstance(v, str) and v in values, null)
    )


def text(*, null: str | None = None, required: bool = False) -> Rule:
    """A non-empty string (a path, a name)."""
    fits = _nullable(lambda v: isinstance(v, str) and v.strip() != "", null)
    return Rule(_or_null("a non-empty string", null), fits, required)


def component(*, null: str | None = None, required: bool = False, many: bool = False) -> Rule:
    """A mapping with a ``_component_`` (``many``: a list of them); its arguments are checked
    by :func:`~tunesmith.config.validate_config`."""
    fits = _all_components if many else _is_component
    words = "a list of mappings with _component_" if many else "a mapping with _component_"
    return Rule(_or_null(words, null), _nullable(fits, null), required)


def _is_component(value: Any) -> bool:
    return type_name(value) == "mapping" and COMPONENT_KEY in value.keys()  # noqa: SIM118


def _all_components(value: Any) -> bool:
    return type_name(value) == "list" and all(_is_component(item) for item in value)


def _bool_text_hint(value: Any) -> str:
    words = {"true", "false", "yes", "no", "on", "off"}
    return ": write true or false, unquoted" if str(value).lower() in words else ""


def shown(value: Any) -> str:
    """A value as the user wrote it: ``0``, ``'abc' (a string)``, ``true (a boolean)``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"{value!r} (a string{_bool_text_hint(value)})"
    return f"a {type_name(value)}"


def check_rules(cfg: DictConfig, rules: Mapping[str, Rule]) -> list[ConfigIssue]:
    """One issue per top-level key of ``cfg`` whose value breaks its rule, and per required
    key that is absent. Keys without a rule are not looked at. A value whose check meets an
    interpolation inside it that does not resolve is reported at that inner value's key, as
    :func:`~tunesmith.config.validate_config` reports it.

    >>> from omegaconf import OmegaConf
    >>> [str(i) for i in check_rules(OmegaConf.create({"seed": "abc"}), {"seed": integer(0)})]
    ["seed: expected an int >= 0, got 'abc' (a string)"]
    """
    issues: list[ConfigIssue] = []
    for key, rule in rules.items():
        if not has_key(cfg, key):
            if rule.required:
                issues.append(ConfigIssue(key, f"required key is missing ({rule.allowed})"))
            continue
        try:
            value = read_child(cfg, key, key)
        except ConfigError as error:  # missing (???) or an interpolation that does not resolve
            issues.append(ConfigIssue(key, error.message))
            continue
        try:
            problem = rule.problem(value)
        except (OmegaConfBaseException, RecursionError) as error:  # a value inside `value`
            line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            inside = ConfigIssue(key, f"a value inside cannot be resolved: {line}")
            issues.append(_unresolved(value, key, set()) or inside)
            continue
        if problem is not None:
            issues.append(_issue(key, problem, rule.nested and rule.fits(value)))
    return issues


def _unresolved(node: Any, path: str, seen: set[int]) -> ConfigIssue | None:
    """The first value inside ``node`` that does not resolve (or is ``???``), at its dotted path,
    as ``validate_config`` reports it; None if every one resolves. Each node is walked once.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"a": [1, "${nowhere}"]})
    >>> str(_unresolved(cfg, "cfg", set()))  # doctest: +ELLIPSIS
    "cfg.a.1: interpolation '${nowhere}' cannot be resolved: ..."
    """
    if not isinstance(node, (DictConfig, ListConfig)) or id(node) in seen:
        return None
    seen.add(id(node))
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):  # noqa: SIM118
        where = f"{path}.{key}"
        try:
            child = read_child(node, key, where)
        except ConfigError as error:
            return ConfigIssue(where, error.message)
        found = _unresolved(child, where, seen)
        if found is not None:
            return found
    return None


def _issue(key: str, problem: str, nested: bool) -> ConfigIssue:
    """The issue of ``problem`` at ``key`` (at ``key.sub`` for a nested ``sub: ...``).

    >>> str(_issue("rollout", "runtime_env.pip: refused", nested=True))
    'rollout.runtime_env.pip: refused'
    """
    sub, sep, rest = problem.partition(": ")
    if nested and sep and sub and " " not in sub:
        return ConfigIssue(f"{key}.{sub}", rest)
    return ConfigIssue(key, problem)
