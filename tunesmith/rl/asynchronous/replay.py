"""The replay buffer of asynchronous RL: scored groups waiting for the trainer, each with the
policy version (optimizer updates done) that sampled it.

The trainer takes a step's groups by id (``(round, prompt index)``, in the order the step
drew its prompts) when all of them have arrived. A group is used at most once (a second use
is an error), never split, and never staler than ``max_staleness`` versions: an older one is
dropped, counted, and handed back so that its prompt is sampled again by the current policy.
Groups a step drew but does not need (dynamic sampling's spares) are discarded, never used.
Its memory is bounded by ``capacity`` groups (the producer asks :attr:`ReplayBuffer.free`
before sampling more). :meth:`state_dict` is plain data (a checkpoint holds the groups that
were waiting); the prompts are looked up again by index on load.

Example::

    >>> group = Group(Prompt(0, [{"role": "user", "content": "2+2?"}]), round=0, prompt_ids=[1],
    ...               prompt_text="2+2?", completions=[[4]], logprobs=[[-0.1]], finish=["stop"],
    ...               texts=["4"], version=0, rewards=torch.tensor([1.0]))  # a scored group
    >>> buffer = ReplayBuffer(max_staleness=1, capacity=8)
    >>> buffer.put(group)
    >>> stale = buffer.drop_stale(version=1)
    >>> groups = buffer.take([group.id], version=1)
    >>> stale, groups == [group], buffer.staleness
    ([], True, Counter({1: 1}))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from tunesmith.rl.groups import Group
from tunesmith.rl.prompts import Prompt

__all__ = ["ReplayBuffer", "group_from_state", "group_state"]

GroupId = tuple[int, int]


class ReplayBuffer:
    """Scored groups by id, with staleness accounting (see the module docs)."""

    def __init__(self, *, max_staleness: int, capacity: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {capacity}")
        self.max_staleness, self.capacity = int(max_staleness), int(capacity)
        self.groups: dict[GroupId, Group] = {}
        self.used: set[GroupId] = set()
        self.staleness: Counter[int] = Counter()  # versions behind, per group used
        self.dropped = 0  # groups too stale when their step came

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def free(self) -> int:
        """Groups that may still be added before the buffer is full."""
        return self.capacity - len(self.groups)

    def put(self, group: Group) -> None:
        """Add a scored group; one with the id of a waiting or used group is refused."""
        if group.id in self.groups or group.id in self.used:
            raise ValueError(f"replay buffer: group {group.id} (round, prompt index) arrived twice")
        if group.rewards is None:
            raise ValueError(f"replay buffer: group {group.id} has not been scored")
        self.groups[group.id] = group

    def has(self, ids: Iterable[GroupId]) -> bool:
        """Whether every group of ``ids`` is waiting."""
        return all(i in self.groups for i in ids)

    def drop_stale(self, version: int) -> list[Group]:
        """Remove (and count) the groups more than ``max_staleness`` versions older than
        ``version``: they could only be trained on staler still. Sample their prompts again."""
        stale = [g for g in self.groups.values() if version - g.version > self.max_staleness]
        for group in stale:
            del self.groups[group.id]
        self.dropped += len(stale)
        return stale

    def take(self, ids: Sequence[GroupId], version: int) -> list[Group]:
        """Remove the groups of ``ids`` (in that order) for an update at policy ``version``;
        each must be waiting and at most ``max_staleness`` versions old."""
        missing = [i for i in ids if i not in self.groups]
        if missing:
            raise KeyError(f"replay buffer: groups {missing} have not arrived")
        groups = []
        for i in ids:
            behind = version - self.groups[i].version
            if behind < 0:
                raise ValueError(
                    f"replay buffer: group {i} was sampled by policy version "
                    f"{self.groups[i].version}, newer than the trainer's {version}"
                )
            if behind > self.max_staleness:
                raise ValueError(
                    f"replay buffer: group {i} was sampled by policy version "
                    f"{self.groups[i].version}; an update at version {version} may use versions "
                    f"{version - self.max_staleness}..{version} (drop_stale() first)"
                )
        for i in ids:
            group = self.groups.pop(i)
            self.used.add(i)
            self.staleness[version - group.version] += 1
            groups.append(group)
        return groups

    def discard(self, ids: Sequence[GroupId]) -> None:
        """Remove the waiting groups of ``ids`` unused (dynamic sampling's groups that a batch
        does not need); like used groups, they may not arrive again."""
        missing = [i for i in ids if i not in self.groups]
        if missing:
            raise KeyError(f"replay buffer: groups {missing} to discard are not waiting")
        for i in ids:
            del self.groups[i]
            self.used.add(i)

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [group_state(g) for g in self.groups.values()],
            "used": sorted(list(i) for i in self.used),
            "staleness": {str(k): v for k, v in self.staleness.items()},
            "dropped": self.dropped,
        }

    def load_state_dict(self, state: Mapping[str, Any], prompts: Mapping[int, Prompt]) -> None:
        """Restore from :meth:`state_dict`; ``prompts`` maps a prompt index to its prompt."""
        self.groups = {}
        for item in state["groups"]:
            group = group_from_state(item, prompts)
            self.groups[group.id] = group
        self.used = {(int(r), int(p)) for r, p in state["used"]}
        self.staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        self.dropped = int(state["dropped"])


_LISTS = ("prompt_ids", "completions", "logprobs", "finish", "texts")


def group_state(group: Group) -> dict[str, Any]:
    """``group`` as plain data (tensors, lists, numbers, strings): the prompt by its index."""
    state: dict[str, Any] = {name: getattr(group, name) for name in _LISTS}
    state |= {
        "prompt_index": group.prompt.index,
        "round": group.round,
        "prompt_text": group.prompt_text,
        "version": group.version,
        "rewards": group.rewards,
        "per_reward": dict(group.per_reward),
        "ref_logprobs": group.ref_logprobs,
    }
    return state


def group_from_state(state: Mapping[str, Any], prompts: Mapping[int, Prompt]) -> Group:
    """The group :func:`group_state` saved; its prompt looked up in ``prompts`` by index."""
    index = int(state["prompt_index"])
    if index not in prompts:
        raise KeyError(
            f"replay buffer state: prompt {index} is not in the prompts (another dataset?)"
        )
    rewards = state["rewards"]
    return Group(
        prompt=prompts[index],
        round=int(state["round"]),
        prompt_text=state["prompt_text"],
        **{name: list(state[name]) for name in _LISTS},
        version=int(state["version"]),
        rewards=None if rewards is None else torch.as_tensor(rewards),
        per_reward=dict(state["per_reward"]),
        ref_logprobs=state["ref_logprobs"],
    )
