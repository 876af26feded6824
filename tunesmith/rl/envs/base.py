"""The environment protocol: what one trajectory's environment does each turn.

An environment is created per trajectory (:func:`spawn` of the configured one) from a prompt
row. :meth:`Environment.reset` gives the opening messages; :meth:`Environment.step` takes the
policy's assistant message and answers with a :class:`StepResult`: observation messages (tool
results, feedback), named reward terms for this turn, and whether the trajectory is done. The
trajectory's reward is the sum of every turn's terms (:class:`~tunesmith.rl.envs.episode.Episode`
runs the turns with a turn limit and a per-step timeout).

Example::

    >>> class Echo:
    ...     def tool_schemas(self):
    ...         return None
    ...     def reset(self, row):
    ...         self.turns = 0
    ...         return [{"role": "user", "content": row}]
    ...     def step(self, message):
    ...         self.turns += 1
    ...         done = message["content"] == "bye"
    ...         return StepResult([], {"said_bye": float(done)}, done)
    >>> env = spawn(Echo())
    >>> env.reset("hi"), env.step({"role": "assistant", "content": "bye"}).terms
    ([{'role': 'user', 'content': 'hi'}], {'said_bye': 1.0})
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Environment", "Message", "StepResult", "spawn"]

Message = dict[str, Any]


@dataclass
class StepResult:
    """What an environment answers to one assistant message.

    Attributes:
        observations: messages to append after the assistant's (role ``tool`` for tool
            results, ``user`` for feedback); empty when done.
        terms: this turn's reward terms, name -> float (summed into the trajectory's reward).
        done: the trajectory is over (a final answer, or the environment ended it).
        counts: events to count in the trajectory's log, e.g. ``{"malformed_calls": 1}``.
        assistant: the assistant message as the environment understood it (with structured
            ``tool_calls``), recorded in the conversation in place of the raw one; None keeps
            the raw message.

    Example::

        >>> StepResult([{"role": "tool", "name": "calculator", "content": "4"}], {}, False).done
        False
    """

    observations: list[Message]
    terms: dict[str, float]
    done: bool
    counts: dict[str, int] = field(default_factory=dict)
    assistant: Message | None = None


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment.

    ``reset`` must assign every per-trajectory attribute (never mutate state shared with the
    configured environment), so that :func:`spawn` (a shallow copy) makes a fresh one that
    shares the heavy, read-only parts (tools, indices, rewards).

    Example::

        >>> class Nothing:
        ...     def tool_schemas(self): return None
        ...     def reset(self, row): return []
        ...     def step(self, message): return StepResult([], {}, True)
        >>> isinstance(Nothing(), Environment)
        True
    """

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """JSON schemas of the tools, for the chat template's ``tools`` argument (or None)."""
        ...

    def reset(self, row: Any) -> list[Message]:
        """Start a trajectory for a prompt row; returns the opening messages."""
        ...

    def step(self, message: Mapping[str, Any]) -> StepResult:
        """Answer the policy's assistant message (``{"role": "assistant", "content": ...}``)."""
        ...


E = TypeVar("E")


def spawn(environment: E) -> E:
    """A fresh environment for one trajectory: a shallow copy of the configured one.

    Example::

        >>> class Env:
        ...     tools = {"big": "index"}
        >>> prototype = Env()
        >>> one = spawn(prototype)
        >>> one is not prototype and one.tools is prototype.tools
        True
    """
    return copy.copy(environment)
