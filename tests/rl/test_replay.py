"""The replay buffer: groups by id, used once, never staler than allowed (staler ones dropped
and counted), bounded, and saved as plain data that a checkpoint loads back."""

from __future__ import annotations

import pickle

import pytest
import torch

from tunesmith.rl.asynchronous.pipeline import lead_versions
from tunesmith.rl.asynchronous.replay import ReplayBuffer, group_from_state, group_state
from tunesmith.rl.groups import Group
from tunesmith.rl.prompts import Prompt

PROMPTS = {i: Prompt(i, [{"role": "user", "content": f"q{i}"}], answer=str(i)) for i in range(6)}


def group(round_: int, index: int, version: int, scored: bool = True) -> Group:
    return Group(
        prompt=PROMPTS[index],
        round=round_,
        prompt_ids=[1, 2 + index],
        prompt_text=f"q{index}",
        completions=[[3], [4, 5]],
        logprobs=[[-0.5], [-0.25, -1.0]],
        finish=["stop", "length"],
        texts=["a", "bc"],
        version=version,
        rewards=torch.tensor([1.0, 0.0]) if scored else None,
        per_reward={"r": torch.tensor([1.0, 0.0])},
        ref_logprobs=[[-0.4], [-0.3, -0.9]],
    )


def test_groups_come_out_in_the_asked_order_once_with_their_staleness():
    buffer = ReplayBuffer(max_staleness=1, capacity=4)
    for g in (group(0, 2, 0), group(0, 1, 1), group(1, 3, 1)):
        buffer.put(g)
    assert not buffer.has([(0, 1), (0, 5)]) and buffer.has([(0, 1), (0, 2)])
    taken = buffer.take([(0, 1), (0, 2)], version=1)
    assert [g.id for g in taken] == [(0, 1), (0, 2)]
    assert buffer.staleness == {0: 1, 1: 1} and len(buffer) == 1 and buffer.free == 3
    with pytest.raises(ValueError, match=r"group \(0, 2\) .* arrived twice"):
        buffer.put(group(0, 2, 1))  # used already: never trained on twice
    with pytest.raises(KeyError, match=r"\(0, 2\)"):
        buffer.take([(0, 2)], version=1)


def test_staler_groups_are_dropped_counted_and_refused():
    buffer = ReplayBuffer(max_staleness=1, capacity=4)
    buffer.put(group(0, 0, 0))
    buffer.put(group(0, 1, 2))
    with pytest.raises(
        ValueError, match="policy version 0; an update at version 2 may use versions 1..2"
    ):
        buffer.take([(0, 0)], version=2)
    stale = buffer.drop_stale(version=2)
    assert [g.id for g in stale] == [(0, 0)] and buffer.dropped == 1
    assert buffer.drop_stale(version=2) == [] and len(buffer) == 1
    buffer.put(group(0, 0, 2))  # a dropped group is sampled again: not a duplicate
    assert [g.version for g in buffer.take([(0, 0), (0, 1)], version=2)] == [2, 2]


def test_bad_groups_are_refused():
    buffer = ReplayBuffer(max_staleness=0, capacity=2)
    with pytest.raises(ValueError, match=r"group \(0, 0\) has not been scored"):
        buffer.put(group(0, 0, 0, scored=False))
    buffer.put(group(0, 0, 1))
    with pytest.raises(ValueError, match="newer than the trainer's 0"):
        buffer.take([(0, 0)], version=0)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        ReplayBuffer(max_staleness=-1, capacity=1)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ReplayBuffer(max_staleness=0, capacity=0)


def test_the_state_is_plain_data_and_loads_back():
    buffer = ReplayBuffer(max_staleness=2, capacity=4)
    for g in (group(0, 0, 0), group(1, 4, 1), group(1, 5, 1)):
        buffer.put(g)
    buffer.take([(0, 0)], version=1)
    state = buffer.state_dict()
    plain = pickle.loads(pickle.dumps(state))
    restored = ReplayBuffer(max_staleness=2, capacity=4)
    restored.load_state_dict(plain, PROMPTS)
    assert restored.used == {(0, 0)} and restored.staleness == {1: 1}
    assert list(restored.groups) == [(1, 4), (1, 5)]
    original, back = buffer.groups[(1, 5)], restored.groups[(1, 5)]
    assert group_state(back).keys() == group_state(original).keys()
    for key, value in group_state(original).items():
        other = group_state(back)[key]
        if key == "per_reward":
            assert other.keys() == value.keys()
            assert all(torch.equal(other[k], value[k]) for k in value)
        else:
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
    with pytest.raises(KeyError, match="prompt 9 is not in the prompts"):
        group_from_state({**group_state(original), "prompt_index": 9}, PROMPTS)


def test_a_checkpoint_of_the_buffer_loads_with_weights_only(tmp_path):
    buffer = ReplayBuffer(max_staleness=0, capacity=2)
    buffer.put(group(0, 3, 0))
    torch.save({"buffer": buffer.state_dict()}, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain data only
    restored = ReplayBuffer(max_staleness=0, capacity=2)
    restored.load_state_dict(state["buffer"], PROMPTS)
    assert restored.groups[(0, 3)].completions == [[3], [4, 5]]


def test_how_far_each_mode_lets_rollouts_lag():
    assert lead_versions("sync", 5, 3) == 0
    assert lead_versions("overlap", 5, 3) == 3  # one batch of updates_per_batch updates
    assert lead_versions("off_policy", 5, 3) == 5
    with pytest.raises(ValueError, match="async_mode must be one of"):
        lead_versions("eager", 0, 1)
