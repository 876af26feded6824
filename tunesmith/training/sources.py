"""Batch sources: what feeds a :class:`~tunesmith.training.trainer.Trainer`, one optimizer
step at a time, with a state that resumes exactly.

A source has ``next_step() -> list[micro_batch]`` (the micro-batches of one optimizer step on
this rank), ``state_dict()`` / ``load_state_dict()`` (its position, saved in every checkpoint
under ``"dataloader"``) and an ``epoch`` counter (logged, and saved in the checkpoint's
progress; a source that has no epochs keeps it at 0). :class:`DatasetSource` is a dataset read
by a resumable loader (SFT, DPO, KD, reward models); a rollout generator or a replay buffer
is another source.

Example::

    >>> from functools import partial
    >>> from tunesmith.data import collate_padded
    >>> from tunesmith.training.settings import LoopSettings
    >>> dataset = [{"input_ids": [i, i + 1], "labels": [i + 1, -100]} for i in range(8)]
    >>> settings = LoopSettings(output_dir="out", batch_size=2, gradient_accumulation_steps=2,
    ...                         shuffle=False)
    >>> ctx = DistributedContext(rank=0, world_size=1, local_rank=0,  # one process
    ...                          device=torch.device("cpu"), mesh=None)
    >>> collate = partial(collate_padded, pad_id=0)
    >>> source = DatasetSource.build(dataset, collate, settings, ctx)
    >>> micro_batches = source.next_step()
    >>> [b["input_ids"].tolist() for b in micro_batches]  # 2 micro-batches of 2 rows
    [[[0, 1], [1, 2]], [[2, 3], [3, 4]]]
    >>> resumed = DatasetSource.build(dataset, collate, settings, ctx)
    >>> resumed.load_state_dict(source.state_dict())  # as a checkpoint's "dataloader"
    >>> resumed.next_step()[0]["input_ids"].tolist()  # goes on where the first one stopped
    [[4, 5], [5, 6]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.settings import LoopSettings

__all__ = ["BatchSource", "DatasetSource", "dropped_per_epoch", "make_loader"]

Batch = dict[str, torch.Tensor]


@runtime_checkable
class BatchSource(Protocol):
    """What a :class:`~tunesmith.training.trainer.Trainer` is fed from.

    Optional: ``steps_per_epoch`` (the run's length is then ``epochs`` of them unless
    ``max_steps`` says), ``samples`` (checked on resume: the data did not change),
    ``collate`` (what :meth:`Trainer.evaluate` batches a validation set with) and
    ``reshard_state_dict`` (a state saved on another data-parallel size as this rank's; see
    :meth:`DatasetSource.reshard_state_dict`).
    """

    epoch: int

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step (this rank's)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def make_loader(
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], Batch],
    ctx: DistributedContext,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
) -> tuple[StatefulDataLoader, DistributedSampler]:
    """This rank's resumable loader over ``dataset`` (a new order every epoch when
    ``shuffle``, drawn from ``seed``), its share of the samples that of its data-parallel
    rank (``ctx.dp_rank`` of ``ctx.dp_size``). Incomplete batches are dropped, and so are the
    samples past a multiple of the dp size: how many each epoch leaves out is logged."""
    dropped = dropped_per_epoch(len(dataset), ctx.dp_size, batch_size)
    if dropped and ctx.is_rank_zero:
        which = "a different draw each epoch" if shuffle else "always the same ones: shuffle is off"
        print(
            f"data: {len(dataset)} samples, {ctx.dp_size} data-parallel rank(s) x batch_size "
            f"{batch_size}: {dropped} sample(s) left out of each epoch (drop_last; "
            f"{which})"
        )
    sampler = DistributedSampler(
        dataset,
        num_replicas=ctx.dp_size,
        rank=ctx.dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
    )
    loader = StatefulDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True
    )
    return loader, sampler


def dropped_per_epoch(samples: int, world_size: int, batch_size: int) -> int:
    """Samples an epoch leaves out: those past a multiple of ``world_size`` (the sampler), then
    on each rank those past a multiple of ``batch_size`` (the last incomplete batch).

    >>> dropped_per_epoch(17, 1, 4), dropped_per_epoch(17, 2, 4), dropped_per_epoch(16, 1, 4)
    (1, 1, 0)
    """
    per_rank = samples // world_size
    return samples - per_rank * world_size + world_size * (per_rank % batch_size)


class DatasetSource:
    """A dataset as a :class:`BatchSource`: ``accum`` micro-batches per step from ``loader``
    (see :func:`make_loader`), epoch after epoch, ``sampler`` reshuffled per epoch. Its state
    is the loader's (``epoch`` is kept by the trainer's progress counters).

    Example::

        >>> from functools import partial
        >>> from tunesmith.data import collate_padded
        >>> dataset = [{"input_ids": [1, 2], "labels": [2, -100]}] * 8
        >>> sampler = DistributedSampler(dataset, num_replicas=1, rank=0)  # make_loader's
        >>> loader = StatefulDataLoader(dataset, batch_size=2, sampler=sampler,
        ...                             collate_fn=partial(collate_padded, pad_id=0))
        >>> source = DatasetSource(loader, sampler, accum=2)
        >>> len(source.next_step()), source.steps_per_epoch
        (2, 2)
    """

    def __init__(
        self, loader: StatefulDataLoader, sampler: DistributedSampler, accum: int = 1
    ) -> None:
        self.loader, self.sampler, self.accum = loader, sampler, int(accum)
        self.epoch = 0
        self.steps_per_epoch = len(loader) // self.accum
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(loader.dataset)} samples make no optimizer step: batch_size "
                f"{loader.batch_size} x gradient_accumulation_steps {self.accum} x "
                f"{sampler.num_replicas} data-parallel ranks is larger"
            )
        self._stream: Iterator[Batch] | None = None

    @classmethod
    def build(
        cls,
        dataset: Sequence[Any],
        collate: Callable[[list[Any]], Batch],
        settings: LoopSettings,
        ctx: DistributedContext,
    ) -> DatasetSource:
        """``dataset`` read as ``settings`` say (``batch_size``, ``shuffle``, ``seed``,
        ``gradient_accumulation_steps``) on this data-parallel rank."""
        loader, sampler = make_loader(
            dataset,
            collate,
            ctx,
            batch_size=settings.batch_size,
            shuffle=settings.shuffle,
            seed=settings.seed,
        )
        return cls(loader, sampler, settings.gradient_accumulation_steps)

    @property
    def dataset(self) -> Sequence[Any]:
        return self.loader.dataset

    @property
    def collate(self) -> Callable[[list[Any]], Batch]:
        return self.loader.collate_fn

    @property
    def samples(self) -> int:
        return len(self.loader.dataset)

    def next_step(self) -> list[Batch]:
        if self._stream is None:  # started lazily: after load_state_dict on resume
            self._stream = self._micro_batches()
        return [next(self._stream) for _ in range(self.accum)]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def reshard_state_dict(self, state: dict[str, Any], saved_dp_size: int) -> dict[str, Any]:
        """``state``, saved by a rank of a run with ``saved_dp_size`` data-parallel ranks, as
        this rank's (another mesh, or another ``batch_size`` for the same global batch).

        The position is the samples each rank took from the epoch's order: ``n`` on each of
        ``saved_dp_size`` ranks are ``n x saved_dp_size`` of the global order (the first global
        steps, whatever the split), so each of this run's ranks has taken that many over its
        own ``dp_size``. Raises ValueError when that is not a whole number of this run's steps.

        Example::

            source.reshard_state_dict(saved, saved_dp_size=2)
        """
        position = state.get("_sampler_iter_state")
        if position is None:  # nothing read yet in this epoch
            return state
        extra = {
            k: state.get(k) for k in ("_index_sampler_state", "fetcher_state", "dataset_state")
        }
        if set(position) != {"samples_yielded"} or any(v is not None for v in extra.values()):
            raise ValueError(
                f"the data loader state holds more than a sample count ({sorted(position)}, "
                f"{[k for k, v in extra.items() if v is not None]}): it cannot be mapped from "
                f"{saved_dp_size} to {self.sampler.num_replicas} data-parallel ranks"
            )
        taken = int(position["samples_yielded"]) * int(saved_dp_size)  # of the global order
        dp, batch = self.sampler.num_replicas, int(self.loader.batch_size)
        step = dp * batch * self.accum
        if taken % step:
            raise ValueError(
                f"the checkpoint is {taken} samples into its epoch ({saved_dp_size} "
                f"data-parallel rank(s)), not a whole number of this run's steps of {step} "
                f"samples (batch_size {batch} x gradient_accumulation_steps {self.accum} x "
                f"{dp} data-parallel rank(s)): resume with the checkpoint's global batch"
            )
        batches = taken // dp // batch
        return {**state, "_sampler_iter_state": {"samples_yielded": taken // dp},
                "_sampler_iter_yielded": batches, "_num_yielded": batches}  # fmt: skip

    def _micro_batches(self) -> Iterator[Batch]:
        """Endless stream of micro-batches; ``epoch`` advances at each epoch end."""
        while True:
            self.sampler.set_epoch(self.epoch)
            yield from self.loader
            self.epoch += 1
