"""Environments and tools for multi-turn, tool-using RL (``environment:`` in ``grpo`` and
``grpo_async``).

* :mod:`~tunesmith.rl.envs.base`: the :class:`Environment` protocol, :class:`StepResult` and
  :func:`spawn` (a fresh environment per trajectory);
* :mod:`~tunesmith.rl.envs.episode`: :class:`Episode`, one trajectory with a turn limit and a
  per-step timeout (a step that raises or times out ends it with reward 0, counted);
* :mod:`~tunesmith.rl.envs.toolcalls`: :func:`parse_tool_calls` in the ``qwen``, ``llama3``
  and ``plain`` formats;
* :mod:`~tunesmith.rl.envs.tool`: the :class:`Tool` protocol, :class:`ToolError` and
  :func:`function_schema`;
* the built-in tools :class:`Calculator` (exact arithmetic), :class:`PythonTool` (the code
  sandbox) and :class:`Retrieve` (BM25 over a local JSONL corpus); :class:`Unavailable`
  stands in for a tool in a control run (every call an error);
* :mod:`~tunesmith.rl.envs.tool_env`: :class:`ToolEnv`, tools plus rewards on the final answer;
* :mod:`~tunesmith.rl.envs.trajectory`: multi-turn rollouts as exact token rows
  (:func:`sample_trajectories`, :class:`EpisodeSettings`, :class:`ObservationTokens`).

Example::

    >>> from tunesmith.rl.prompts import Prompt
    >>> from tunesmith.rl.rewards import ExactAnswer
    >>> env = ToolEnv([Calculator()], ExactAnswer(), format="plain")
    >>> episode = Episode(env, Prompt(0, [{"role": "user", "content": "99*99?"}], answer=9801),
    ...                   EpisodeLimits(max_turns=3))
    >>> episode.step({"role": "assistant", "content": 'CALL calculator {"expression": "99*99"}'})
    [{'role': 'tool', 'name': 'calculator', 'content': '9801'}]
    >>> _ = episode.step({"role": "assistant", "content": "9801"})
    >>> episode.ended, episode.reward, episode.counts["tool_calls"]
    ('done', 1.0, 1)
"""

from tunesmith.rl.envs.base import Environment, Message, StepResult, spawn
from tunesmith.rl.envs.calculator import Calculator, calculate
from tunesmith.rl.envs.episode import ENDINGS, Episode, EpisodeLimits
from tunesmith.rl.envs.python_tool import PythonTool
from tunesmith.rl.envs.retrieve import BM25Index, Retrieve, load_corpus
from tunesmith.rl.envs.tool import Tool, ToolError, check_arguments, function_schema
from tunesmith.rl.envs.tool_env import ToolEnv
from tunesmith.rl.envs.toolcalls import (
    TOOL_CALL_FORMATS,
    ParsedTurn,
    ToolCall,
    parse_llama3,
    parse_plain,
    parse_qwen,
    parse_tool_calls,
)
from tunesmith.rl.envs.trajectory import (
    EpisodeSettings,
    ObservationTokens,
    Trajectory,
    sample_trajectories,
)
from tunesmith.rl.envs.unavailable import Unavailable

__all__ = [
    "ENDINGS",
    "TOOL_CALL_FORMATS",
    "BM25Index",
    "Calculator",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "EpisodeSettings",
    "Message",
    "ObservationTokens",
    "ParsedTurn",
    "PythonTool",
    "Retrieve",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "Trajectory",
    "Unavailable",
    "calculate",
    "check_arguments",
    "function_schema",
    "load_corpus",
    "parse_llama3",
    "parse_plain",
    "parse_qwen",
    "parse_tool_calls",
    "sample_trajectories",
    "spawn",
]
