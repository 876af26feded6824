"""Episodes (tunesmith.rl.envs.Episode) and ToolEnv: a step that times out or raises, a
reset that raises and a trajectory that reaches the turn limit all end with reward 0 and are
counted, never raised; a scripted 3-turn conversation through ToolEnv gives the expected
messages, counts and reward, and renders through the Qwen3 template."""

from __future__ import annotations

import threading
import time

import pytest

from tunesmith.config import instantiate
from tunesmith.data.chat_template import load_template, render
from tunesmith.rl.envs import (
    Calculator,
    Episode,
    EpisodeLimits,
    Retrieve,
    StepResult,
    ToolCall,
    ToolEnv,
    parse_qwen,
    spawn,
)
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.rewards import ExactAnswer, RewardSet

ASSISTANT = {"role": "assistant", "content": "thinking"}


class Scripted:
    """Each step answers with the next item of ``script``: a StepResult, an exception to
    raise, or a number of seconds to block (released by ``release``)."""

    def __init__(self, script, reset_error=None) -> None:
        self.script, self.reset_error = script, reset_error
        self.release = threading.Event()

    def tool_schemas(self):
        return None

    def reset(self, row):
        if self.reset_error is not None:
            raise self.reset_error
        self.position = 0
        return [{"role": "user", "content": row}]

    def step(self, message):
        item = self.script[self.position]
        self.position += 1
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, (int, float)):
            self.release.wait(item)
            return StepResult([], {"late": 1.0}, True)
        return item


def _going(value: float) -> StepResult:
    return StepResult([{"role": "user", "content": "go on"}], {"turn": value}, False, {"seen": 1})


def test_a_step_that_times_out_ends_the_trajectory_with_reward_0() -> None:
    env = Scripted([_going(0.5), 30.0])
    episode = Episode(env, "q", EpisodeLimits(max_turns=5, step_timeout_s=0.3))
    assert episode.step(ASSISTANT) == [{"role": "user", "content": "go on"}]
    start = time.monotonic()
    assert episode.step(ASSISTANT) == []
    assert time.monotonic() - start < 3
    env.release.set()  # lets the abandoned step thread finish
    assert episode.done and episode.ended == "timeout" and episode.reward == 0.0
    assert episode.error == "step: no answer within 0.3 s"
    assert episode.terms == {"turn": 0.5} and episode.counts == {"seen": 1}  # kept for logs
    assert episode.turns == 2 and episode.messages[-1] == ASSISTANT
    with pytest.raises(RuntimeError, match="after the trajectory ended"):
        episode.step(ASSISTANT)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (KeyError("tool"), "step: KeyError: 'tool'"),
        (SystemExit(3), "step: SystemExit: 3"),
        ("not a result", "step: TypeError: step returned str, not a StepResult"),
        (StepResult([], {"x": float("nan")}, True), "step: ValueError: reward term 'x' is nan"),
    ],
)
def test_a_step_that_raises_or_answers_wrongly_ends_with_reward_0(bad, error) -> None:
    episode = Episode(Scripted([_going(1.0), bad]), "q", EpisodeLimits(max_turns=5))
    episode.step(ASSISTANT)
    assert episode.step(ASSISTANT) == []
    assert (episode.ended, episode.reward, episode.error) == ("error", 0.0, error)
    assert episode.summary() == {
        "ended": "error",
        "reward": 0.0,
        "turns": 2,
        "terms": {"turn": 1.0},
        "counts": {"seen": 1},
        "error": error,
    }


def test_a_reset_that_raises_ends_before_the_first_turn() -> None:
    episode = Episode(Scripted([], reset_error=OSError("no corpus")), "q", EpisodeLimits())
    assert episode.done and episode.messages == [] and episode.turns == 0
    assert (episode.ended, episode.reward, episode.error) == (
        "error",
        0.0,
        "reset: OSError: no corpus",
    )


