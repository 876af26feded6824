"""The unpaired dataset: rated completions (thumbs up / thumbs down) -> token ids and labels,
for KTO (:mod:`tunesmith.recipes.kto`).

Each row is one completion of a prompt and a ``label``: ``true`` (desirable) or ``false``
(undesirable), as TRL's unpaired preference data; paired preference rows (chosen/rejected)
are split into one desirable and one undesirable row. Like
:class:`~tunesmith.data.preference_dataset.PreferenceDataset`, everything is tokenised once, at
construction, and a bad row either stops construction with a
:class:`~tunesmith.data.report.BadRowError` naming the file and the 1-based row
(``on_bad_row="error"``) or is skipped and counted (``on_bad_row="skip"``).

Formats (``column_map`` renames fields to your columns):

==========================  ===============================  ===============
format                      required fields                  optional fields
==========================  ===============================  ===============
``prompt_completion``       ``prompt``, ``completion``,      ``system``
                            ``label``
``messages``                ``messages``, ``label``
``paired_messages``         ``chosen``, ``rejected``         ``prompt``
``prompt_chosen_rejected``  ``prompt``, ``chosen``,          ``system``
                            ``rejected``
==========================  ===============================  ===============

``prompt_completion``: ``prompt`` is a string (one user message) or a list of messages;
``completion`` a string (one assistant message) or a list of messages ending with the
assistant reply (TRL's conversational ``[{"role": "assistant", ...}]``). ``messages``: a whole
conversation whose last (assistant) message is the rated completion. ``label`` is a bool (the
strings ``true``/``false`` and the integers 1/0 of CSV files are read as such). The two paired
formats are :class:`~tunesmith.data.preference_dataset.PreferenceDataset`'s ``messages`` and
``prompt_chosen_rejected``: each pair gives its chosen reply as a desirable row, then its
rejected reply as an undesirable row. With ``use_chat_template=False`` (base models)
``prompt_completion`` and ``prompt_chosen_rejected`` rows of strings are raw text:
``prompt + completion`` is tokenised as one text with EOS appended, as the preference
dataset does.

Tokenisation is the preference dataset's, one reply at a time: the prompt with the template's
generation prompt, the whole conversation, and the reply's tokens after the longest common
prefix of the two (at most up to the reply's start); trained tokens are the last assistant
reply with its end-of-turn token. Truncation (``max_seq_len``, ``max_prompt_len``,
``truncation``) is the preference dataset's.

A sample is ``{"prompt_ids", "completion_ids", "completion_mask", "label"}``; the dataset's
item ``i`` is a training row ``{"input_ids", "labels", "label"}`` (labels shifted as
everywhere) plus its **KL row** ``{"kl_input_ids", "kl_labels"}``: the prompt of sample ``i``
followed by the completion of sample ``(i - 1) mod N`` (its completion cut to ``max_seq_len``
when the two are longer). KTO estimates ``KL(π‖ref)`` from these mismatched pairs; pairing by
dataset index (TRL rotates completions by one within each mapping batch: the same with one
batch) makes the KL rows of a step the same whatever the batch size, accumulation and ranks.
Batch items with :func:`collate_unpaired`.

Example (YAML)::

    dataset:
      _component_: tunesmith.data.unpaired_dataset.UnpairedDataset
      source: data/feedback.jsonl
      format: prompt_completion
      column_map: {completion: answer, label: thumbs_up}
      max_seq_len: 1024
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import Dataset, Subset

from tunesmith.config.registry import component
from tunesmith.data.chat_template import chat_template_hint
from tunesmith.data.collate import collate_padded
from tunesmith.data.formats import check_columns, check_messages, resolve_columns
from tunesmith.data.labels import count_trained, make_labels
from tunesmith.data.preference_dataset import (
    PREFERENCE_FORMAT_FIELDS,
    PreferencePair,
    PreferenceTruncation,
    RawPreferencePair,
    _assistant,
    _check_arguments,
    _first_difference,
    _fit,
    _last_reply_mask,
    _prompt_messages,
    _required,
    _text,
    _tokenize,
    _with_system,
    convert_preference_row,
)
from tunesmith.data.report import (
    LAST_TURN_NOT_ASSISTANT,
    NO_TRAINED_TOKENS,
    WRONG_TYPE,
    BadRow,
    OnBadRow,
)
from tunesmith.data.sources import MAX_ROW_BYTES, DataSource, check_max_row_bytes, load_rows
from tunesmith.data.token_cache import CachedRows, tokenize_rows, tokenize_with_cache

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = [
    "UNPAIRED_FORMATS",
    "UNPAIRED_FORMAT_FIELDS",
    "RatedCompletion",
    "UnpairedDataset",
    "collate_unpaired",
    "convert_unpaired_row",
    "label_counts",
    "label_list",
    "tokenize_completion",
]

UNPAIRED_FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prompt_completion": (("prompt", "completion", "label"), ("system",)),
    "messages": (("messages", "label"), ()),
    "paired_messages": (("chosen", "rejected"), ("prompt",)),
    "prompt_chosen_rejected": (("prompt", "chosen", "rejected"), ("system",)),
}
"""format -> (required fields, optional fields)."""

UNPAIRED_FORMATS = tuple(UNPAIRED_FORMAT_FIELDS)
UnpairedFormat = Literal[UNPAIRED_FORMATS]  # type: ignore[valid-type]
_PAIRED = {"paired_messages": "messages", "prompt_chosen_rejected": "prompt_chosen_rejected"}
_LABELS = {"true": True, "false": False, "1": True, "0": False}


@dataclass
class RatedCompletion:
    """A checked row: the prompt (messages, or raw text) and one completion with its label."""

    prompt: list[dict[str, Any]] | str
    completion: dict[str, Any] | str
    desirable: bool


# ------------------------------------------------------------------------- row -> rows


def _label(row: Mapping[str, Any], column: str) -> bool:
    value = _required(row, column)
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if key not in _LABELS:
        raise BadRow(
            WRONG_TYPE, f"column {column!r} is {value!r}, expected true or false (desirable?)"
        )
    return _LABELS[key]


def _conversation(row: Mapping[str, Any], format: str, columns: Mapping[str, str]) -> list[Any]:
    """The row's whole conversation, unchecked; its last message is the rated completion."""
    if format == "messages":
        return list(_required(row, columns["messages"]))
    prompt = _prompt_messages(_required(row, columns["prompt"]), columns["prompt"])
    system = _text(row, columns["system"], required=False)
    value = _required(row, columns["completion"])
    if isinstance(value, str):
        completion = [_assistant(value, columns["completion"])]
    elif isinstance(value, Sequence):
        completion = list(value)
    else:
        raise BadRow(
            WRONG_TYPE,
            f"column {columns['completion']!r} is {type(value).__name__}, expected a str or a "
            "list of messages",
        )
    return _with_system([*prompt, *completion], system)


