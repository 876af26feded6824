"""Online preference pairs: a :class:`~tunesmith.training.sources.BatchSource` whose DPO pairs
the policy samples and a judge ranks, step by step (online DPO, Guo et al. 2024,
arXiv 2402.04792).

1. **sample**: :class:`~tunesmith.rl.source.LocalGroups`, the synchronous RL recipes' sample
   stage: this rank's share of ``prompts_per_step`` prompts, each answered ``group_size``
   (``k >= 2``) times by the policy under keyed sampling (the same completions on any number
   of ranks and after a resume), every completion scored by a
   :class:`~tunesmith.rl.rewards.RewardSet` (verifiable rewards, a reward model through
   :class:`~tunesmith.rl.rewards.RewardModelScore`, any weighted mix): the judge.
2. **pairs** (:func:`select_pair`): in each group the highest-scored completion is chosen and
   the lowest-scored one rejected; a group whose scores are all equal (a tie) gives no pair.
3. **rows** (:func:`pair_rows`): each pair as the two rows of a preference sample (prompt +
   completion, labels on the completion only), collated by
   :func:`~tunesmith.data.collate.collate_preference` into micro-batches of ``batch_size``
   pairs (chosen rows then rejected rows). Every data-parallel rank runs as many micro-batches
   (a sharded model needs the same forwards on all ranks): a rank with fewer pairs adds
   *filler* micro-batches, which :class:`OnlinePreference` counts as no pair and trains
   nothing on. A step with no pair on any rank is an empty step (no update).

The state (prompt position, collection round, the current batch while it is trained on) is
saved with every checkpoint, so a resumed run continues exactly.

Example::

    >>> group = _example_group([0.25, 1.0, 0.25, 0.0])  # scored by the judge
    >>> pair = select_pair(group)
    >>> pair.chosen, pair.rejected, pair.scores
    (1, 3, (1.0, 0.0))
    >>> select_pair(_example_group([0.5, 0.5])) is None  # a tie: no pair
    True
    >>> pair_rows(pair)["chosen_labels"]  # prompt [5, 6], completion [9, 9]
    [-100, 9, 9, -100]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunesmith.data import collate_preference
from tunesmith.data.labels import IGNORE_INDEX
from tunesmith.models.atomic import open_no_follow
from tunesmith.rl.groups import Group
from tunesmith.rl.prompts import Prompt, PromptStream
from tunesmith.rl.source import (
    CollectionCycle,
    LocalGroups,
    Rollouts,
    RolloutSettings,
    SampleStage,
    all_reduce_values,
    stop_token_ids,
)
from tunesmith.training.objectives.preference import PreferenceObjective
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.trainer import LossOutput

__all__ = [
    "FILLER",
    "OnlinePairs",
    "OnlinePreference",
    "Pair",
    "filler_batch",
    "pair_metrics",
    "pair_rows",
    "select_pair",
]

Batch = dict[str, torch.Tensor]

FILLER = "filler"
"""The key of a filler micro-batch (present only there): no pair, nothing trained on."""


@dataclass(frozen=True)
class Pair:
    """One group's chosen and rejected completion (their indices in the group)."""

    group: Group
    chosen: int
    rejected: int

    @property
    def scores(self) -> tuple[float, float]:
        """The judge's scores of the chosen and the rejected completion."""
        rewards = self.group.rewards
        return float(rewards[self.chosen]), float(rewards[self.rejected])


def select_pair(group: Group) -> Pair | None:
    """The scored ``group``'s pair: its highest-scored completion chosen, its lowest-scored
    one rejected (the first of equal ones); None when all its scores are equal (a tie).

    >>> pair = select_pair(_example_group([1.0, 3.0, 3.0, 0.0]))
    >>> pair.chosen, pair.rejected
    (1, 3)
    """
    if group.rewards is None:
        raise ValueError(f"group {group.id} is not scored: score it before selecting its pair")
    if group.size < 2:
        raise ValueError(f"group {group.id} has {group.size} completion(s): a pair needs 2")
    high, low = int(torch.argmax(group.rewards)), int(torch.argmin(group.rewards))
    if group.rewards[high] == group.rewards[low]:
        return None
    return Pair(group, high, low)


