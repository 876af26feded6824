"""Groups: one prompt answered ``group_size`` times, the unit RL rollouts are sampled, scored,
buffered and trained in (a group is never split: its advantages are relative to each other).

:func:`sample_groups` answers prompts with any generation function (the policy in this
process, a rollout worker's engine) under keyed sampling: completion ``j`` of a prompt in
collection ``round`` depends only on ``seed``, ``round``, the prompt's index and ``j``, so the
same prompts give the same groups whichever process, batch or worker samples them.
:func:`score_groups` adds the rewards of every completion (one :class:`RewardSet` call for all
the groups, as the synchronous recipe scores a collection).

Example::

    >>> from tunesmith.data import Tokenizer
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> from tunesmith.rl.rewards import RewardSet
    >>> from tunesmith.rl.rewards.strings import StringMatch
    >>> tokenizer = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> def generate_fn(rows, keys):  # the policy's stand-in: "4" for an odd key, else "5"
    ...     seqs = [tokenizer.encode(str(4 + key % 2), add_special_tokens=False) for key in keys]
    ...     return GenerationOutput(seqs, [[-0.7] * len(s) for s in seqs],
    ...                             [len(r) for r in rows], ["stop"] * len(seqs))
    >>> prompts = [Prompt(0, [{"role": "user", "content": "2+2?"}], answer="4")]
    >>> groups = sample_groups(generate_fn, tokenizer, prompts, round=0, group_size=4,
    ...                        seed=0)
    >>> failures = score_groups(RewardSet({"correct": StringMatch()}), groups)
    >>> groups[0].texts, groups[0].rewards
    (['5', '4', '5', '5'], tensor([0., 1., 0., 0.]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tunesmith.generation.generate import GenerationOutput
from tunesmith.generation.keyed import row_key
from tunesmith.rl.envs.base import Environment
from tunesmith.rl.envs.trajectory import (
    EpisodeSettings,
    Trajectory,
    TurnGenerateFn,
    sample_trajectories,
)
from tunesmith.rl.prompts import Prompt, encode_prompt
from tunesmith.rl.rewards import RewardSet, Sample

__all__ = [
    "GenerateFn",
    "Group",
    "episode_failures",
    "sample_groups",
    "sample_trajectory_groups",
    "score_groups",
    "trajectory_group",
]

GenerateFn = Callable[[list[list[int]], list[int]], GenerationOutput]
"""``generate_fn(prompt_rows, row_keys)``: one completion per row, keyed sampling."""


@dataclass
class Group:
    """One prompt's ``group_size`` completions and what is known of them.

    Attributes:
        prompt: the prompt answered.
        round: the collection round that drew it (with the prompt's index, its id).
        prompt_ids / prompt_text: the prompt as the policy saw it.
        completions / logprobs / finish / texts: per completion: the sampled token ids, their
            sampling log-probs, ``"stop"`` or ``"length"``, and the decoded text.
        version: the policy version (optimizer updates done) that sampled it.
        rewards / per_reward: ``[group_size]`` totals and each named reward (after scoring).
        ref_logprobs: per completion, the reference policy's log-probs of its tokens (when
            scored with a reference).
        masks: multi-turn groups (:func:`trajectory_group`): per completion, 1 on the tokens
            the policy sampled, 0 on the environment's observation tokens (not trained; their
            log-probs are 0); None: every completion token is the policy's.
        episodes: multi-turn groups: per completion, what happened (the episode's
            ``summary()`` and its ``messages``), for ``samples.jsonl``.
    """

    prompt: Prompt
    round: int
    prompt_ids: list[int]
    prompt_text: str
    completions: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str]
    texts: list[str]
    version: int = 0
    rewards: torch.Tensor | None = None
    per_reward: dict[str, torch.Tensor] = field(default_factory=dict)
    ref_logprobs: list[list[float]] | None = None
    masks: list[list[int]] | None = None
    episodes: list[dict[str, Any]] | None = None

    @property
    def id(self) -> tuple[int, int]:
        """``(round, prompt index)``: which draw of which prompt this group answers."""
        return (self.round, self.prompt.index)

    @property
    def size(self) -> int:
        return len(self.completions)


def sample_groups(
    generate_fn: GenerateFn,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    round: int,
    group_size: int,
    seed: int,
    chat_template: bool = True,
    version: int = 0,
) -> list[Group]:
    """``group_size`` completions of each prompt, sampled by ``generate_fn`` in one call with
    the keys ``row_key(seed, round, prompt.index, j)``."""
    rows, keys, encoded = [], [], []
    for prompt in prompts:
        ids, text = encode_prompt(tokenizer, prompt, chat_template=chat_template)
        encoded.append((ids, text))
        for j in range(group_size):
            rows.append(ids)
            keys.append(row_key(seed, round, prompt.index, j))
    result = generate_fn(rows, keys)
    groups = []
    for g, prompt in enumerate(prompts):
        part = slice(g * group_size, (g + 1) * group_size)
        sequences = [list(s) for s in result.sequences[part]]
        groups.append(
            Group(
                prompt=prompt,
                round=round,
                prompt_ids=encoded[g][0],
                prompt_text=encoded[g][1],
                completions=sequences,
                logprobs=[list(lp) for lp in result.logprobs[part]],
                finish=list(result.finish_reasons[part]),
                texts=[tokenizer.decode(s, skip_special_tokens=True) for s in sequences],
                version=version,
            )
        )
    return groups


def trajectory_group(
    prompt: Prompt,
    round: int,
    prompt_ids: list[int],
    prompt_text: str,
    trajectories: Sequence[Trajectory],
    version: int = 0,
) -> Group:
    """The group of one prompt's multi-turn ``trajectories``
    (:func:`~tunesmith.rl.envs.trajectory.sample_trajectories`): each completion is everything
    after the prompt (sampled and observation tokens, ``masks`` telling them apart), its text
    the last reply, and it is already scored: ``rewards`` the episodes' rewards,
    ``per_reward`` their terms (0 where an episode has none of a name)."""
    names = sorted({name for t in trajectories for name in t.episode.terms})
    return Group(
        prompt=prompt,
        round=round,
        prompt_ids=list(prompt_ids),
        prompt_text=prompt_text,
        completions=[t.ids for t in trajectories],
        logprobs=[t.logprobs for t in trajectories],
        finish=[t.finish for t in trajectories],
        texts=[t.answer for t in trajectories],
        version=version,
        rewards=torch.tensor([t.episode.reward for t in trajectories], dtype=torch.float32),
        per_reward={
            name: torch.tensor([t.episode.terms.get(name, 0.0) for t in trajectories])
            for name in names
        },
        masks=[t.mask for t in trajectories],
        episodes=[{**t.episode.summary(), "messages": t.episode.messages} for t in trajectories],
    )


def sample_trajectory_groups(
    generate_fn: TurnGenerateFn,
    tokenizer: Any,
    environment: Environment,
    prompts: Sequence[Prompt],
    *,
    round: int,
    group_size: int,
    seed: int,
    episode: EpisodeSettings,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    version: int = 0,
    keep_going: Callable[[bool], bool] = bool,
) -> list[Group]:
    """:func:`sample_groups` for an ``environment``: ``group_size`` multi-turn trajectories of
    each prompt (:func:`~tunesmith.rl.envs.trajectory.sample_trajectories`), scored by their
    episodes (:func:`trajectory_group`). ``keep_going(any_live)``: whether to sample another
    turn (all data-parallel ranks must decode together: True while any rank has a live
    trajectory)."""
    sampled = sample_trajectories(
        generate_fn,
        tokenizer,
        environment,
        prompts,
        round=round,
        group_size=group_size,
        seed=seed,
        settings=episode,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        keep_going=keep_going,
    )
    return [
        trajectory_group(prompt, round, ids, text, trajectories, version)
        for prompt, (ids, text, trajectories) in zip(prompts, sampled)
    ]


def episode_failures(groups: Sequence[Group]) -> dict[str, int]:
    """How many trajectories of multi-turn ``groups`` ended in an error or a timeout (``env:
    error``, ``env: timeout``): counted with the reward failures.

    Example::

        >>> episode_failures([])
        {}
    """
    failures: dict[str, int] = {}
    for g in groups:
        for summary in g.episodes or []:
            if summary["ended"] in ("error", "timeout"):
                key = f"env: {summary['ended']}"
                failures[key] = failures.get(key, 0) + 1
    return failures


def score_groups(rewards: RewardSet, groups: Sequence[Group]) -> dict[str, int]:
    """Score every completion of ``groups`` (one ``rewards`` call) into ``group.rewards`` and
    ``group.per_reward`` (added to what a multi-turn group's environment gave:
    :func:`trajectory_group`); returns the reward functions' failure counts."""
    samples = [
        Sample(
            prompt=g.prompt_text,
            completion=text,
            answer=g.prompt.answer,
            metadata=g.prompt.metadata,
            completion_tokens=len(tokens),
            finish_reason=finish,
        )
        for g in groups
        for text, tokens, finish in zip(g.texts, g.completions, g.finish)
    ]
    scored = rewards(samples)
    start = 0
    for g in groups:
        part = slice(start, start + g.size)
        before = g.rewards if g.episodes is not None else None  # the environment's
        g.rewards = scored.total[part] if before is None else before + scored.total[part]
        g.per_reward = {
            **(g.per_reward if before is not None else {}),
            **{name: values[part] for name, values in scored.per_reward.items()},
        }
        start += g.size
    return dict(scored.failures)
