"""Small components the config tests build and validate (imported as ``configtest_components``).

This module uses postponed (string) annotations on purpose, so validation is exercised on the
form most of tunesmith's own modules use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from tunesmith.config.registry import component

if TYPE_CHECKING:  # never imported at runtime: validation must fall back to annotation text
    from collections.abc import NotARealThing  # type: ignore[attr-defined]


@component  # tests that add this module's prefix to the allow-list build it
@dataclass
class Optim:
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    name: str = "sgd"
    warmup: Optional[int] = None


@dataclass
class Block:
    dim: int
    dropout: float | None = None


@dataclass
class Net:
    blocks: list = field(default_factory=list)
    head: Any = None
    options: dict = field(default_factory=dict)
    depth: int = 1


class WithParams:
    """Takes runtime positional ``params`` first, like a torch optimizer."""

    def __init__(self, params: Any, lr: float = 0.1, *, scale: int = 1) -> None:
        self.params = list(params)
        self.lr = lr
        self.scale = scale


def pair(a: int, b: int = 1) -> tuple[int, int]:
    return (a, b)


def open_kwargs(x: int, **extra: Any) -> dict[str, Any]:
    return {"x": x, **extra}


def text_annotations(count: int, thing: NotARealThing | None = None) -> int:
    """``NotARealThing`` cannot be evaluated, so the annotations stay text."""
    return count


def explode(reason: str = "boom") -> None:
    raise RuntimeError(reason)


NOT_CALLABLE = 42