def _side(prompt_ids: Sequence[int], completion: Sequence[int]) -> tuple[list[int], list[int]]:
    """One row's ids and shifted labels: the completion's tokens at their label positions."""
    ids = list(prompt_ids) + list(completion)
    labels = [IGNORE_INDEX] * len(ids)
    start = len(prompt_ids) - 1
    labels[start : start + len(completion)] = list(completion)
    return ids, labels


def pair_rows(pair: Pair) -> dict[str, list[int]]:
    """``pair`` as a preference sample (what
    :func:`~tunesmith.data.collate.collate_preference` batches): prompt + completion ids of
    each side, labels on the completion only (shifted, as everywhere in tunesmith)."""
    g = pair.group
    chosen = _side(g.prompt_ids, g.completions[pair.chosen])
    rejected = _side(g.prompt_ids, g.completions[pair.rejected])
    return {
        "chosen_input_ids": chosen[0], "chosen_labels": chosen[1],
        "rejected_input_ids": rejected[0], "rejected_labels": rejected[1],
        "prompt_len": len(g.prompt_ids),
    }  # fmt: skip


def filler_batch(pad_id: int) -> Batch:
    """A filler micro-batch: one pair of one padding token each, its label the padding token
    (finite log-probs for every loss), no attention (no token seen), marked :data:`FILLER`.

    >>> sorted(filler_batch(0))
    ['attention_mask', 'filler', 'input_ids', 'labels', 'position_ids']
    """
    ids = torch.full((2, 1), pad_id, dtype=torch.long)
    return {
        "input_ids": ids, "labels": ids.clone(), "attention_mask": torch.zeros_like(ids),
        "position_ids": torch.zeros_like(ids), FILLER: torch.ones(2),
    }  # fmt: skip


class OnlinePreference(PreferenceObjective):
    """:class:`~tunesmith.training.objectives.preference.PreferenceObjective` that trains
    nothing on a filler micro-batch (:func:`filler_batch`): it counts no pair, and its loss,
    auxiliary loss and metrics are multiplied by zero (the forwards still run, as every
    rank's must under FSDP2).

    Example::

        >>> from tunesmith.modules.losses import DPOLoss
        >>> OnlinePreference(DPOLoss(), reference=None).units(filler_batch(0))
        0
    """

    def units(self, batch: Batch) -> int:
        return 0 if FILLER in batch else super().units(batch)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        out = super().__call__(model, batch)
        if FILLER not in batch:
            return out
        aux = None if out.aux_loss is None else out.aux_loss * 0
        return LossOutput(out.loss * 0, {k: v * 0 for k, v in out.metrics.items()}, aux)