def test_the_turn_limit_ends_the_trajectory_with_reward_0() -> None:
    env = Scripted([_going(0.25)] * 5)
    episode = Episode(env, "q", EpisodeLimits(max_turns=3))
    observations = [episode.step(ASSISTANT) for _ in range(3)]
    assert observations == [[{"role": "user", "content": "go on"}]] * 2 + [[]]
    assert (episode.ended, episode.reward, episode.turns) == ("turn_limit", 0.0, 3)
    assert episode.terms == {"turn": 0.75} and episode.counts == {"seen": 3}
    # the last assistant message is recorded, its unused observation is not
    assert [m["role"] for m in episode.messages] == ["user"] + ["assistant", "user"] * 2 + [
        "assistant"
    ]


def test_done_sums_the_terms_and_spawn_gives_each_trajectory_its_own_state() -> None:
    env = Scripted([_going(0.25), StepResult([], {"turn": 0.5, "final": 2.0}, True)])
    first = Episode(env, "a", EpisodeLimits())
    second = Episode(env, "b", EpisodeLimits())
    first.step(ASSISTANT)
    second.step(ASSISTANT)  # its own position: also its first scripted step
    first.step(ASSISTANT)
    assert (first.ended, first.reward, first.terms) == ("done", 2.75, {"turn": 0.75, "final": 2.0})
    assert second.ended is None and second.terms == {"turn": 0.25}
    assert not hasattr(env, "position") and spawn(env).script is env.script


@pytest.mark.parametrize(
    "limits", [{"max_turns": 0}, {"max_turns": 2.0}, {"step_timeout_s": 0}, {"step_timeout_s": "1"}]
)
def test_limits_are_checked(limits) -> None:
    with pytest.raises(ValueError, match="EpisodeLimits"):
        EpisodeLimits(**limits)


# ------------------------------------------------------------------------ ToolEnv, 3 turns


class Brief:
    """1.0 for an answer of at most 40 characters."""

    name = "brief"

    def __call__(self, samples):
        return [float(len(s.completion) <= 40) for s in samples]


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture
def tool_env(tmp_path) -> ToolEnv:
    corpus = tmp_path / "facts.jsonl"
    corpus.write_text(
        '{"id": "tax", "text": "The tax rate is 7 percent."}\n'
        '{"id": "cat", "text": "Cats sleep a lot."}\n',
        encoding="utf-8",
    )
    rewards = RewardSet({"correct": ExactAnswer(), "brief": Brief()}, {"brief": 0.5})
    return ToolEnv(
        [Calculator(), Retrieve(corpus, top_k=1)], rewards, format="qwen", system_prompt="Be exact."
    )


def test_a_scripted_three_turn_conversation(tool_env: ToolEnv) -> None:
    question = "What is 123456 * 654321 plus the tax rate?"
    prompt = Prompt(3, [{"role": "user", "content": question}], answer="80779853383")
    episode = Episode(tool_env, prompt, EpisodeLimits(max_turns=4))
    turn1 = "Two products.\n" + _call("calculator", '{"expression": "123456 * 654321"}')
    turn1 += "\n" + _call("calculator", '{"expr": "1"}') + "\n<tool_call>\n{oops}\n</tool_call>"
    turn2 = _call("retrieve", '{"query": "tax rate"}') + "\n" + _call("clock", "{}")
    turn3 = "<answer>80779853383</answer>"
    seen = [episode.step({"role": "assistant", "content": text}) for text in (turn1, turn2, turn3)]

    product = {"role": "tool", "name": "calculator", "content": "80779853376"}
    bad_json = (
        parse_qwen("<tool_call>\n{oops}\n</tool_call>").errors[0].removeprefix("tool call 1: ")
    )
    errors1 = [  # in the order the calls were written
        product,
        {
            "role": "tool",
            "name": "calculator",
            "content": "Error: calculator: missing argument(s) ['expression']",
        },
        {"role": "tool", "name": "error", "content": f"Error: tool call 3: {bad_json}"},
    ]
    tax = {"role": "tool", "name": "retrieve", "content": "[tax] The tax rate is 7 percent."}
    clock = {
        "role": "tool",
        "name": "clock",
        "content": "Error: unknown tool 'clock'; the tools are ['calculator', 'retrieve']",
    }
    assert seen == [errors1, [tax, clock], []]

    def assistant(content: str, *calls: ToolCall) -> dict:
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_message_call() for call in calls]
        return message

    assert episode.messages == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": question},
        assistant(
            "Two products.",
            ToolCall("calculator", {"expression": "123456 * 654321"}),
            ToolCall("calculator", {"expr": "1"}),
        ),
        *errors1,
        assistant("", ToolCall("retrieve", {"query": "tax rate"}), ToolCall("clock", {})),
        tax,
        clock,
        assistant(turn3),
    ]
    assert episode.summary() == {
        "ended": "done",
        "reward": 1.5,  # correct (1.0 x 1.0) + brief (1.0 x 0.5)
        "turns": 3,
        "terms": {"correct": 1.0, "brief": 0.5},
        "counts": {"malformed_calls": 1, "tool_calls": 4, "tool_errors": 2, "reward_failures": 0},
        "error": None,
    }
    # the conversation renders through the family template, tools described in the system turn
    text = render(load_template("qwen3"), episode.messages, tools=tool_env.tool_schemas())
    assert text.count("<tool_response>") == 5 and text.count('<tool_call>\n{"name": "') == 4
    assert '"name": "retrieve", "description": "Search the document collection' in text