def _raw(row: Mapping[str, Any], columns: Mapping[str, str], desirable: bool) -> RatedCompletion:
    if _text(row, columns["system"], required=False) is not None:
        raise BadRow(
            WRONG_TYPE,
            f"column {columns['system']!r} is set, but raw text (use_chat_template=False) has "
            "no system turn; put it in the prompt text",
        )
    completion = _text(row, columns["completion"])
    _assistant(completion, columns["completion"])  # an empty completion is a bad row
    return RatedCompletion(_text(row, columns["prompt"]), completion, desirable)


def _split_pair(pair: PreferencePair | RawPreferencePair) -> list[RatedCompletion]:
    """A pair's chosen reply as a desirable row, then its rejected reply as an undesirable one."""
    return [RatedCompletion(pair.prompt, pair.chosen, True),
            RatedCompletion(pair.prompt, pair.rejected, False)]  # fmt: skip


def convert_unpaired_row(
    row: Mapping[str, Any],
    format: str = "prompt_completion",
    column_map: Mapping[str, str] | None = None,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> list[RatedCompletion]:
    """Check one row and return its rated completions (one, or two for a paired row); raise
    ``BadRow``.

    Example::

        >>> [(r.completion["content"], r.desirable) for r in convert_unpaired_row(
        ...     {"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "prompt_chosen_rejected")]
        [('4', True), ('5', False)]
        >>> convert_unpaired_row({"prompt": "2+2?", "completion": "4", "label": "false"})[0].desirable
        False
    """
    if not isinstance(row, Mapping):
        raise BadRow(WRONG_TYPE, f"row is {type(row).__name__}, expected an object")
    if format in _PAIRED:
        paired_map = None if column_map is None else dict(column_map)
        pair = convert_preference_row(
            row,
            _PAIRED[format],
            paired_map,
            system_prompt=system_prompt,
            use_chat_template=use_chat_template,
        )
        return _split_pair(pair)
    columns = resolve_columns(format, column_map, UNPAIRED_FORMAT_FIELDS)
    desirable = _label(row, columns["label"])
    if not use_chat_template:
        return [_raw(row, columns, desirable)]
    name = columns.get("messages") or f"{columns['prompt']}+{columns['completion']}"
    messages = _with_system(
        check_messages(_conversation(row, format, columns), name), system_prompt
    )
    if messages[-1]["role"] != "assistant":
        raise BadRow(
            LAST_TURN_NOT_ASSISTANT,
            f"{name} ends with a {messages[-1]['role']!r} message, expected the assistant reply "
            "to be rated",
        )
    return [RatedCompletion(messages[:-1], messages[-1], desirable)]


# ----------------------------------------------------------------------------- tokens


def _templated(
    tokenizer: Tokenizer, rated: RatedCompletion, kwargs: Mapping[str, Any]
) -> tuple[list[int], list[int], list[int]]:
    """Prompt ids, completion ids and completion mask of a chat row (see the module docs)."""
    prompt_ids, _, _ = _tokenize(tokenizer, rated.prompt, kwargs, "prompt", True)
    ids, _, spans = _tokenize(tokenizer, [*rated.prompt, rated.completion], kwargs, "conversation")
    mask, start = _last_reply_mask(len(ids), spans, "completion")
    n = min(_first_difference(prompt_ids, ids), start)
    return ids[:n], ids[n:], mask[n:]


def _raw_tokens(tokenizer: Tokenizer, rated: RatedCompletion) -> tuple[list[int], ...]:
    """Prompt ids, completion ids (EOS appended) and mask of a raw-text row."""
    ids, n = tokenizer.encode_split(rated.prompt, rated.completion)
    eos = tokenizer.eos_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids = [*ids, eos]
    return ids[:n], ids[n:], [1] * (len(ids) - n)


def tokenize_completion(
    tokenizer: Tokenizer,
    rated: RatedCompletion,
    *,
    max_seq_len: int | None = None,
    max_prompt_len: int | None = None,
    truncation: str = "keep_end",
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Tokenise one rated completion; return ``(sample, was_truncated)`` or raise ``BadRow``.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> rated = convert_unpaired_row({"prompt": "2+2?", "completion": "4", "label": True})[0]
        >>> sample, cut = tokenize_completion(tok, rated, max_seq_len=512)
        >>> sorted(sample), sample["label"], cut
        (['completion_ids', 'completion_mask', 'label', 'prompt_ids'], True, False)
    """
    if isinstance(rated.prompt, str):
        prompt, ids, mask = _raw_tokens(tokenizer, rated)
    else:
        prompt, ids, mask = _templated(tokenizer, rated, dict(template_kwargs or {}))
    prompt, [(ids, mask)], cut = _fit(
        prompt, [(ids, mask)], max_seq_len, max_prompt_len, truncation
    )
    if count_trained(make_labels(prompt + ids, [0] * len(prompt) + mask)) == 0:
        after = f" after truncation to max_seq_len={max_seq_len}" if cut else ""
        raise BadRow(NO_TRAINED_TOKENS, f"the completion has no trained tokens{after}")
    sample = {"prompt_ids": prompt, "completion_ids": ids, "completion_mask": mask,
              "label": rated.desirable}  # fmt: skip
    return sample, cut


def _row(prompt: list[int], ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``prompt + completion``, the completion's mask trained."""
    tokens = prompt + ids
    return tokens, make_labels(tokens, [0] * len(prompt) + mask)


# ---------------------------------------------------------------------------- dataset


@component
class UnpairedDataset(Dataset):
    """Rated completions (a prompt, one completion, a desirable/undesirable label) from a file
    or Hub dataset, each with its KL row (see the module docs).

    Args:
        tokenizer: a :class:`~tunesmith.data.tokenizer.Tokenizer` (with a chat template
            unless ``use_chat_template=False``).
        source: local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv`` file, local
            folder, or ``datasets.load_dataset`` name.
        format: ``prompt_completion``, ``messages``, ``paired_messages`` or
            ``prompt_chosen_rejected`` (see the module docs).
        column_map, split, data_files, max_seq_len, max_prompt_len, truncation, on_bad_row,
            system_prompt, template_kwargs, use_chat_template, cache_dir, max_row_bytes: as
            :class:`~tunesmith.data.preference_dataset.PreferenceDataset`'s.

    Attributes:
        samples: the tokenised completions, in source order (a paired row: chosen, rejected).
        row_indices: the source row of each sample.
        report: a :class:`~tunesmith.data.report.DataReport` (``samples`` counts completions).

    Example::

        >>> import json
        >>> from pathlib import Path
        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> rows = [{"prompt": "2+2?", "completion": "4", "label": True},
        ...         {"prompt": "3+3?", "completion": "7", "label": False}]
        >>> _ = Path("rated.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
        >>> ds = UnpairedDataset(tok, source="rated.jsonl", max_seq_len=256)
        >>> sorted(ds[0]), ds.labels
        (['input_ids', 'kl_input_ids', 'kl_labels', 'label', 'labels'], [True, False])
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        source: DataSource,
        format: UnpairedFormat = "prompt_completion",
        column_map: Mapping[str, str] | None = None,
        split: str = "train",
        data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
        max_seq_len: int | None = None,
        max_prompt_len: int | None = None,
        truncation: PreferenceTruncation = "keep_end",
        on_bad_row: OnBadRow = "error",
        system_prompt: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        use_chat_template: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        max_row_bytes: int = MAX_ROW_BYTES,
    ) -> None:
        if format not in UNPAIRED_FORMATS:
            raise ValueError(f"format must be one of {UNPAIRED_FORMATS}, got {format!r}")
        _check_arguments(max_seq_len, max_prompt_len, truncation, on_bad_row)
        check_max_row_bytes(max_row_bytes)
        _check_template(tokenizer, format, use_chat_template, system_prompt, template_kwargs)
        self.format = format
        self.max_seq_len = max_seq_len

        def make_sample(row: Any) -> tuple[list[dict[str, Any]], bool]:
            rated = convert_unpaired_row(
                row,
                format,
                column_map,
                system_prompt=system_prompt,
                use_chat_template=use_chat_template,
            )
            out = [
                tokenize_completion(
                    tokenizer,
                    r,
                    max_seq_len=max_seq_len,
                    max_prompt_len=max_prompt_len,
                    truncation=truncation,
                    template_kwargs=template_kwargs,
                )
                for r in rated
            ]
            return [sample for sample, _ in out], any(cut for _, cut in out)

        def build() -> CachedRows:
            rows = load_rows(
                source, split=split, data_files=data_files, max_row_bytes=max_row_bytes
            )
            name, fields = _PAIRED.get(format, format), _fields_of(format)
            columns = resolve_columns(name, column_map, fields)
            check_columns(name, columns, rows.columns, rows.name, fields)
            return tokenize_rows(rows, make_sample, on_bad_row, _keep, "completions")

        settings = {
            "dataset": "UnpairedDataset", "format": format, "column_map": column_map,
            "split": split, "data_files": data_files, "max_seq_len": max_seq_len,
            "max_prompt_len": max_prompt_len, "truncation": truncation,
            "on_bad_row": on_bad_row, "system_prompt": system_prompt,
            "template_kwargs": template_kwargs, "use_chat_template": use_chat_template,
            "max_row_bytes": max_row_bytes,
        }  # fmt: skip
        built, self.cache_note = tokenize_with_cache(cache_dir, source, tokenizer, settings, build)
        self.samples: list[dict[str, Any]] = built.samples
        self.row_indices: list[int] = built.row_indices
        self.report = built.report
        self.source = built.report.source

    @property
    def labels(self) -> list[bool]:
        """Each sample's label (True: desirable)."""
        return [bool(s["label"]) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        partner = self.samples[(index - 1) % len(self.samples)]
        prompt = sample["prompt_ids"]
        input_ids, labels = _row(prompt, sample["completion_ids"], sample["completion_mask"])
        budget = len(partner["completion_ids"])
        if self.max_seq_len is not None:
            budget = max(0, self.max_seq_len - len(prompt))
        kl_ids, kl_labels = _row(
            prompt, partner["completion_ids"][:budget], partner["completion_mask"][:budget]
        )
        return {"input_ids": input_ids, "labels": labels, "label": bool(sample["label"]),
                "kl_input_ids": kl_ids, "kl_labels": kl_labels}  # fmt: skip


def _fields_of(format: str) -> Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The field table a format's columns are resolved and checked with."""
    return PREFERENCE_FORMAT_FIELDS if format in _PAIRED else UNPAIRED_FORMAT_FIELDS


def _check_template(
    tokenizer: Tokenizer,
    format: str,
    use_chat_template: bool,
    system_prompt: str | None,
    template_kwargs: Mapping[str, Any] | None,
) -> None:
    if not use_chat_template:
        if format not in ("prompt_completion", "prompt_chosen_rejected"):
            raise ValueError(
                "use_chat_template=False needs format 'prompt_completion' or "
                f"'prompt_chosen_rejected' (raw strings), got {format!r}"
            )
        if system_prompt is not None:
            raise ValueError("system_prompt needs the chat template (use_chat_template=False)")
        return
    if warning := tokenizer.bos_spacing_warning(**(template_kwargs or {})):
        warnings.warn(warning, stacklevel=3)
    if not tokenizer.chat_templates:
        raise ValueError(
            f"UnpairedDataset renders conversations with the chat template, but the tokenizer "
            f"{getattr(tokenizer, 'name', '')} has none: {chat_template_hint()}"
        )


def _keep(built: CachedRows, samples: list[dict[str, Any]], index: int, cut: bool) -> None:
    for sample in samples:
        built.samples.append(sample)
        built.row_indices.append(index)
        built.report.samples += 1
        built.report.tokens += len(sample["prompt_ids"]) + len(sample["completion_ids"])
        built.report.trained_tokens += sum(sample["completion_mask"])
    built.report.truncated += int(cut)


def label_counts(dataset: Sequence[Any]) -> tuple[int, int]:
    """``(desirable, undesirable)`` completions of an :class:`UnpairedDataset` or a subset of
    one (a training/validation split), without building its rows.

    >>> class Rated(list):  # e.g. UnpairedDataset(tok, source="rated.jsonl")
    ...     labels = property(lambda self: [True, True, False])
    >>> label_counts(Rated()), label_counts(Subset(Rated([0, 1, 2]), [0, 2]))
    ((2, 1), (1, 1))
    """
    if isinstance(dataset, Subset):
        labels = label_list(dataset.dataset)
        chosen = [labels[i] for i in dataset.indices]
    else:
        chosen = label_list(dataset)
    desirable = sum(chosen)
    return desirable, len(chosen) - desirable


def label_list(dataset: Any) -> list[bool]:
    """Each item's label, read from the dataset's ``labels`` (or its items as a fallback)."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        return [bool(dataset[i]["label"]) for i in range(len(dataset))]
    return list(labels)


def collate_unpaired(batch: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch of rated completions: the training rows (``input_ids``,
    ``labels``, ``attention_mask``, ``position_ids``), ``desirable`` (bool ``[B]``) and the KL
    rows under ``kl_`` (``kl_input_ids``, ``kl_labels``, ``kl_attention_mask``,
    ``kl_position_ids``); float ``[B]`` columns of precomputed reference log-probs
    (``reference_logps``, ``reference_kl_logps``) pass through.

    Example::

        >>> item = {"input_ids": [1, 2], "labels": [2, -100], "label": True,
        ...         "kl_input_ids": [1, 3, 4], "kl_labels": [3, 4, -100]}
        >>> out = collate_unpaired([item], pad_id=0)
        >>> out["input_ids"].tolist(), out["kl_input_ids"].tolist(), out["desirable"].tolist()
        ([[1, 2]], [[1, 3, 4]], [True])
    """
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in batch]
    kl_rows = [{"input_ids": s["kl_input_ids"], "labels": s["kl_labels"]} for s in batch]
    out = collate_padded(rows, pad_id)
    out |= {f"kl_{k}": v for k, v in collate_padded(kl_rows, pad_id).items()}
    out["desirable"] = torch.tensor([bool(s["label"]) for s in batch])
    for key in ("reference_logps", "reference_kl_logps"):
        if key in batch[0]:
            out[key] = torch.tensor([float(s[key]) for s in batch], dtype=torch.float32)
    return out
