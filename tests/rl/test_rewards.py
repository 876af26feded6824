"""Reward components: answer extraction, exact and math answers (hand-labelled pairs), the
think/answer format, DAPO's overlong penalty, and the weighted :class:`RewardSet` with its
failure counting, built from YAML as a recipe builds it."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from tunesmith.config import instantiate
from tunesmith.rl.rewards import (
    ExactAnswer,
    MathAnswer,
    OverlongPenalty,
    Reward,
    RewardSet,
    Sample,
    ThinkAnswerFormat,
    extract_answer,
    parse_number,
)


def _samples(completions, answers=None, **kwargs) -> list[Sample]:
    answers = answers if answers is not None else [None] * len(completions)
    return [Sample("Q: ", c, answer=a, **kwargs) for c, a in zip(completions, answers)]


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("<think>7?</think><answer> 42 </answer>", "auto", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "answer_tag", "2"),  # the last one
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "auto", "\\frac{1}{2}"),  # unwrapped
        ("<answer>\\boxed{5}</answer>", "answer_tag", "\\boxed{5}"),  # only in auto
        ("so \\boxed{\\frac{a}{\\sqrt{b}}} done", "auto", "\\frac{a}{\\sqrt{b}}"),  # nested {}
        ("\\boxed{1} and \\boxed{ {2} }", "boxed", "{2}"),
        ("\\boxed{unbalanced", "boxed", None),
        ("first 3, then -12.5, the end.", "auto", "-12.5"),
        ("it costs 1,000,000 dollars", "last_number", "1,000,000"),
        ("x2 and 5-3", "last_number", "3"),  # no sign glued to a number, no digit in a word
        ("version 1.2.3", "last_number", "1.2"),
        ("no digits here", "auto", None),
        ("no tag", "answer_tag", None),
        ("  all of it \n", "none", "all of it"),
    ],
)
def test_extract_answer(text, mode, expected) -> None:
    assert extract_answer(text, mode) == expected


def test_extract_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="extract='tags'"):
        extract_answer("x", "tags")
    with pytest.raises(ValueError, match="extract='boxes'"):
        ExactAnswer(extract="boxes")


def test_parse_number() -> None:
    assert parse_number("1,000") == 1000
    assert parse_number(" -0.50 ") == parse_number(-0.5) == -0.5
    assert parse_number("3/4") == 0.75
    assert parse_number("$18") == 18
    assert parse_number("12,34") is None  # not thousands groups
    assert parse_number("abc") is None
    assert parse_number(True) is None


# ----------------------------------------------------------------------------- exact answers


def test_exact_answer() -> None:
    reward = ExactAnswer()
    completions = [
        "<answer>1,000</answer>",  # vs 1000
        "the total is 0.50",  # vs "0.5"
        "<answer>1/2</answer>",  # vs 0.5
        "<answer>  New   York. </answer>",  # vs "new york"
        "<answer>41</answer>",  # vs 42
        "<answer>Paris</answer>",  # vs "London"
        "nothing",  # no answer
        "<answer>0.3333333</answer>",  # vs 1/3 within rel_tol 1e-6
        "<answer>b</answer>",  # a list reference: any item matches
    ]
    answers = [1000, "0.5", 0.5, "new york", 42, "London", "7", "1/3", ["a", "b"]]
    assert reward(_samples(completions, answers)) == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    # numeric=False compares strings only
    strict = ExactAnswer(numeric=False)
    assert strict(_samples(["<answer>0.50</answer>", "<answer>0.5</answer>"], ["0.5"] * 2)) == [
        0.0,
        1.0,
    ]


def test_exact_answer_without_reference_raises() -> None:
    with pytest.raises(ValueError, match="no reference answer"):
        ExactAnswer()(_samples(["<answer>1</answer>"]))


# ----------------------------------------------------------------------------- math answers

# (reference, completion, label): labels written by hand, from the mathematics.
MATH_PAIRS = [
    ("\\frac{1}{2}", "<think>half</think><answer>0.5</answer>", 1.0),  # fraction vs decimal
    ("0.5", "The answer is \\boxed{\\frac{2}{4}}.", 1.0),  # unreduced fraction
    ("1/2", "<answer>\\dfrac{1}{2}</answer>", 1.0),  # plain vs latex
    (0.75, "<answer>3/4</answer>", 1.0),  # a float reference
    ("3", "<answer>4</answer>", 0.0),  # wrong
    ("-3", "<answer>3</answer>", 0.0),  # wrong sign
    ("\\{1, 2, 3\\}", "<answer>\\{3, 2, 1\\}</answer>", 1.0),  # sets are unordered
    ("(1, 2)", "<answer>(2, 1)</answer>", 0.0),  # ordered pair / open interval: order counts
    ("[0, 1)", "<answer>[0,1)</answer>", 1.0),  # same interval
    ("[0, 1)", "<answer>(0, 1]</answer>", 0.0),  # other ends open
    ("\\sqrt{2}", "so \\boxed{2^{1/2}}", 1.0),  # equal expressions
    ("(x+1)^2", "<answer>x^2+2x+1</answer>", 1.0),  # expanded polynomial
    ("\\frac{\\sqrt{3}}{2}", "<answer>\\sqrt{3}/2</answer>", 1.0),
    ("\\pi", "<answer>3.14</answer>", 0.0),  # an approximation is not pi
    (2, "<answer>I do not know</answer>", 0.0),  # no number
    (1000, "The total is \\boxed{1,000}.", 1.0),  # thousands separator
    ("2", "First 3, then subtract 1, so the answer is 2.", 1.0),  # no tag: math-verify finds it
]


def test_math_answer_hand_labelled_pairs() -> None:
    reward = MathAnswer()
    samples = [Sample("Q: ", c, answer=a) for a, c, _ in MATH_PAIRS]
    scores = reward(samples)
    wrong = [(a, c, s) for (a, c, label), s in zip(MATH_PAIRS, scores) if s != label]
    assert not wrong, f"mis-scored: {wrong}"


def test_math_answer_extract_modes() -> None:
    completion = "<answer>7</answer> though \\boxed{8}"
    answers = ["7", "8"]
    assert MathAnswer(extract="answer_tag")(_samples([completion] * 2, answers)) == [1.0, 0.0]
    assert MathAnswer(extract="boxed")(_samples([completion] * 2, answers)) == [0.0, 1.0]
    # nothing found by the mode: 0, whatever the text holds
    assert MathAnswer(extract="answer_tag")(_samples(["it is 7"], ["7"])) == [0.0]


def test_math_answer_timeout_is_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        MathAnswer(timeout_s=0.5)
    assert MathAnswer(timeout_s=None)(_samples(["<answer>1</answer>"], ["1"])) == [1.0]


# ----------------------------------------------------------------------------- format, length


def test_think_answer_format() -> None:
    reward = ThinkAnswerFormat()
    completions = [
        "<think>2+2 is 4</think>\n<answer>4</answer>",  # 1
        "  <think>\nmulti\nline\n</think>\n\n<answer>\n4\n</answer>\n",  # 1: newlines inside
        "<answer>4</answer>",  # 0: no think
        "<think>x</think>",  # 0: no answer
        "<answer>4</answer><think>x</think>",  # 0: wrong order
        "<think>x</think><answer>4</answer> and more text",  # 0: trailing text
        "<think>x</think><answer>4</answer><answer>5</answer>",  # 0: two answers
        "<think>a<think>b</think><answer>4</answer>",  # 0: nested think
    ]
    assert reward(_samples(completions)) == [1, 1, 0, 0, 0, 0, 0, 0]
    # the template opened the think block in the prompt
    opened = [Sample("<|im_start|>assistant\n<think>\n", "hm</think><answer>4</answer>")]
    assert reward(opened) == [1.0]
    custom = ThinkAnswerFormat(pattern=r"<answer>.*</answer>")
    assert custom(_samples(["<answer>4</answer>", "<think>x</think><answer>4</answer>"])) == [
        1.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="pattern"):
        ThinkAnswerFormat(pattern="(")


def test_overlong_penalty() -> None:
    max_length, cache = 100, 20
    penalty = OverlongPenalty(max_length=max_length, cache_length=cache)
    lengths = [0, 80, 81, 90, 99, 100, 101, 500]
    # DAPO: 0 up to 80, then (80 - L) / 20 up to 100, then -1
    expected = [0.0, 0.0, -1 / 20, -10 / 20, -19 / 20, -1.0, -1.0, -1.0]
    got = penalty([Sample("", "", completion_tokens=n) for n in lengths])
    assert got == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="cache_length"):
        OverlongPenalty(max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="max_length"):
        OverlongPenalty(max_length=0, cache_length=0)


# ----------------------------------------------------------------------------- RewardSet


class Fixed:
    """Returns the given scores (ignoring the samples' content), one per sample."""

    def __init__(self, name: str, values: dict[str, float]) -> None:
        self.name = name
        self.values = values

    def __call__(self, samples):
        return [self.values[s.completion] for s in samples]


class FailsOn:
    """Scores 1.0, but raises for samples whose completion is in ``bad``."""

    name = "fails_on"

    def __init__(self, bad: set[str], error: type[Exception] = RuntimeError) -> None:
        self.bad = bad
        self.error = error
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        for s in samples:
            if s.completion in self.bad:
                raise self.error(f"cannot score {s.completion!r}")
        return [1.0] * len(samples)


def test_reward_set_weights_and_per_reward() -> None:
    a = Fixed("a", {"x": 1.0, "y": 0.0, "z": 0.5})
    b = Fixed("b", {"x": -1.0, "y": 2.0, "z": 4.0})
    samples = _samples(["x", "y", "z"])
    result = RewardSet({"first": a, "second": b}, weights={"first": 2.0, "second": 0.25})(samples)
    assert set(result.per_reward) == {"first", "second"}
    assert result.per_reward["first"].tolist() == [1.0, 0.0, 0.5]  # unweighted
    assert result.per_reward["second"].tolist() == [-1.0, 2.0, 4.0]
    # 2 * a + 0.25 * b, by hand
    assert result.total.tolist() == [2.0 - 0.25, 0.0 + 0.5, 1.0 + 1.0]
    assert result.total.dtype == torch.float32 and result.total.shape == (3,)
    assert result.failures == {"first": 0, "second": 0}
    # a list of rewards is named by `name`; a missing weight is 1
    result = RewardSet([a, b], weights={"b": 3.0})(samples)
    assert result.total.tolist() == [1.0 - 3.0, 0.0 + 6.0, 0.5 + 12.0]
    assert isinstance(a, Reward)


def test_reward_set_counts_and_logs_failures(caplog) -> None:
    flaky = FailsOn({"bad"})
    always = Fixed("ok", {"good": 1.0, "bad": 0.5, "fine": 0.25})
    rewards = RewardSet({"flaky": flaky, "ok": always}, weights={"flaky": 1.0, "ok": 10.0})
    samples = _samples(["good", "bad", "fine"])
    with caplog.at_level(logging.WARNING, logger="tunesmith.rl.rewards.base"):
        result = rewards(samples)
        rewards(samples)  # a second failing batch logs nothing new
    # the batch raised, then each sample was retried alone; only "bad" scores 0
    assert result.per_reward["flaky"].tolist() == [1.0, 0.0, 1.0]
    assert result.failures == {"flaky": 1, "ok": 0}
    assert result.total.tolist() == [11.0, 5.0, 3.5]
    assert flaky.calls == 2 * (1 + 3)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "'flaky'" in messages[0] and "cannot score 'bad'" in messages[0]
    # another exception type is logged once too
    other = RewardSet({"flaky": FailsOn({"bad"}, error=KeyError)})
    with caplog.at_level(logging.WARNING, logger="tunesmith.rl.rewards.base"):
        assert other(samples).failures == {"flaky": 1}
    assert "KeyError" in caplog.records[-1].getMessage()


def test_reward_set_real_components_survive_a_bad_sample() -> None:
    # a sample without a reference: ExactAnswer raises for it alone
    samples = [
        Sample("", "<think>a</think><answer>3</answer>", answer=3),
        Sample("", "<think>a</think><answer>3</answer>"),
    ]
    result = RewardSet([ExactAnswer(), ThinkAnswerFormat()])(samples)
    assert result.per_reward["exact_answer"].tolist() == [1.0, 0.0]
    assert result.failures == {"exact_answer": 1, "think_answer_format": 0}
    assert result.total.tolist() == [2.0, 1.0]


def test_reward_set_refuses_wrong_answers_from_a_reward() -> None:
    class Short:
        name = "short"

        def __call__(self, samples):
            return [1.0] * (len(samples) - 1)

    class NaN:
        name = "nan"

        def __call__(self, samples):
            return [math.nan if s.completion == "b" else 1.0 for s in samples]

    class Inf:
        name = "inf"

        def __call__(self, samples):
            return torch.tensor([1.0, -math.inf])

    samples = _samples(["a", "b"])
    with pytest.raises(ValueError, match="reward 'short' returned 1 scores for 2 samples"):
        RewardSet([Short()])(samples)
    with pytest.raises(
        ValueError, match=r"reward 'nan' returned non-finite scores at samples \[1\]"
    ):
        RewardSet([NaN()])(samples)
    with pytest.raises(ValueError, match="reward 'inf' returned non-finite"):
        RewardSet([Inf()])(samples)


def test_reward_set_construction_errors() -> None:
    a = Fixed("a", {})
    with pytest.raises(ValueError, match=r"weights name \['c'\]"):
        RewardSet({"a": a}, weights={"c": 1.0})
    with pytest.raises(ValueError, match="two rewards are named 'a'"):
        RewardSet([a, Fixed("a", {})])
    with pytest.raises(ValueError, match="no rewards"):
        RewardSet({})
    with pytest.raises(ValueError, match="weight of 'a'"):
        RewardSet({"a": a}, weights={"a": math.inf})
    empty = RewardSet({"a": a})(_samples([]))
    assert empty.total.shape == (0,) and empty.failures == {"a": 0}


def test_reward_set_from_yaml() -> None:
    cfg = OmegaConf.create(
        """
        rewards:
          _component_: tunesmith.rl.rewards.RewardSet
          rewards:
            correct: {_component_: tunesmith.rl.rewards.ExactAnswer, extract: answer_tag}
            format: {_component_: tunesmith.rl.rewards.ThinkAnswerFormat}
            overlong: {_component_: tunesmith.rl.rewards.OverlongPenalty, max_length: 10,
                       cache_length: 4}
          weights: {correct: 1.0, format: 0.2}
        """
    )
    rewards = instantiate(cfg.rewards)
    assert isinstance(rewards, RewardSet)
    assert isinstance(rewards.rewards["correct"], ExactAnswer)
    assert rewards.rewards["correct"].extract == "answer_tag"
    assert rewards.weights == {"correct": 1.0, "format": 0.2, "overlong": 1.0}
    samples = [
        Sample("", "<think>t</think><answer>5</answer>", answer=5, completion_tokens=3),
        Sample("", "<answer>5</answer>", answer=6, completion_tokens=8),
    ]
    result = rewards(samples)
    # 1 + 0.2 * 1 + 0; 0 + 0 + (6 - 8) / 4
    assert result.total.tolist() == pytest.approx([1.2, -0.5])