def test_a_wrong_answer_and_a_tool_bug(tool_env: ToolEnv) -> None:
    prompt = Prompt(0, [{"role": "user", "content": "2+2?"}], answer="4")
    episode = Episode(tool_env, prompt, EpisodeLimits())
    episode.step(
        {"role": "assistant", "content": "<answer>five, surely, without any doubt</answer>"}
    )
    assert (episode.reward, episode.terms) == (0.0, {"correct": 0.0, "brief": 0.0})
    # ExactAnswer raises without a reference answer: scored 0 by the RewardSet, counted
    unanswerable = Episode(tool_env, Prompt(1, [{"role": "user", "content": "?"}]), EpisodeLimits())
    unanswerable.step({"role": "assistant", "content": "42"})
    assert unanswerable.ended == "done" and unanswerable.terms == {"correct": 0.0, "brief": 0.5}
    assert unanswerable.counts == {"reward_failures": 1} and unanswerable.reward == 0.5

    class Broken(Calculator):
        def __call__(self, expression):
            raise ZeroDivisionError("a bug in the tool, not a ToolError")

    env = ToolEnv([Broken()], ExactAnswer())
    episode = Episode(env, prompt, EpisodeLimits())
    assert (
        episode.step({"role": "assistant", "content": _call("calculator", '{"expression": "1"}')})
        == []
    )
    assert episode.ended == "error" and episode.reward == 0.0
    assert episode.error == "step: ZeroDivisionError: a bug in the tool, not a ToolError"


def test_tool_env_from_a_config(tmp_path) -> None:
    config = {
        "_component_": "tunesmith.rl.envs.ToolEnv",
        "format": "plain",
        "tools": [{"_component_": "tunesmith.rl.envs.Calculator"}],
        "rewards": {"_component_": "tunesmith.rl.rewards.ExactAnswer"},
    }
    env = instantiate(config)
    episode = Episode(
        env, Prompt(0, [{"role": "user", "content": "3^4?"}], answer=81), EpisodeLimits()
    )
    assert episode.step(
        {"role": "assistant", "content": 'CALL calculator {"expression": "3^4"}'}
    ) == [{"role": "tool", "name": "calculator", "content": "81"}]
    episode.step({"role": "assistant", "content": "81"})
    assert episode.reward == 1.0
    with pytest.raises(ValueError, match="format='hermes' is not one of"):
        ToolEnv([Calculator()], ExactAnswer(), format="hermes")


def test_llama3_calls_past_max_calls_per_turn_are_refused() -> None:
    env = ToolEnv([Calculator()], ExactAnswer(), format="llama3", max_calls_per_turn=1)
    episode = Episode(env, Prompt(0, [{"role": "user", "content": "?"}], answer=6), EpisodeLimits())
    reply = '{"name": "calculator", "parameters": {"expression": "2*3"}}; '
    reply += '{"name": "calculator", "parameters": {"expression": "3*3"}}'
    assert episode.step({"role": "assistant", "content": reply}) == [
        {"role": "tool", "name": "calculator", "content": "6"},
        {"role": "tool", "name": "error", "content": "Error: at most 1 call(s) per reply; not run"},
    ]
    assert episode.counts == {"malformed_calls": 1, "tool_calls": 1, "tool_errors": 0}
