"""Held-out rewards: the policy answers each prompt once, greedily, and the rewards score it.

Data-parallel rank ``r`` takes prompts ``r, r + dp_size, ...``; all ranks decode together (a
sharded model needs every forward on all ranks) and the per-reward sums are all-reduced, so
the numbers do not depend on the number of ranks.

Example::

    scores = evaluate_rewards(model, tokenizer, prompts, rewards, ctx,
                              max_new_tokens=64)
    scores["val_reward/correct"]
    # -> 0.62
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.rl.envs.base import Environment
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.rl.groups import sample_trajectory_groups, score_groups
from tunesmith.rl.prompts import Prompt, encode_prompt
from tunesmith.rl.rewards import RewardSet, Sample
from tunesmith.training.parallel.distributed import DistributedContext

__all__ = ["evaluate_environment", "evaluate_rewards"]


@torch.no_grad()
def evaluate_rewards(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    rewards: RewardSet,
    ctx: DistributedContext,
    *,
    max_new_tokens: int,
    batch_size: int = 16,
    stop_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    chat_template: bool = True,
) -> dict[str, float]:
    """``val_reward`` (the weighted total) and ``val_reward/<name>`` (each reward) averaged
    over ``prompts``, greedy decoding, the model's mode restored after."""
    mine, rounds = _my_share(len(prompts), batch_size, ctx)
    engine, greedy = _greedy(model, tokenizer, ctx, max_new_tokens, stop_strings)
    sums: dict[str, float] = {}
    for i in range(rounds):
        chunk = [prompts[j] for j in mine[i * batch_size : (i + 1) * batch_size]]
        counted = bool(chunk)
        chunk = chunk or [prompts[0]]  # a rank out of prompts still decodes (discarded)
        encoded = [encode_prompt(tokenizer, p, chat_template=chat_template) for p in chunk]
        out = generate_with(engine, [ids for ids, _ in encoded], None, greedy, stop_token_ids)
        if not counted:
            continue
        samples = [
            Sample(
                prompt=text,
                completion=tokenizer.decode(seq, skip_special_tokens=True),
                answer=p.answer,
                metadata=p.metadata,
                completion_tokens=len(seq),
                finish_reason=reason,
            )
            for p, (_, text), seq, reason in zip(chunk, encoded, out.sequences, out.finish_reasons)
        ]
        scored = rewards(samples)
        _add(sums, "val_reward", float(scored.total.sum()))
        for name, values in scored.per_reward.items():
            _add(sums, f"val_reward/{name}", float(values.sum()))
    keys = ["val_reward", *(f"val_reward/{name}" for name in sorted(rewards.rewards))]
    return _means(sums, keys, len(prompts), ctx)


@torch.no_grad()
def evaluate_environment(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    environment: Environment,
    ctx: DistributedContext,
    *,
    episode: EpisodeSettings,
    max_new_tokens: int,
    rewards: RewardSet | None = None,
    batch_size: int = 16,
    stop_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
) -> dict[str, float]:
    """:func:`evaluate_rewards` for multi-turn runs: one greedy trajectory per prompt in
    ``environment`` (:func:`~tunesmith.rl.groups.sample_trajectory_groups`), scored by its
    episode (plus ``rewards`` of the last reply when given). ``val_reward`` (the total),
    ``val_reward/<term>`` (each term and reward), ``val_env/turns`` and ``val_env/done`` (the
    share of trajectories the environment ended), averaged over ``prompts``."""
    mine, rounds = _my_share(len(prompts), batch_size, ctx)
    engine, greedy = _greedy(model, tokenizer, ctx, max_new_tokens, stop_strings)

    def generate(rows: list[list[int]], keys: list[int], limits: list[int]) -> Any:
        return generate_with(engine, rows, None, greedy, stop_token_ids, max_new_tokens=limits)

    def any_rank(flag: bool) -> bool:
        if ctx.world_size == 1:
            return flag
        value = torch.tensor(float(flag), device=ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    sums: dict[str, float] = {}
    for i in range(rounds):
        chunk = [prompts[j] for j in mine[i * batch_size : (i + 1) * batch_size]]
        counted = bool(chunk)
        with engine.keep_prefixes():  # each turn continues its conversation's cache
            groups = sample_trajectory_groups(
                generate, tokenizer, environment, chunk or [prompts[0]], round=0, group_size=1,
                seed=0, episode=episode, max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids, keep_going=any_rank,
            )  # fmt: skip
        if not counted:  # a rank out of prompts still decodes (discarded)
            continue
        if rewards is not None:
            score_groups(rewards, groups)
        for g in groups:
            _add(sums, "val_reward", float(g.rewards.sum()))
            for name, values in g.per_reward.items():
                _add(sums, f"val_reward/{name}", float(values.sum()))
            for summary in g.episodes or []:
                _add(sums, "val_env/turns", float(summary["turns"]))
                _add(sums, "val_env/done", float(summary["ended"] == "done"))
    names = set(sums) | {"val_reward", "val_env/turns", "val_env/done"}
    if ctx.world_size > 1:  # the terms any rank saw
        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, sorted(names))
        names = {n for rank_names in every for n in rank_names}
    return _means(sums, sorted(names), len(prompts), ctx)


def _my_share(n: int, batch_size: int, ctx: DistributedContext) -> tuple[list[int], int]:
    """This rank's prompt indices (``r, r + dp_size, ...``) and the number of batches every
    rank runs (the busiest rank's: a sharded model needs every forward on all ranks)."""
    mine = list(range(ctx.dp_rank, n, ctx.dp_size))
    rounds = -(-len(mine) // batch_size)
    if ctx.world_size > 1:
        count = torch.tensor(rounds, device=ctx.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rounds = int(count.item())
    return mine, rounds


def _greedy(
    model: nn.Module,
    tokenizer: Any,
    ctx: DistributedContext,
    max_new_tokens: int,
    stop_strings: Sequence[str],
) -> tuple[LocalEngine, GenerationConfig]:
    """The engine and the greedy decoding of a held-out evaluation."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    engine = LocalEngine(model, tokenizer, pad_id=pad_id, sync_ranks=ctx.world_size > 1)
    greedy = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_strings=list(stop_strings)
    )
    return engine, greedy


def _means(
    sums: dict[str, float], keys: Sequence[str], n: int, ctx: DistributedContext
) -> dict[str, float]:
    """``sums`` of ``keys`` summed over the data-parallel ranks, divided by ``n``."""
    totals = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64)
    if ctx.world_size > 1:
        totals = totals.to(ctx.device)
        dist.all_reduce(totals, group=ctx.dp_group)
    return {k: v / max(n, 1) for k, v in zip(keys, totals.tolist())}


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value
