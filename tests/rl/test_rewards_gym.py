"""ReasoningGymScore on real reasoning-gym entries: the right answer scores 1, a wrong one
less, whichever dataset the entry comes from."""

from __future__ import annotations

import pytest
import reasoning_gym

from tunesmith.rl.rewards import ReasoningGymScore, RewardSet, Sample


def _sample(entry: dict, completion: str) -> Sample:
    return Sample(
        entry["question"], completion, answer=entry["answer"], metadata={"gym_entry": entry}
    )


def test_basic_arithmetic_right_and_wrong() -> None:
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=0))
    reward = ReasoningGymScore()
    right = [_sample(e, f"<think>compute</think><answer>{e['answer']}</answer>") for e in entries]
    # the reference is an integer here; one more is wrong
    wrong = [_sample(e, f"<answer>{int(e['answer']) + 1}</answer>") for e in entries]
    assert reward(right) == [1.0] * 5
    assert all(score < 1.0 for score in reward(wrong))
    # no answer tag: the whole completion is the answer
    assert reward([_sample(entries[0], f"  {entries[0]['answer']}\n")]) == [1.0]


def test_the_entry_names_its_dataset() -> None:
    entry = reasoning_gym.create_dataset("spell_backward", size=1, seed=3)[0]
    reward = ReasoningGymScore()
    assert reward([_sample(entry, f"<answer>{entry['answer']}</answer>")]) == [1.0]
    assert reward([_sample(entry, "<answer>certainly not this</answer>")])[0] < 1.0


def test_a_sample_without_an_entry_is_a_counted_failure() -> None:
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1)[0]
    samples = [
        _sample(entry, f"<answer>{entry['answer']}</answer>"),
        Sample("q", "<answer>1</answer>"),
    ]
    result = RewardSet([ReasoningGymScore()])(samples)
    assert result.per_reward["reasoning_gym"].tolist() == [1.0, 0.0]
    assert result.failures == {"reasoning_gym": 1}
    with pytest.raises(KeyError, match="gym_entry"):
        ReasoningGymScore()([samples[1]])
