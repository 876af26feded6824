"""The positive mark of what a config may build: ``@component``.

A config's ``_component_`` that resolves to a callable *defined* in tunesmith (or in a package a
user added to ``ALLOWED_COMPONENT_PREFIXES``) is built only if that very object carries the
mark; everything else of the package (helpers, code runners such as the CodeTests sandbox
runner, entry points) is refused. The mark is kept here by identity (a weak reference to the
object, compared with ``is``), never as an attribute, so it is judged on the resolved object
itself: a subclass of a marked class, a ``functools.wraps`` wrapper of a marked function (which
copies the function's ``__dict__``) or a re-export under another name are exactly as marked as
the object they resolve to, and no more. Re-exports (``tunesmith.training.cosine_with_warmup``,
defined in ``tunesmith.training.lr_schedules``) need no mark of their own.

A method is marked where it is defined: ``@component`` above ``@classmethod`` (or below it)
marks the function the class binds, so ``tunesmith.data.Tokenizer.from_pretrained`` resolves
to a bound method whose ``__func__`` carries the mark.

Example::

    >>> import torch
    >>> from tunesmith.config.registry import component, is_marked
    >>> @component
    ... class MyLoss(torch.nn.Module): ...
    >>> is_marked(MyLoss), is_marked(type("Sub", (MyLoss,), {}))
    (True, False)
"""

from __future__ import annotations

import types
import weakref
from typing import Any, TypeVar

__all__ = ["component", "is_marked", "marked_objects"]

T = TypeVar("T")

_MARKED: dict[int, weakref.ref] = {}


def component(obj: T) -> T:
    """Mark ``obj`` (a class, a function, or a ``classmethod``/``staticmethod``: its function)
    as buildable from a config; returns ``obj`` unchanged.

    >>> @component
    ... def linear_schedule(optimizer, num_warmup_steps): ...
    """
    target = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    if not callable(target):
        raise TypeError(f"@component marks classes and functions, not {type(target).__name__}")
    key = id(target)

    def forget(ref: weakref.ref, key: int = key) -> None:  # the object is gone: its id is free
        if _MARKED.get(key) is ref:
            del _MARKED[key]

    _MARKED[key] = weakref.ref(target, forget)
    return obj


def is_marked(obj: Any) -> bool:
    """Whether ``obj`` itself (or, for a bound method, the function it binds) carries the mark.

    >>> from tunesmith.data import Tokenizer
    >>> from tunesmith.rl.rewards.sandbox import run_sandboxed
    >>> is_marked(Tokenizer.from_pretrained), is_marked(run_sandboxed)
    (True, False)
    """
    candidates = (obj, obj.__func__) if isinstance(obj, types.MethodType) else (obj,)
    for candidate in candidates:
        ref = _MARKED.get(id(candidate))
        if ref is not None and ref() is candidate:
            return True
    return False


def marked_objects() -> list[Any]:
    """Every object marked so far (in modules imported so far), for listings and tests."""
    return [obj for obj in (ref() for ref in list(_MARKED.values())) if obj is not None]
