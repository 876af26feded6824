"""``ToolEnv``: the policy answers a prompt, calling tools along the way; its final answer is
scored by the usual rewards.

Each turn, the assistant reply is parsed in the family's tool-call format
(:mod:`~tunesmith.rl.envs.toolcalls`). A reply with calls gets one ``tool`` message per
attempted call, in the order written (``{"role": "tool", "name": ..., "content": ...}``, which
the chat templates render as tool results): the tool's output, or ``"Error: ..."`` for a
malformed call, an unknown tool, arguments that do not fit the tool's schema, a call past
``max_calls_per_turn`` or a :class:`~tunesmith.rl.envs.tool.ToolError` (counted:
``malformed_calls``, ``tool_errors``; ``tool_calls`` counts the calls run). A reply without any
call is the final answer: the trajectory is done and its reward terms are the ``rewards``'
weighted scores (a :class:`~tunesmith.rl.rewards.RewardSet` or one reward) of a
:class:`~tunesmith.rl.rewards.Sample` whose prompt is the last prompt message's text and whose
completion is the answer (a reward that raises scores 0 and is counted in
``reward_failures``). An exception a tool raises that is not a ``ToolError`` is a bug of the
tool: it ends the trajectory (reward 0, counted by the :class:`~tunesmith.rl.envs.Episode`).

Example::

    >>> from tunesmith.rl.envs.calculator import Calculator
    >>> from tunesmith.rl.prompts import Prompt
    >>> from tunesmith.rl.rewards import ExactAnswer
    >>> env = ToolEnv([Calculator()], ExactAnswer(), format="qwen")
    >>> env.reset(Prompt(0, [{"role": "user", "content": "12*12?"}], answer="144"))[-1]["content"]
    '12*12?'
    >>> env.step({"role": "assistant", "content": '<tool_call>\\n{"name": "calculator", '
    ...           '"arguments": {"expression": "12*12"}}\\n</tool_call>'}).observations
    [{'role': 'tool', 'name': 'calculator', 'content': '144'}]
    >>> env.step({"role": "assistant", "content": "144"}).terms
    {'exact_answer': 1.0}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunesmith.config.registry import component
from tunesmith.rl.envs.base import Message, StepResult
from tunesmith.rl.envs.tool import Tool, ToolError, check_arguments
from tunesmith.rl.envs.toolcalls import TOOL_CALL_FORMATS, ToolCall, parse_tool_calls
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.rewards.base import Reward, RewardSet, Sample

__all__ = ["ToolEnv"]


def _named_tools(tools: Mapping[str, Tool] | Sequence[Tool]) -> dict[str, Tool]:
    items = tools.items() if isinstance(tools, Mapping) else ((t.name, t) for t in tools)
    named: dict[str, Tool] = {}
    for name, tool in items:
        if not callable(tool) or not isinstance(getattr(tool, "schema", None), dict):
            raise TypeError(f"ToolEnv: tool {name!r} needs a `schema` dict and a __call__")
        if tool.schema["function"]["name"] != name:
            raise ValueError(
                f"ToolEnv: tool {name!r} is named {tool.schema['function']['name']!r} in its schema"
            )
        if name in named:
            raise ValueError(f"ToolEnv: two tools are named {name!r}")
        named[name] = tool
    if not named:
        raise ValueError("ToolEnv: no tools given")
    return named


@component
class ToolEnv:
    """An environment of tools (see the module docs).

    Args:
        tools: the tools, a list (named by their ``name``) or a ``{name: tool}`` mapping.
        rewards: what scores the final answer: a RewardSet, or one reward.
        format: the tool-call format of the policy's family (:data:`TOOL_CALL_FORMATS`).
        system_prompt: a system message put first when the prompt has none.
        max_calls_per_turn: calls of one reply beyond this are refused (an error each).
        describe_tools: pass the tools' schemas to the chat template (its ``tools`` block);
            False leaves them out (``tool_schemas()`` is None), for a system prompt that
            states the tools itself in fewer tokens (the ``plain`` format).

    Example (YAML)::

        environment:
          _component_: tunesmith.rl.envs.ToolEnv
          format: qwen
          tools: [{_component_: tunesmith.rl.envs.Calculator}]
          rewards: {_component_: tunesmith.rl.rewards.ExactAnswer}
    """

    def __init__(
        self,
        tools: Mapping[str, Tool] | Sequence[Tool],
        rewards: RewardSet | Reward,
        format: str = "qwen",
        system_prompt: str | None = None,
        max_calls_per_turn: int = 4,
        describe_tools: bool = True,
    ) -> None:
        if format not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"ToolEnv: format={format!r} is not one of {sorted(TOOL_CALL_FORMATS)}"
            )
        if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int):
            raise ValueError(
                f"ToolEnv: max_calls_per_turn must be an int, got {max_calls_per_turn!r}"
            )
        if max_calls_per_turn < 1:
            raise ValueError(f"ToolEnv: max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.tools = _named_tools(tools)
        self.rewards = rewards if isinstance(rewards, RewardSet) else RewardSet([rewards])
        self.format = format
        self.system_prompt = system_prompt
        self.max_calls_per_turn = max_calls_per_turn
        self.describe_tools = bool(describe_tools)
        self.prompt: Prompt | None = None

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools' schemas, for the chat template's ``tools`` argument (None when
        ``describe_tools`` is False)."""
        if not self.describe_tools:
            return None
        return [tool.schema for tool in self.tools.values()]

    def reset(self, row: Prompt) -> list[Message]:
        if not isinstance(row, Prompt):
            raise TypeError(f"ToolEnv.reset takes a Prompt row, got {type(row).__name__}")
        self.prompt = row
        messages = [dict(m) for m in row.messages]
        if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, message: Mapping[str, Any]) -> StepResult:
        turn = parse_tool_calls(str(message.get("content") or ""), self.format)
        if turn.is_final:
            terms, failures = self._score(turn.content)
            counts = {"reward_failures": failures}
            return StepResult([], terms, True, counts, assistant=turn.as_message())
        counts = {"malformed_calls": 0, "tool_calls": 0, "tool_errors": 0}
        observations = []
        for attempt in turn.attempts:
            if isinstance(attempt, str):
                observations.append(self._error(attempt))
                counts["malformed_calls"] += 1
            elif counts["tool_calls"] >= self.max_calls_per_turn:
                observations.append(
                    self._error(f"at most {self.max_calls_per_turn} call(s) per reply; not run")
                )
                counts["malformed_calls"] += 1
            else:
                observation, failed = self._run(attempt)
                observations.append(observation)
                counts["tool_calls"] += 1
                counts["tool_errors"] += failed
        return StepResult(observations, {}, False, counts, assistant=turn.as_message())

    def _run(self, call: ToolCall) -> tuple[Message, bool]:
        """The tool message of one call, and whether it is an error."""
        tool = self.tools.get(call.name)
        try:
            if tool is None:
                raise ToolError(f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}")
            check_arguments(tool.schema, call.arguments)
            output = tool(**call.arguments)
        except ToolError as exc:
            return self._error(str(exc), call.name), True
        if not isinstance(output, str):
            raise TypeError(f"tool {call.name!r} returned {type(output).__name__}, not str")
        return {"role": "tool", "name": call.name, "content": output}, False

    def _error(self, text: str, name: str = "error") -> Message:
        return {"role": "tool", "name": name, "content": f"Error: {text}"}

    def _score(self, answer: str) -> tuple[dict[str, float], int]:
        """Weighted reward terms of the final answer, and how many rewards raised (scored 0
        by the RewardSet)."""
        prompt = self.prompt
        if prompt is None:
            raise RuntimeError("ToolEnv.step before reset")
        question = prompt.messages[-1].get("content", "") if prompt.messages else ""
        sample = Sample(str(question), answer, answer=prompt.answer, metadata=prompt.metadata)
        result = self.rewards([sample])
        terms = {
            name: self.rewards.weights[name] * float(scores[0])
            for name, scores in result.per_reward.items()
        }
        return terms, sum(result.failures.values())
