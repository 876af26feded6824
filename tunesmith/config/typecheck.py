"""Check a config value against a parameter annotation, for the annotations a YAML value can
be checked against.

Checked: ``int``, ``float``, ``bool``, ``str``, ``None``, ``Literal[...]`` (the value must be
one of the listed values: a component's choices live in its signature, so ``tunesmith
validate`` and the component read the same list) and ``Optional``/unions of those, written
as objects or as text (postponed annotations). ``Annotated[T, Check(problem)]`` adds a
component's own check of a value that fits ``T`` (a folder that must exist, say): the same
function the component calls when it is built. An int is a fine float; a bool is not an
int. Members a YAML value never is (``Tensor``, ``torch.dtype``, ``torch.device``,
``os.PathLike``, ``pathlib.Path``) are dropped, so ``lr: float | Tensor`` still rejects
``"abc"``. Anything else is not checked.

Example::

    >>> from typing import Literal
    >>> type_problem(float, "abc")
    "expected float, got str 'abc'"
    >>> type_problem("Optional[int]", None) is None
    True
    >>> type_problem(Literal["assistant", "all"] | None, "assistent")
    "expected one of 'assistant', 'all', or None, got str 'assistent'; did you mean 'assistant'?"
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

from tunesmith.config.components import COMPONENT_KEY
from tunesmith.config.errors import suggestion, type_name
from tunesmith.config.nodes import has_key

__all__ = ["Check", "literal_values", "type_problem"]

_NONE = type(None)
_SIMPLE_NAMES: dict[str, type] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "None": _NONE,
    "NoneType": _NONE,
}
# Members no YAML value is: dropped from a union (written as text or as the object's name).
_OPAQUE_NAMES = {
    "Tensor",
    "torch.Tensor",
    "dtype",
    "torch.dtype",
    "device",
    "torch.device",
    "PathLike",
    "os.PathLike",
    "Path",
    "pathlib.Path",
}


@dataclass(frozen=True)
class Check:
    """``Annotated`` metadata: ``problem(value)`` says what is wrong with a value that fits the
    annotated type (None: nothing). ``tunesmith validate`` and every run call it before
    anything is built; the component calls the same function, so the two cannot disagree.
    ``on_disk``: it looks for a file or folder (skipped by a check of the config alone, made
    before its inputs exist).

    Example::

        >>> from typing import Annotated
        >>> Folder = Annotated[str, Check(lambda v: None if v == "." else f"{v}: no folder")]
        >>> type_problem(Folder, "nowhere")
        'nowhere: no folder'
    """

    problem: Callable[[Any], str | None]
    on_disk: bool = False

    @classmethod
    def raises(cls, convert: Callable[[Any], Any]) -> Check:
        """The check of a component's own converter: the message of the ``ValueError`` (or
        ``TypeError``) ``convert(value)`` raises is the problem.

        >>> from typing import Annotated
        >>> type_problem(Annotated[str, Check.raises(int)], "4x")
        "invalid literal for int() with base 10: '4x'"
        """

        def problem(value: Any) -> str | None:
            try:
                convert(value)
            except (ValueError, TypeError) as error:
                return str(error)
            return None

        return cls(problem)


@dataclass(frozen=True)
class _Allowed:
    """What an annotation allows: scalar ``types``, ``Literal`` ``values`` and ``checks``."""

    types: tuple[type, ...] = ()
    values: tuple[Any, ...] = ()
    checks: tuple[Check, ...] = ()

    def __or__(self, other: _Allowed) -> _Allowed:
        return _Allowed(
            self.types + other.types, self.values + other.values, self.checks + other.checks
        )

    def fits(self, value: Any) -> bool:
        return _fits(value, self.types) or any(
            type(value) is type(v) and value == v for v in self.values
        )

    def expected(self) -> str:
        """``"int or None"``, ``"one of 'a', 'b', or None"``."""
        words = [t.__name__ for t in self.types if t is not _NONE]
        if len(self.values) == 1:
            words.append(repr(self.values[0]))
        elif self.values:
            words.append("one of " + ", ".join(repr(v) for v in self.values))
        text = " or ".join(words)
        if _NONE in self.types:
            text += (", or None" if len(self.values) > 1 else " or None") if words else "None"
        return text


def type_problem(annotation: Any, value: Any, *, files: bool = True) -> str | None:
    """Why ``value`` does not fit ``annotation``, or None when it fits or is not checked;
    ``files=False`` skips the checks that look at the disk (:attr:`Check.on_disk`)."""
    allowed = _allowed(annotation)
    if allowed is None:
        return None
    if isinstance(value, DictConfig) and has_key(value, COMPONENT_KEY):
        return None  # built at runtime: its result type is not known here
    if not (allowed.types or allowed.values) or allowed.fits(value):
        if value is None:
            return None
        checks = [c for c in allowed.checks if files or not c.on_disk]
        return next((p for c in checks if (p := c.problem(value)) is not None), None)
    shown = "" if isinstance(value, (DictConfig, ListConfig)) else f" {value!r}"
    hint = ""
    if isinstance(value, str) and allowed.values:
        hint = suggestion(value, [str(v) for v in allowed.values])
    return f"expected {allowed.expected()}, got {type_name(value)}{shown}{hint}"


def literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` annotation (or a union holding some) lists, in order.

    >>> from typing import Literal, Optional
    >>> literal_values(Optional[Literal["left", "right"]])
    ('left', 'right')
    """
    allowed = _allowed(annotation)
    return () if allowed is None else allowed.values


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


