"""On-policy distillation's batch source (GKD, Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes"): each optimizer step trains the
student on the dataset's prompts, answered with probability ``lmbda`` by the student itself,
else by the dataset (or, with ``seq_kd``, by the teacher).

:class:`OnPolicyDistillationSource` reads SFT samples (``input_ids`` and shifted ``labels``)
as a :class:`~tunesmith.training.sources.DatasetSource` does, then per step:

1. **the draw** (:func:`on_policy_step`): ``random.Random(row_key(seed, step)) < lmbda``, the
   same on every rank and after a resume;
2. **the rows**: on a dataset step the samples as they are (collated as the ``kd`` recipe
   collates them); otherwise each sample is cut to its prompt (:func:`split_sample`: the tokens
   before its last trained span) and answered by the student (on-policy) or the teacher
   (``seq_kd``) through :func:`~tunesmith.generation.engine.generate_with`, keyed sampling with
   ``row_key(seed, step, sample index)``: a completion depends on neither the rank nor the
   batch it is decoded in. Labels: the completion tokens only
   (:func:`~tunesmith.rl.rollout.rollout_batch`);
3. **metrics** over the data-parallel ranks (:meth:`step_metrics`): ``on_policy`` (1 or 0),
   ``completion_length`` / ``completion_length_max`` (the trained tokens of a row) and
   ``generate_s``.

Its state (the loader's position and the steps made) is saved with every checkpoint. Teacher
and student must share one tokenizer (:func:`check_shared_tokenizer`).

Example::

    source = OnPolicyDistillationSource.build(
        dataset, collate, LoopSettings.from_config(cfg), ctx, student=model, teacher=None,
        tokenizer=tokenizer, settings=GKDSettings(lmbda=0.5), generation=GenerationConfig())
    micro_batches = source.next_step()
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunesmith.generation.config import GenerationConfig
from tunesmith.generation.engine import LocalEngine, generate_with
from tunesmith.generation.keyed import row_key
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.rl.rollout import rollout_batch
from tunesmith.rl.source import all_reduce_values, stop_token_ids
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.rules import flag, number
from tunesmith.training.settings import LoopSettings, Settings, setting
from tunesmith.training.setup import pad_id
from tunesmith.training.sources import DatasetSource

__all__ = [
    "GKDSettings",
    "OnPolicyDistillationSource",
    "check_shared_tokenizer",
    "on_policy_step",
    "split_sample",
]

Batch = dict[str, torch.Tensor]
Sample = dict[str, Sequence[int]]


@dataclass(frozen=True)
class GKDSettings(Settings):
    """On-policy distillation's own keys (TRL's ``GKDConfig`` names).

    >>> GKDSettings().lmbda, GKDSettings(lmbda=1.0, seq_kd=True).seq_kd
    (0.5, True)
    """

    lmbda: float = setting(
        0.5,
        number(at_least=0, at_most=1),
        "share of steps trained on the student's own completions (keyed draw per step)",
    )
    seq_kd: bool = setting(
        False, flag(), "the other steps train on the teacher's completions, not the dataset's"
    )


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether step ``step`` (0 first) trains on the student's completions: a uniform draw
    keyed by ``seed`` and ``step`` alone, below ``lmbda``.

    >>> on_policy_step(0, 3, 1.0), on_policy_step(0, 3, 0.0)
    (True, False)
    >>> sum(on_policy_step(0, s, 0.5) for s in range(1000)) in range(450, 551)
    True
    """
    return random.Random(row_key(seed, step)).random() < lmbda


def split_sample(sample: Sample, index: int) -> tuple[list[int], list[int]]:
    """``(prompt, completion)`` token ids of an SFT sample (labels shifted: ``labels[t]`` is
    ``input_ids[t + 1]`` where trained): the completion is its last trained span, the prompt
    every token before it.

    >>> split_sample({"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 7, 8, -100, -100]}, 0)
    ([5, 6], [7, 8])
    >>> split_sample({"input_ids": [5, 6], "labels": [-100, -100]}, 3)
    Traceback (most recent call last):
    ValueError: sample 3 of the dataset trains no token: it has no completion to answer
    """
    labels = list(sample["labels"])
    trained = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
    if not trained:
        raise ValueError(
            f"sample {index} of the dataset trains no token: it has no completion to answer"
        )
    end = trained[-1]
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    ids = list(sample["input_ids"])
    return ids[: start + 1], ids[start + 1 : end + 2]


