"""A mixture of datasets: several named parts, of any format, in one training set.

Each part is a dataset built with the tokenizer as the part's own config says (an SFT set of
chat messages, another of alpaca rows, a ``.txt`` file of plain text...), or a dataset
already built. How much of each part the mix holds is given by one of:

- ``epochs`` (``{part: passes}``, 1 for a part not named): a part of ``n`` samples gives
  ``epochs * n`` of them, rounded half up; ``2`` is every sample twice, ``0.5`` a seeded half,
  ``1.5`` every sample once and a seeded half once more;
- ``weights`` (``{part: weight}``, every part named): the parts' shares of ``num_samples``
  (default: the parts' sizes summed, so the mix is as long as their concatenation), each
  ``weight / sum(weights)`` of it rounded so that the counts sum to ``num_samples`` exactly
  (largest remainders, ties to the earlier part). A part asked for more samples than it has
  repeats them as ``epochs`` does.

Neither: every part once (a concatenation). The samples a part gives are whole passes over it
in order, then (for the fraction of a pass) a subset drawn without replacement by a
generator seeded with ``seed`` and the part's name, kept in the part's order: the same config
gives the same mix on every rank and every run, so a resumed run's loader position (its
sampler's indices) points at the same samples. The mix lists the parts one after another, in
the order of ``parts``; the training loader's ``shuffle`` interleaves them.

Every part must give the same kind of sample (SFT ``input_ids``/``labels``, or preference
pairs for DPO). ``report.summary()`` names each part with its rows, samples and share.

Example (YAML; parts say ``component:``, not ``_component_``, since the mix passes the
tokenizer to each)::

    dataset:
      _component_: tunesmith.data.DatasetMix
      defaults: {max_seq_len: 2048, on_bad_row: skip}   # every part's, unless it says
      parts:
        chat: {source: data/chat.jsonl, format: messages}
        alpaca: {source: data/alpaca.jsonl, format: alpaca}
        books: {source: data/books.txt, format: text}
      weights: {chat: 0.6, alpaca: 0.3, books: 0.1}
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from tunesmith.config.components import resolve_component
from tunesmith.config.errors import suggestion
from tunesmith.config.registry import component
from tunesmith.data.report import DataError

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = ["DEFAULT_PART_COMPONENT", "DatasetMix", "MixPart", "MixReport", "mix_counts"]

DEFAULT_PART_COMPONENT = "tunesmith.data.SFTDataset"
"""What a part built from a mapping is, unless it names another ``component``."""


@dataclass
class MixPart:
    """One part of a :class:`DatasetMix`: its dataset and which of its samples the mix holds
    (``indices``, in mix order; repeated for more than one pass)."""

    name: str
    dataset: Sequence[Any] = field(repr=False)
    indices: list[int] = field(repr=False)
    weight: float | None = None

    @property
    def epochs(self) -> float:
        """Passes over the part: its samples in the mix / its size."""
        return len(self.indices) / len(self.dataset)


@dataclass
class MixReport:
    """What each part of a mix gave: ``summary()`` for the training log.

    Example (:class:`DatasetMix`'s example prints a real one)::

        print(mix.report.summary())
        # mix of 2 parts -> 60 samples (seed 0)
        #   chat: 40 samples x 1.0 epochs -> 40 samples (67%)
        #     data/chat.jsonl: 40 rows -> 40 samples (812 tokens, 160 trained), 0 truncated, ...
        #   ...
    """

    parts: list[MixPart] = field(repr=False)
    seed: int = 0

    @property
    def samples(self) -> int:
        """Samples in the mix."""
        return sum(len(p.indices) for p in self.parts)

    def summary(self) -> str:
        """A paragraph: the mix, then each part with its share and its own report."""
        total = self.samples
        lines = [f"mix of {len(self.parts)} parts -> {total} samples (seed {self.seed})"]
        for part in self.parts:
            weight = "" if part.weight is None else f", weight {part.weight:g}"
            lines.append(
                f"  {part.name}: {len(part.dataset)} samples x {part.epochs:.3g} epochs -> "
                f"{len(part.indices)} samples ({len(part.indices) / total:.0%}{weight})"
            )
            report = getattr(part.dataset, "report", None)
            if report is not None:
                lines += [f"    {line}" for line in report.summary().splitlines()]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        """Plain-data view: the mix's size and, per part, its size, count and own report."""
        parts: dict[str, object] = {}
        for part in self.parts:
            report = getattr(part.dataset, "report", None)
            parts[part.name] = {
                "size": len(part.dataset),
                "samples": len(part.indices),
                "epochs": part.epochs,
                "weight": part.weight,
                "report": report.as_dict() if report is not None else None,
            }
        return {"samples": self.samples, "seed": self.seed, "parts": parts}


def _positive(table: Mapping[str, Any], what: str, names: Sequence[str]) -> dict[str, float]:
    out = {}
    for name, value in table.items():
        if name not in names:
            raise ValueError(
                f"{what} names part {name!r}, which the mix does not have"
                f"{suggestion(str(name), names)}; its parts are {list(names)}"
            )
        number = float(value) if isinstance(value, (int, float)) else math.nan
        if not (math.isfinite(number) and number > 0) or isinstance(value, bool):
            raise ValueError(
                f"{what}[{name!r}] is {value!r}: it must be a number > 0 (remove the part "
                "from parts to leave it out)"
            )
        out[str(name)] = number
    return out


def mix_counts(
    sizes: Mapping[str, int],
    *,
    weights: Mapping[str, float] | None = None,
    epochs: Mapping[str, float] | None = None,
    num_samples: int | None = None,
) -> dict[str, int]:
    """How many samples each part gives (see the module docs for the rules).

    Example::

        >>> mix_counts({"a": 10, "b": 30}, epochs={"a": 2.5})
        {'a': 25, 'b': 30}
        >>> mix_counts({"a": 10, "b": 30}, weights={"a": 1, "b": 3}, num_samples=10)
        {'a': 3, 'b': 7}
    """
    names = list(sizes)
    for name, size in sizes.items():
        if size <= 0:
            raise DataError(f"part {name!r} has no samples")
    if weights is not None and epochs is not None:
        raise ValueError("give weights (shares of num_samples) or epochs (passes), not both")
    if num_samples is not None and weights is None:
        raise ValueError("num_samples sets the size of a weighted mix: give weights too")
    if weights is None:
        passes = _positive(epochs or {}, "epochs", names)
        counts = {name: math.floor(passes.get(name, 1.0) * sizes[name] + 0.5) for name in names}
        for name in names:
            if counts[name] == 0:
                raise ValueError(
                    f"epochs[{name!r}] = {passes[name]:g} gives part {name!r} 0 of its "
                    f"{sizes[name]} samples: raise it"
                )
        return counts
    shares = _positive(weights, "weights", names)
    missing = [name for name in names if name not in shares]
    if missing:
        raise ValueError(f"weights must give every part a weight; missing: {missing}")
    total = sum(sizes.values()) if num_samples is None else int(num_samples)
    if total < 1:
        raise ValueError(f"num_samples is {num_samples}: it must be >= 1")
    whole = sum(shares.values())
    exact = {name: shares[name] / whole * total for name in names}
    counts = {name: math.floor(exact[name]) for name in names}
    by_remainder = sorted(names, key=lambda n: (-(exact[n] - counts[n]), names.index(n)))
    for name in by_remainder[: total - sum(counts.values())]:
        counts[name] += 1
    for name in names:
        if counts[name] == 0:
            raise ValueError(
                f"weights[{name!r}] = {weights[name]!r} gives part {name!r} 0 of {total} "
                "samples: raise its weight or num_samples"
            )
    return counts


def _draw(name: str, size: int, count: int, seed: int) -> list[int]:
    """``count`` indices of a part of ``size``: whole passes, then a seeded subset."""
    passes, rest = divmod(count, size)
    rng = random.Random(f"tunesmith.mix:{seed}:{name}")  # str seeds hash stably (sha512)
    return list(range(size)) * passes + sorted(rng.sample(range(size), rest))


def _check_arguments(name: str, target: Any, spec: Mapping[str, Any], path: str) -> None:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [p for p in params if p != "tokenizer"]
    for key in spec:
        if key not in known:
            raise ValueError(
                f"parts.{name}: {path} has no argument {key!r}{suggestion(str(key), known)}"
            )


def _part_builder(
    name: str, spec: Any, defaults: Mapping[str, Any]
) -> Callable[[Tokenizer | None], Sequence[Any]]:
    """Check a part's spec (component, argument names) and return what builds it."""
    if not isinstance(spec, Mapping):
        if not (hasattr(spec, "__len__") and hasattr(spec, "__getitem__")):
            raise ValueError(
                f"parts.{name} is a {type(spec).__name__}: give a mapping of the part's "
                "dataset arguments (with an optional component:) or a dataset"
            )
        return lambda tokenizer: spec
    spec = {**defaults, **spec}
    if "_component_" in spec:
        raise ValueError(f"parts.{name}: write component:, not _component_")
    path = str(spec.pop("component", DEFAULT_PART_COMPONENT))
    try:
        target = resolve_component(path)
    except Exception as e:
        raise ValueError(f"parts.{name}.component: {e}") from e
    _check_arguments(name, target, spec, path)

    def build(tokenizer: Tokenizer | None) -> Sequence[Any]:
        try:
            return target(tokenizer, **spec)
        except Exception as e:
            raise DataError(f"parts.{name}: {type(e).__name__}: {e}") from e

    return build


@component
class DatasetMix(Dataset):
    """Several datasets, of any format, mixed by ``weights`` or ``epochs`` (module docs).

    Args:
        tokenizer: passed to every part built from a mapping (a runtime argument when built
            from YAML).
        parts: ``{name: part}``; a part is a mapping of its dataset's arguments, whose
            optional ``component`` key names the dataset class (default
            :data:`DEFAULT_PART_COMPONENT`), or a dataset already built.
        weights: ``{name: weight > 0}`` for every part: shares of ``num_samples``.
        epochs: ``{name: passes > 0}``: a part's samples times this (1 when not named).
        num_samples: the size of a weighted mix (default: the parts' sizes summed).
        seed: seeds the draw of fractional passes.
        defaults: arguments every part built from a mapping gets unless it sets them.

    Attributes:
        parts: the :class:`MixPart` list, in order; ``report``: a :class:`MixReport`.

    Example::

        >>> import json
        >>> from pathlib import Path
        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> _ = Path("chat.jsonl").write_text("".join(json.dumps({"messages": [
        ...     {"role": "user", "content": f"add {i} and 1"},
        ...     {"role": "assistant", "content": str(i + 1)}]}) + "\\n" for i in range(4)))
        >>> _ = Path("books.txt").write_text("Once upon a time.\\nThe end.\\n")
        >>> mix = DatasetMix(tok, parts={"chat": {"source": "chat.jsonl"},
        ...                              "books": {"source": "books.txt", "format": "text"}},
        ...                  epochs={"books": 0.5})
        >>> mix.origin(0), len(mix)
        (('chat', 0), 5)
        >>> print(mix.report.summary())
        mix of 2 parts -> 5 samples (seed 0)
          chat: 4 samples x 1 epochs -> 4 samples (80%)
            chat.jsonl: 4 rows -> 4 samples (... tokens, 8 trained), 0 truncated, 0 skipped
          books: 2 samples x 0.5 epochs -> 1 samples (20%)
            books.txt: 2 rows -> 2 samples (... tokens, ... trained), 0 truncated, 0 skipped
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        parts: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        epochs: Mapping[str, float] | None = None,
        num_samples: int | None = None,
        seed: int = 0,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(parts, Mapping) or not parts:
            raise ValueError("parts must be a non-empty mapping {name: part}")
        names = [str(name) for name in parts]
        if weights is not None:
            _positive(weights, "weights", names)
        if epochs is not None:
            _positive(epochs, "epochs", names)
        builders = [
            _part_builder(name, spec, defaults or {}) for name, spec in zip(names, parts.values())
        ]  # every part checked before any is tokenised
        built = {name: build(tokenizer) for name, build in zip(names, builders)}
        sizes = {}
        for name, dataset in built.items():
            sizes[name] = len(dataset)
            if sizes[name] == 0:
                raise DataError(f"parts.{name}: has no samples")
        counts = mix_counts(sizes, weights=weights, epochs=epochs, num_samples=num_samples)
        self.parts = [
            MixPart(
                name,
                built[name],
                _draw(name, sizes[name], counts[name], int(seed)),
                None if weights is None else float(weights[name]),
            )
            for name in names
        ]
        self._check_same_kind()
        self._index = [(p, i) for p, part in enumerate(self.parts) for i in part.indices]
        self.source = "mix(" + ", ".join(names) + ")"
        self.report = MixReport(self.parts, int(seed))
        lengths = [getattr(part.dataset, "max_seq_len", None) for part in self.parts]
        self.max_seq_len = None if None in lengths else max(lengths)

    def _check_same_kind(self) -> None:
        first = self.parts[0]
        keys = sorted(first.dataset[0]) if isinstance(first.dataset[0], Mapping) else None
        for part in self.parts[1:]:
            sample = part.dataset[0]
            other = sorted(sample) if isinstance(sample, Mapping) else None
            if other != keys:
                raise DataError(
                    f"parts {first.name!r} and {part.name!r} give different samples (keys "
                    f"{keys} vs {other}); a mix holds one kind, SFT or preference pairs"
                )

    @property
    def cache_note(self) -> str | None:
        """The parts' tokenisation-cache notes (``"<part>: <note>"`` lines), None if none."""
        notes = [
            f"{part.name}: {note}"
            for part in self.parts
            if (note := getattr(part.dataset, "cache_note", None))
        ]
        return "\n".join(notes) or None

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Any:
        part, row = self._index[index]
        return self.parts[part].dataset[row]

    def origin(self, index: int) -> tuple[str, int]:
        """The part (its name) and the index in that part of sample ``index`` of the mix."""
        part, row = self._index[index]
        return self.parts[part].name, row