def _allowed(annotation: Any) -> _Allowed | None:
    """What ``annotation`` allows, or None when it is not one that is checked."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        return _allowed_from_text(annotation)
    if annotation is None or annotation is _NONE:
        return _Allowed(types=(_NONE,))
    if annotation in (int, float, bool, str):
        return _Allowed(types=(annotation,))
    if _is_opaque(annotation):
        return _Allowed()
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return _Allowed(values=typing.get_args(annotation))
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        found = _allowed(inner)
        checks = tuple(m for m in metadata if isinstance(m, Check))
        return None if found is None else found | _Allowed(checks=checks)
    if origin in (typing.Union, types.UnionType):
        members = [_allowed(member) for member in typing.get_args(annotation)]
        if any(m is None for m in members):
            return None
        return _union(members)  # type: ignore[arg-type]
    return None


def _union(members: list[_Allowed]) -> _Allowed:
    result = _Allowed()
    for member in members:
        result = result | member
    return result


def _is_opaque(annotation: Any) -> bool:
    """A class no YAML value is an instance of (a tensor, a dtype, a device, a path object)."""
    cls = typing.get_origin(annotation) or annotation
    if cls in (os.PathLike,) or (isinstance(cls, type) and issubclass(cls, pathlib.PurePath)):
        return True
    module = str(getattr(cls, "__module__", ""))
    return module.startswith("torch") and getattr(cls, "__name__", None) in _OPAQUE_NAMES


def _allowed_from_text(text: str) -> _Allowed | None:
    text = text.strip().strip("'\"")
    if text.startswith("Optional[") and text.endswith("]"):
        inner = _allowed_from_text(text[len("Optional[") : -1])
        return None if inner is None else inner | _Allowed(types=(_NONE,))
    if text.startswith(("Literal[", "typing.Literal[")) and text.endswith("]"):
        return _literal_from_text(text[text.index("[") + 1 : -1])
    if text.startswith("Union[") and text.endswith("]"):
        parts = text[len("Union[") : -1].split(",")
    else:
        parts = text.split("|")
    if any("[" in part for part in parts):
        return None
    members = []
    for part in (p.strip() for p in parts):
        if part in _SIMPLE_NAMES:
            members.append(_Allowed(types=(_SIMPLE_NAMES[part],)))
        elif part in _OPAQUE_NAMES:
            members.append(_Allowed())
        else:
            return None
    return _union(members)


def _literal_from_text(inside: str) -> _Allowed | None:
    try:
        values = ast.literal_eval(f"({inside},)")
    except (ValueError, SyntaxError):
        return None
    return _Allowed(values=tuple(values))