class OnlinePairs(CollectionCycle):
    """Preference pairs sampled by the policy and ranked by the judge, as a batch source (see
    the module docs). ``sample``: the sample stage (default: :class:`LocalGroups` of ``model``
    scored by ``rewards``); ``settings.micro_batch_size``: pairs per micro-batch.

    Example::

        source = OnlinePairs(model=model, tokenizer=tok, prompts=stream, rewards=judge,
                             ctx=ctx, settings=rollout_settings(cfg), pad_id=pad_id(tok))
        micro_batches = source.next_step()  # chosen rows then rejected rows, each
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        prompts: PromptStream,
        ctx: DistributedContext,
        settings: RolloutSettings,
        pad_id: int,
        rewards: Any = None,
        sample: SampleStage | None = None,
    ) -> None:
        if settings.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 for preference pairs (a chosen and a rejected "
                f"completion of each prompt), got {settings.group_size}"
            )
        if sample is None:
            sample = LocalGroups(model, tokenizer, prompts, rewards, ctx, settings)
        self.prompts, self.ctx, self.settings, self.pad_id = prompts, ctx, settings, pad_id
        self.sample: SampleStage = sample
        # what an evaluator decoding as the source does stops at
        self.stop_token_ids = stop_token_ids(tokenizer, settings.generation.stop_tokens)
        self._start_cycle()

    COLLECTED_KEY = "micro_batches"  # a collection here is already its micro-batches

    def _step_batches(self, collected: list[Batch]) -> list[Batch]:
        return list(collected)

    # -- one collection

    @torch.no_grad()
    def _collect(self) -> list[Batch]:
        rollouts = self.sample(self.batches)
        self.epoch = rollouts.epoch
        pairs = [p for p in map(select_pair, rollouts.groups) if p is not None]
        size = self.settings.micro_batch_size
        micro = [
            collate_preference([pair_rows(p) for p in pairs[i : i + size]], pad_id=self.pad_id)
            for i in range(0, len(pairs), size)
        ]
        fillers = _most(len(micro), self.ctx) - len(micro)
        micro += [filler_batch(self.pad_id) for _ in range(fillers)]
        self._metrics = pair_metrics(rollouts, pairs, self.ctx, fillers=fillers)
        self._log_samples(pairs)
        return micro

    def _log_samples(self, pairs: Sequence[Pair]) -> None:
        """Every ``log_samples_every`` batches, rank 0's first pair to ``samples_file``."""
        s = self.settings
        if not (s.samples_file and s.log_samples_every and self.ctx.is_rank_zero and pairs):
            return
        if self.batches % s.log_samples_every:
            return
        pair, g = pairs[0], pairs[0].group
        record = {
            "batch": self.batches + 1, "prompt": g.prompt_text,
            "chosen": g.texts[pair.chosen], "rejected": g.texts[pair.rejected],
            "scores": list(pair.scores), "completions": g.texts, "rewards": g.rewards.tolist(),
        }  # fmt: skip
        path = Path(s.samples_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_no_follow(path, "a") as f:  # a planted link: refused
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _most(count: int, ctx: DistributedContext) -> int:
    """The largest ``count`` of the data-parallel ranks."""
    return int(all_reduce_values({"n": float(count)}, ctx, dist.ReduceOp.MAX)["n"])


def pair_metrics(
    rollouts: Rollouts, pairs: Sequence[Pair], ctx: DistributedContext, fillers: int = 0
) -> dict[str, float]:
    """A collection's metrics over all data-parallel ranks: the judge's mean score of every
    completion (``reward``) and of the chosen and rejected ones (``score/chosen``,
    ``score/rejected``, ``score/margin``), ``tied_groups`` (groups that gave no pair),
    ``filler_micro_batches`` (``fillers``: this rank's), completion lengths, the share that
    ended on a stop token, and the sampling times."""
    groups = rollouts.groups
    lengths = [len(c) for g in groups for c in g.completions]
    scores = [p.scores for p in pairs]
    sums = {
        "samples": float(len(lengths)), "length_sum": float(sum(lengths)),
        "reward_sum": float(sum(float(g.rewards.sum()) for g in groups)),
        "stopped": float(sum(f == "stop" for g in groups for f in g.finish)),
        "pairs": float(len(pairs)), "ties": float(len(groups) - len(pairs)),
        "chosen": sum(c for c, _ in scores), "rejected": sum(r for _, r in scores),
        "failures": float(sum(rollouts.failures.values())), "fillers": float(fillers),
        **{f"t/{k}": float(v) for k, v in rollouts.times.items()},
    }  # fmt: skip
    longest = all_reduce_values({"n": float(max(lengths, default=0))}, ctx, dist.ReduceOp.MAX)["n"]
    sums = all_reduce_values(sums, ctx, dist.ReduceOp.SUM)
    n, paired, ranks = max(sums["samples"], 1.0), max(sums["pairs"], 1.0), ctx.dp_size
    generate_s = sums["t/generate_s"] / ranks
    return {
        "reward": sums["reward_sum"] / n,
        "score/chosen": sums["chosen"] / paired, "score/rejected": sums["rejected"] / paired,
        "score/margin": (sums["chosen"] - sums["rejected"]) / paired,
        "tied_groups": sums["ties"], "filler_micro_batches": sums["fillers"],
        "reward_failures": sums["failures"],
        "completion_length": sums["length_sum"] / n, "completion_length_max": longest,
        "stopped_fraction": sums["stopped"] / n,
        "generate_s": generate_s, "reward_s": sums["t/reward_s"] / ranks,
        "generated_tokens_per_s": sums.get("t/generated_tokens", 0.0) / max(generate_s, 1e-9),
    }  # fmt: skip


def _example_group(rewards: Sequence[float]) -> Group:
    """A scored group of ``len(rewards)`` two-token completions of a two-token prompt (for the
    examples)."""
    k = len(rewards)
    return Group(
        Prompt(0, [{"role": "user", "content": "2+2?"}], answer="4"), round=0,
        prompt_ids=[5, 6], prompt_text="2+2?", completions=[[9, 9]] * k,
        logprobs=[[-1.0, -1.0]] * k, finish=["stop"] * k, texts=["4"] * k,
        rewards=torch.tensor(rewards),
    )  # fmt: skip
