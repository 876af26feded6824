"""What the model will be trained on, as text: rendered samples with the trained tokens marked,
token counts, truncation stats and a histogram of sample lengths (``tunesmith data preview``).

Every function returns a string. A sample is rendered by decoding its tokens run by run (a
run: consecutive tokens that are all trained, or all context), special tokens shown, each
trained run wrapped in ``[[...]]`` (``color=False``) or in ANSI bold green (``color=True``,
for a terminal). Token ``j`` is trained when ``labels[j - 1]`` is a label (labels are
shifted: see ``labels.py``). Preference samples show each side (``chosen``, ``rejected``).

Example (a tokenizer trained on the spot; the other examples use its ``tok`` and ``dataset``)::

    >>> import json
    >>> from pathlib import Path
    >>> from tunesmith.data import SFTDataset, Tokenizer
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> _ = Path("chat.jsonl").write_text(json.dumps({"messages": [
    ...     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}))
    >>> dataset = SFTDataset(tok, source="chat.jsonl")
    >>> print(preview(tok, dataset, n=1))
    chat.jsonl: 1 rows -> 1 samples (79 tokens, 2 trained), 0 truncated, 0 skipped
    <BLANKLINE>
    --- sample 0 (chat.jsonl row 1): 79 tokens, 2 trained
    <|im_start|>system
    You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>
    <|im_start|>user
    2+2?<|im_end|>
    <|im_start|>assistant
    [[4<|im_end|>]]
    <BLANKLINE>
    <BLANKLINE>
    truncation: no max_seq_len, 1 samples kept whole
      chat.jsonl: 1 rows -> 1 samples, 0 cut to max_seq_len, 0 dropped as too long
    <BLANKLINE>
    token lengths: 1 samples, min 79, mean 79.0, max 79
      79-79 1 ########################################
    <BLANKLINE>
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tunesmith.data.labels import IGNORE_INDEX, count_trained

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = [
    "TRAINED_COLOR",
    "describe_sample",
    "length_histogram",
    "preview",
    "render_sample",
    "render_tokens",
    "sample_length",
    "sequences",
    "trained_mask",
    "truncation_stats",
]

TRAINED_COLOR = "\x1b[1;32m"
"""ANSI escape that starts a trained run on a terminal (bold green); ``\\x1b[0m`` ends it."""
_RESET = "\x1b[0m"


def trained_mask(labels: Sequence[int]) -> list[bool]:
    """Which tokens are trained, from shifted labels: token ``j`` when ``labels[j - 1]`` is
    a label; token 0 never.

    Example::

        >>> trained_mask([-100, 6, 2, -100])
        [False, False, True, True]
    """
    return [False] + [label != IGNORE_INDEX for label in labels[:-1]]


def render_tokens(
    tokenizer: Tokenizer, ids: Sequence[int], trained: Sequence[bool], *, color: bool = False
) -> str:
    """``ids`` decoded run by run, the trained runs marked (``[[...]]``, or ANSI colour).

    Example::

        render_tokens(tok, tok.encode("2+2=4", add_special_tokens=False),
                      [False, False, False, False, True])
        # -> '2+2=[[4]]'
    """
    if len(ids) != len(trained):
        raise ValueError(f"{len(ids)} ids but {len(trained)} trained flags")
    out: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = tokenizer.decode(list(ids[start:end]), skip_special_tokens=False)
            if trained[start]:
                text = f"{TRAINED_COLOR}{text}{_RESET}" if color else f"[[{text}]]"
            out.append(text)
            start = end
    return "".join(out)


def sequences(sample: Any) -> list[tuple[str, list[int], list[int]]]:
    """The token sequences of a sample as ``(side, input_ids, labels)``: one with side ``""``
    for an SFT sample, ``chosen`` and ``rejected`` for a preference pair.

    Example::

        >>> sequences({"input_ids": [1, 2], "labels": [2, -100]})
        [('', [1, 2], [2, -100])]
    """
    out = []
    for key in sample:
        if key.endswith("input_ids") and key.removesuffix("input_ids") + "labels" in sample:
            side = key.removesuffix("input_ids")
            out.append((side.rstrip("_"), list(sample[key]), list(sample[side + "labels"])))
    if not out:
        raise ValueError(f"a sample with keys {sorted(sample)} has no input_ids with labels")
    return out


def sample_length(sample: Any) -> int:
    """Tokens of a sample: its longest sequence (a pair's longer side).

    Example::

        >>> sample_length({"chosen_input_ids": [1, 2, 3], "chosen_labels": [2, 3, -100],
        ...                "rejected_input_ids": [1, 4], "rejected_labels": [4, -100]})
        3
    """
    return max(len(ids) for _, ids, _ in sequences(sample))


def describe_sample(dataset: Any, index: int) -> str:
    """Where sample ``index`` comes from: ``"<source> row <r>"`` (a mix's part name first),
    ``""`` when the dataset does not say.

    Example::

        describe_sample(mix, 5)
        # -> 'alpaca: data/alpaca.jsonl row 1'
    """
    if hasattr(dataset, "origin"):  # a DatasetMix
        name, row = dataset.origin(index)
        part = next(p for p in dataset.parts if p.name == name)
        inner = describe_sample(part.dataset, row)
        return f"{name}: {inner}" if inner else f"{name} sample {row}"
    rows = getattr(dataset, "row_indices", None)
    source = getattr(dataset, "source", None)
    if rows is None or source is None:
        return ""
    return f"{source} row {rows[index] + 1}"  # 1-based, as errors and skip reports count


def render_sample(
    tokenizer: Tokenizer, sample: Any, *, title: str = "sample", color: bool = False
) -> str:
    """A header per sequence (``--- title: N tokens, M trained``) and its rendered text.

    Example::

        print(render_sample(tok, dataset[0], title="sample 0"))
        # --- sample 0: 41 tokens, 3 trained
        # <|im_start|>user ... <|im_start|>assistant
        # [[7<|im_end|>]]
    """
    blocks = []
    for side, ids, labels in sequences(sample):
        name = f"{title}, {side}" if side else title
        header = f"--- {name}: {len(ids)} tokens, {count_trained(labels)} trained"
        blocks.append(
            header + "\n" + render_tokens(tokenizer, ids, trained_mask(labels), color=color)
        )
    return "\n".join(blocks)


def _reports(dataset: Any) -> list[tuple[str, Any]]:
    if hasattr(dataset, "parts") and hasattr(dataset, "origin"):  # a DatasetMix
        return [
            (f"{part.name}: ", report)
            for part in dataset.parts
            if (report := getattr(part.dataset, "report", None)) is not None
        ]
    report = getattr(dataset, "report", None)
    return [] if report is None else [("", report)]


def truncation_stats(dataset: Any) -> str:
    """How many samples were cut to ``max_seq_len`` and how many rows were dropped as too
    long (per source, from its report), and how many samples are exactly ``max_seq_len``
    tokens long (they hit the limit, cut or not).

    Example::

        print(truncation_stats(dataset))
        # truncation (max_seq_len 64): 3 of 40 samples at max_seq_len
        #   data/chat.jsonl: 40 rows -> 40 samples, 3 cut to max_seq_len, 0 dropped as too long
    """
    limit = getattr(dataset, "max_seq_len", None)
    size = len(dataset)
    if limit is None:
        lines = [f"truncation: no max_seq_len, {size} samples kept whole"]
    else:
        at = sum(1 for i in range(size) if sample_length(dataset[i]) == limit)
        lines = [f"truncation (max_seq_len {limit}): {at} of {size} samples at max_seq_len"]
    for prefix, report in _reports(dataset):
        dropped = report.skipped.get("too_long", 0)
        lines.append(
            f"  {prefix}{report.source}: {report.rows} rows -> {report.samples} samples, "
            f"{report.truncated} cut to max_seq_len, {dropped} dropped as too long"
        )
    return "\n".join(lines)


def length_histogram(lengths: Sequence[int], *, bins: int = 10, width: int = 40) -> str:
    """A text histogram of token ``lengths``: ``bins`` bins of equal integer width from the
    shortest to the longest (fewer when the range is narrow), each with its count and a bar
    of ``#`` scaled so the fullest bin has ``width`` (a non-empty bin at least one).

    Example::

        >>> print(length_histogram([3, 3, 4, 10], bins=2, width=6))
        token lengths: 4 samples, min 3, mean 5.0, max 10
          3-6  3 ######
          7-10 1 ##
    """
    if not lengths:
        return "token lengths: no samples"
    if bins < 1 or width < 1:
        raise ValueError(f"bins and width must be >= 1, got bins={bins}, width={width}")
    low, high = min(lengths), max(lengths)
    step = math.ceil((high - low + 1) / bins)
    count = math.ceil((high - low + 1) / step)
    counts = [0] * count
    for n in lengths:
        counts[(n - low) // step] += 1
    mean = sum(lengths) / len(lengths)
    lines = [f"token lengths: {len(lengths)} samples, min {low}, mean {mean:.1f}, max {high}"]
    edges = [(low + k * step, low + (k + 1) * step - 1) for k in range(count)]
    left = max(len(str(a)) for a, _ in edges)
    label = max(len(f"{a:>{left}}-{b}") for a, b in edges)
    digits = len(str(max(counts)))
    for (a, b), c in zip(edges, counts):
        bar = "#" * (max(1, round(c / max(counts) * width)) if c else 0)
        lines.append(f"  {f'{a:>{left}}-{b}':<{label}} {c:>{digits}} {bar}".rstrip())
    return "\n".join(lines)


def preview(
    tokenizer: Tokenizer,
    dataset: Any,
    *,
    n: int = 3,
    indices: Sequence[int] | None = None,
    color: bool = False,
    bins: int = 10,
) -> str:
    """The whole preview: the dataset's report, samples ``indices`` (default: the first
    ``n``) rendered, the truncation stats and the length histogram over every sample.

    Example::

        print(preview(tok, SFTDataset(tok, source="chat.jsonl"), n=2))
    """
    size = len(dataset)
    chosen = list(range(min(n, size))) if indices is None else list(indices)
    for index in chosen:
        if not 0 <= index < size:
            raise IndexError(f"sample {index} is out of range: the dataset has {size} samples")
    parts = []
    report = getattr(dataset, "report", None)
    if report is not None:
        parts.append(report.summary())
    for index in chosen:
        where = describe_sample(dataset, index)
        title = f"sample {index} ({where})" if where else f"sample {index}"
        parts.append(render_sample(tokenizer, dataset[index], title=title, color=color))
    parts.append(truncation_stats(dataset))
    parts.append(length_histogram([sample_length(dataset[i]) for i in range(size)], bins=bins))
    return "\n\n".join(parts) + "\n"
