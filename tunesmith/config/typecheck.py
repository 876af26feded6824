"""Check a config value against a parameter annotation, for the simple annotations only.

Checked: ``int``, ``float``, ``bool``, ``str``, ``None`` and ``Optional``/unions of those,
written as objects or as text (postponed annotations). An int is a fine float; a bool is not
an int. ``Tensor`` members of a union are dropped (a YAML value never is one), so
``lr: float | Tensor`` still rejects ``"abc"``. Anything else is not checked.

Example::

    >>> type_problem(float, "abc")
    "expected float, got str 'abc'"
    >>> type_problem("Optional[int]", None) is None
    True
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig

from tunesmith.config.components import COMPONENT_KEY
from tunesmith.config.errors import type_name
from tunesmith.config.nodes import has_key

__all__ = ["type_problem"]

_NONE = type(None)
_SIMPLE_NAMES: dict[str, type] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "None": _NONE,
    "NoneType": _NONE,
}
_TENSOR_NAMES = {"Tensor", "torch.Tensor"}
_TENSOR = "Tensor"  # marker for a Tensor member of a union


def type_problem(annotation: Any, value: Any) -> str | None:
    """Why ``value`` does not fit ``annotation``, or None when it fits or is not checked."""
    allowed = _simple_types(annotation)
    if not allowed:
        return None
    if isinstance(value, DictConfig) and has_key(value, COMPONENT_KEY):
        return None  # built at runtime: its result type is not known here
    if _fits(value, allowed):
        return None
    expected = " or ".join("None" if t is _NONE else t.__name__ for t in allowed)
    got = type_name(value)
    shown = "" if isinstance(value, (DictConfig, ListConfig)) else f" {value!r}"
    return f"expected {expected}, got {got}{shown}"


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    if value is None:
        return _NONE in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    if isinstance(value, float):
        return float in allowed
    if isinstance(value, str):
        return str in allowed
    return False  # a mapping or list where only scalars are accepted


def _simple_types(annotation: Any) -> tuple[type, ...] | None:
    """The scalar types an annotation allows, or None when it is not a simple one."""
    members = _members(annotation)
    if members is None:
        return None
    simple = tuple(m for m in members if m is not _TENSOR)
    return simple or None


def _members(annotation: Any) -> list[Any] | None:
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        return _members_from_text(annotation)
    if annotation is None or annotation is _NONE:
        return [_NONE]
    if annotation in (int, float, bool, str):
        return [annotation]
    if getattr(annotation, "__name__", None) == "Tensor" and str(
        getattr(annotation, "__module__", "")
    ).startswith("torch"):
        return [_TENSOR]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found: list[Any] = []
        for member in typing.get_args(annotation):
            sub = _members(member)
            if sub is None:
                return None
            found += sub
        return found
    return None


def _members_from_text(text: str) -> list[Any] | None:
    text = text.strip().strip("'\"")
    if text.startswith("Optional[") and text.endswith("]"):
        inner = _members_from_text(text[len("Optional[") : -1])
        return None if inner is None else [*inner, _NONE]
    if text.startswith("Union[") and text.endswith("]"):
        parts = text[len("Union[") : -1].split(",")
    else:
        parts = text.split("|")
    if any("[" in part for part in parts):
        return None
    found: list[Any] = []
    for part in (p.strip() for p in parts):
        if part in _SIMPLE_NAMES:
            found.append(_SIMPLE_NAMES[part])
        elif part in _TENSOR_NAMES:
            found.append(_TENSOR)
        else:
            return None
    return found