def check_shared_tokenizer(student: Any, teacher: Any) -> None:
    """Refuse a teacher tokenizer whose token ids differ from the student's: the teacher scores
    (and with ``seq_kd`` writes) the student's token ids, so both must read them alike.

    Example::

        check_shared_tokenizer(load_tokenizer(cfg), instantiate(cfg.teacher_tokenizer))
    """
    mine, theirs = student.backend.get_vocab(True), teacher.backend.get_vocab(True)
    if mine == theirs:
        return
    token = min(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[0]
    raise ValueError(
        f"the student's tokenizer {student.name} ({student.vocab_size} ids) and the teacher's "
        f"tokenizer {teacher.name} ({teacher.vocab_size} ids) differ (token {token!r} is id "
        f"{mine.get(token)} vs {theirs.get(token)}): on-policy distillation scores the "
        "student's token ids with the teacher, so both need one tokenizer"
    )


class _Indexed(Sequence):
    """``dataset`` whose items are ``(index, sample)``: the key of a sample's completion."""

    def __init__(self, dataset: Sequence[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


class OnPolicyDistillationSource:
    """The batch source of on-policy distillation (see the module docs): ``data`` yields
    ``(index, sample)`` lists (a :class:`DatasetSource` over :class:`_Indexed` samples),
    ``collate`` makes the dataset's rows, ``student`` (and ``teacher``, with ``seq_kd``)
    engines answer the prompts."""

    def __init__(
        self,
        data: DatasetSource,
        collate: Callable[[list[Any]], Batch],
        *,
        student: LocalEngine,
        teacher: LocalEngine | None,
        settings: GKDSettings,
        generation: GenerationConfig,
        stop_ids: Sequence[int],
        seed: int,
        ctx: DistributedContext,
    ) -> None:
        if settings.seq_kd and teacher is None:
            raise ValueError("seq_kd: true needs the teacher's engine (teacher=)")
        self.data, self._collate = data, collate
        self.student, self.teacher = student, teacher
        self.settings, self.generation, self.stop_ids = settings, generation, list(stop_ids)
        self.seed, self.ctx = int(seed), ctx
        self.steps = 0  # steps made (the key of the next one)
        self._metrics: dict[str, float] = {}

    @classmethod
    def build(
        cls,
        dataset: Sequence[Any],
        collate: Callable[[list[Any]], Batch],
        loop: LoopSettings,
        ctx: DistributedContext,
        *,
        student: nn.Module,
        teacher: nn.Module | None,
        tokenizer: Any,
        settings: GKDSettings,
        generation: GenerationConfig,
    ) -> OnPolicyDistillationSource:
        """The source of ``dataset`` read as ``loop`` says (batch size, shuffle, seed,
        accumulation) on this rank; ``teacher`` is used only with ``seq_kd``."""

        def engine(model: nn.Module) -> LocalEngine:  # the student's and the teacher's alike
            return LocalEngine(
                model,
                tokenizer,
                pad_id=pad_id(tokenizer),
                autocast_dtype=AUTOCAST[loop.mixed_precision],
                sync_ranks=ctx.world_size > 1,
                settings=generation.engine,
            )

        return cls(
            DatasetSource.build(_Indexed(dataset), list, loop, ctx),
            collate,
            student=engine(student),
            teacher=engine(teacher) if settings.seq_kd else None,
            settings=settings,
            generation=generation,
            stop_ids=stop_token_ids(tokenizer, generation.stop_tokens),
            seed=loop.seed,
            ctx=ctx,
        )

    # -- what the trainer reads besides next_step

    @property
    def epoch(self) -> int:
        return self.data.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:  # set by the trainer on resume
        self.data.epoch = value

    @property
    def collate(self) -> Callable[[list[Any]], Batch]:
        """The dataset rows' collate (validation batches are collated with it)."""
        return self._collate

    @property
    def samples(self) -> int:
        return self.data.samples

    @property
    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch

    # -- BatchSource

    def next_step(self) -> list[Batch]:
        parts = self.data.next_step()
        on_policy = on_policy_step(self.seed, self.steps, self.settings.lmbda)
        engine = self.student if on_policy else self.teacher  # None: the dataset's rows
        start, seconds = time.perf_counter(), 0.0
        if engine is None:
            batches = [self._collate([sample for _, sample in part]) for part in parts]
        else:
            batches = self._answered(engine, parts)
            seconds = time.perf_counter() - start
        self._metrics = self._reduced(batches, on_policy, seconds)
        self.steps += 1
        return batches

    def step_metrics(self) -> dict[str, float]:
        """``on_policy``, ``completion_length`` (mean trained tokens of a row, all ranks),
        ``completion_length_max`` and ``generate_s`` (mean over the ranks) of the last step."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.steps = int(state["steps"])

    # -- the stages

    def _answered(self, engine: LocalEngine, parts: list[list[tuple[int, Sample]]]) -> list[Batch]:
        """Each micro-batch's prompts with ``engine``'s completions (one decode for the step;
        keyed by the seed, the step and each sample's index)."""
        prompts, keys = [], []
        for part in parts:
            for index, sample in part:
                prompts.append(split_sample(sample, index)[0])
                keys.append(row_key(self.seed, self.steps, index))
        out = generate_with(engine, prompts, keys, self.generation, self.stop_ids)
        batches, first = [], 0
        for part in parts:
            rows = slice(first, first + len(part))
            batches.append(rollout_batch(prompts[rows], out.sequences[rows], self.student.pad_id))
            first += len(part)
        return batches

    def _reduced(self, batches: list[Batch], on_policy: bool, seconds: float) -> dict[str, float]:
        """The step's metrics over the data-parallel ranks."""
        lengths = torch.cat([(b["labels"] != IGNORE_INDEX).sum(1) for b in batches]).double()
        sums = {"tokens": float(lengths.sum()), "rows": float(len(lengths)), "seconds": seconds}
        sums = all_reduce_values(sums, self.ctx, dist.ReduceOp.SUM)
        longest = all_reduce_values({"n": float(lengths.max())}, self.ctx, dist.ReduceOp.MAX)
        return {
            "on_policy": float(on_policy),
            "completion_length": sums["tokens"] / sums["rows"],
            "completion_length_max": longest["n"],
            "generate_s": sums["seconds"] / self.ctx.dp_size,
        }
