"""The SFT dataset: rows -> checked conversations -> token ids and shifted labels.

Everything is tokenised once, at construction, in a plain loop that keeps each row's
index, so every problem is reported with the file and the row. A row that cannot give a
correct sample (see the reason codes in ``report.py``) either stops construction with a
:class:`~tunesmith.data.report.BadRowError` (``on_bad_row="error"``, the default) or is
skipped and counted in :attr:`SFTDataset.report` (``on_bad_row="skip"``); a sample is
never kept with no trained token.

What is trained (``train_on``):

- ``"assistant"``: the assistant replies, each with its end-of-turn token, as the chat
  template marks them (``Tokenizer.tokenize_conversation``);
- ``"last_turn"``: only the last assistant reply (the last of the reply token spans
  that ``tokenize_conversation(..., return_spans=True)`` gives; after tool calls, the
  final assistant message, not the calls before it);
- ``"all"``: every token of the rendered conversation.

``prompt_completion`` rows with ``use_chat_template=False`` are tokenised raw, as one text:
``encode(prompt + completion)`` (with the tokenizer's special tokens, e.g. BOS) and EOS,
the prompt/completion boundary found from the character offsets
(:meth:`~tunesmith.data.tokenizer.Tokenizer.encode_split`; a token straddling it is the
completion's); the completion and EOS are trained (everything with ``train_on="all"``).
Tokenising the completion on its own would give other ids: a SentencePiece-style tokenizer
puts its "▁" prefix space before it. ``text`` rows are ``encode(text)`` + EOS,
all trained whatever ``train_on`` says.

Truncation to ``max_seq_len``: ``"right"`` keeps the start, ``"left"`` keeps the end,
``"drop"`` skips or rejects longer samples as ``too_long``. A truncated sample whose
trained tokens were all cut off is ``no_trained_tokens``.

A sample is ``{"input_ids": list[int], "labels": list[int]}`` with shifted labels
(``labels[i]`` is the target of position ``i``; see ``labels.py``).

Tokenising shows a progress bar on a terminal. With ``cache_dir`` (the shipped configs:
``${output_dir}/../.tunesmith_cache``) the tokenised rows of a local data file are cached
there, keyed by the file's bytes, the tokenizer and every setting above
(:mod:`~tunesmith.data.token_cache`): a re-run reads them back (``cache_note`` says
``tokenized data: cache hit <path>``) and trains on the very same samples.

Example (YAML)::

    dataset:
      _component_: tunesmith.data.sft_dataset.SFTDataset
      source: data/train.jsonl
      format: alpaca
      column_map: {instruction: question, output: answer}
      max_seq_len: 2048
      on_bad_row: skip
      cache_dir: ${output_dir}/../.tunesmith_cache   # null: no cache
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from torch.utils.data import Dataset

from tunesmith.config.registry import component
from tunesmith.data.chat_template import TemplateBudgetError, chat_template_hint
from tunesmith.data.formats import (
    PROMPT_STYLES,
    Conversation,
    Format,
    PlainText,
    PromptCompletion,
    PromptStyle,
    check_columns,
    convert_row,
    resolve_columns,
)
from tunesmith.data.labels import count_trained, make_labels, truncate
from tunesmith.data.report import (
    BAD_ROW_POLICIES,
    NO_TRAINED_TOKENS,
    TEMPLATE_ERROR,
    TOO_LONG,
    BadRow,
    OnBadRow,
)
from tunesmith.data.sources import (
    MAX_ROW_BYTES,
    DataSource,
    SampleBy,
    check_max_row_bytes,
    load_rows,
)
from tunesmith.data.token_cache import CachedRows, tokenize_rows, tokenize_with_cache

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = ["BAD_ROW_POLICIES", "TRAIN_ON", "TRUNCATION", "SFTDataset", "tokenize_example"]

TrainOn = Literal["assistant", "last_turn", "all"]
Truncation = Literal["right", "left", "drop"]
TRAIN_ON: tuple[str, ...] = get_args(TrainOn)
TRUNCATION: tuple[str, ...] = get_args(Truncation)


def _with_eos(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        ids = [*ids, eos_id]
    return ids


def _encode(
    tokenizer: Tokenizer,
    example: Conversation | PromptCompletion | PlainText,
    train_on: str,
    template_kwargs: Mapping[str, Any],
) -> tuple[list[int], list[int]]:
    if isinstance(example, PlainText):
        ids = _with_eos(tokenizer.encode(example.text, add_special_tokens=True), tokenizer.eos_id)
        return ids, [1] * len(ids)
    if isinstance(example, PromptCompletion):
        ids, n_prompt = tokenizer.encode_split(example.prompt, example.completion)
        ids = _with_eos(ids, tokenizer.eos_id)
        prompt_mask = [1 if train_on == "all" else 0] * n_prompt
        return ids, prompt_mask + [1] * (len(ids) - n_prompt)
    try:
        ids, mask, spans = tokenizer.tokenize_conversation(
            example.messages, tools=example.tools, return_spans=True, **template_kwargs
        )
    except TemplateBudgetError:  # the template itself is broken or hostile, not this row
        raise
    except Exception as e:  # a template's raise_exception, or a template that fails to render
        raise BadRow(TEMPLATE_ERROR, f"the chat template failed: {type(e).__name__}: {e}") from e
    if not any(mask):
        raise BadRow(NO_TRAINED_TOKENS, "the chat template marks no assistant tokens")
    if train_on == "all":
        mask = [1] * len(ids)
    elif train_on == "last_turn":
        start, end = spans[-1]
        mask = [0] * start + [1] * (end - start) + [0] * (len(ids) - end)
    return list(ids), list(mask)


def tokenize_example(
    tokenizer: Tokenizer,
    example: Conversation | PromptCompletion | PlainText,
    *,
    train_on: str = "assistant",
    max_seq_len: int | None = None,
    truncation: str = "right",
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[dict[str, list[int]], bool]:
    """Tokenise one converted row; return ``(sample, was_truncated)`` or raise ``BadRow``.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> conv = Conversation([{"role": "user", "content": "hi"},
        ...                      {"role": "assistant", "content": "hello"}])
        >>> sample, cut = tokenize_example(tok, conv, max_seq_len=128)
        >>> tok.decode([t for t in sample["labels"] if t != -100]), cut
        ('hello<|im_end|>', False)
    """
    ids, mask = _encode(tokenizer, example, train_on, template_kwargs or {})
    cut = max_seq_len is not None and len(ids) > max_seq_len
    if cut:
        if truncation == "drop":
            raise BadRow(TOO_LONG, f"{len(ids)} tokens > max_seq_len={max_seq_len}")
        ids, mask = truncate(ids, mask, max_seq_len, truncation)
    labels = make_labels(ids, mask)
    if count_trained(labels) == 0:
        after = f" after truncation to max_seq_len={max_seq_len}" if cut else ""
        raise BadRow(NO_TRAINED_TOKENS, f"no trained tokens{after}")
    return {"input_ids": ids, "labels": labels}, bool(cut)


@component
class SFTDataset(Dataset):
    """Supervised fine-tuning samples from a local file or a Hub dataset.

    Args:
        tokenizer: a :class:`~tunesmith.data.tokenizer.Tokenizer` (a runtime argument
            when built from YAML).
        source: local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv``/``.txt`` file, local
            folder, or ``datasets.load_dataset`` name.
        format: ``"messages"``, ``"sharegpt"``, ``"alpaca"``, ``"prompt_completion"`` or
            ``"text"`` (fields in ``formats.py``).
        column_map: ``{field: column}`` to read a field from another column.
        split, data_files: passed to ``datasets.load_dataset`` (folders, Hub names).
        train_on: ``"assistant"``, ``"last_turn"`` or ``"all"`` (see the module docs).
        max_seq_len: longest sample in tokens (``None``: no limit).
        truncation: ``"right"``, ``"left"`` or ``"drop"``.
        on_bad_row: ``"error"`` (raise at the first bad row) or ``"skip"`` (count it).
        use_chat_template: render ``prompt_completion`` rows through the chat template
            (``True``) or concatenate them raw (``False``).
        system_prompt: system message for conversations that have none.
        prompt_style: for ``format="alpaca"``: ``"chat_template"``, ``"alpaca"`` (the
            Stanford Alpaca prompt) or ``"instruction_response"``; the text styles are
            tokenised raw (see ``formats.py``). ``None`` (default): ``"chat_template"`` when
            the tokenizer has one, else ``"alpaca"`` for alpaca rows.
        template_kwargs: extra chat template variables (e.g. ``{"enable_thinking": False}``).
        cache_dir: folder of the tokenised-rows cache (see the module docs); None: no cache.
        text_sample_by: how a ``.txt`` file is cut into samples: ``"line"`` (the default),
            ``"paragraph"`` (blank-line separated) or ``"document"`` (the whole file).
        max_row_bytes: the largest row read, in bytes (16 MiB by default): a bigger line,
            JSON array element, CSV record or text sample is a ``row_too_large`` bad row,
            skipped unread (``on_bad_row``).

    Attributes:
        samples: the ``{"input_ids", "labels"}`` dicts, in source order.
        row_indices: the source row of each sample.
        report: a :class:`~tunesmith.data.report.DataReport` (log ``report.summary()``).
        cache_note: the line to log about the cache (a hit, or where the rows were cached),
            None without one.

    Example::

        >>> import json
        >>> from pathlib import Path
        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> _ = Path("train.jsonl").write_text(json.dumps({"messages": [
        ...     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}))
        >>> ds = SFTDataset(tok, source="train.jsonl", max_seq_len=512)
        >>> ds[0].keys()
        dict_keys(['input_ids', 'labels'])
        >>> ds.report.summary()
        'train.jsonl: 1 rows -> 1 samples (80 tokens, 5 trained), 0 truncated, 0 skipped'
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        source: DataSource,
        format: Format = "messages",
        column_map: Mapping[str, str] | None = None,
        split: str = "train",
        data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
        train_on: TrainOn = "assistant",
        max_seq_len: int | None = None,
        truncation: Truncation = "right",
        on_bad_row: OnBadRow = "error",
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        prompt_style: PromptStyle | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        text_sample_by: SampleBy = "line",
        max_row_bytes: int = MAX_ROW_BYTES,
    ) -> None:
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        if on_bad_row not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
        check_max_row_bytes(max_row_bytes)
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 (or None), got {max_seq_len}")
        if prompt_style is None:
            no_template = format == "alpaca" and not tokenizer.chat_templates
            prompt_style = "alpaca" if no_template else "chat_template"
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
        if prompt_style != "chat_template" and format != "alpaca":
            raise ValueError(f"prompt_style={prompt_style!r} applies to format 'alpaca' only")
        raw = format == "text" or (format == "prompt_completion" and not use_chat_template)
        if raw and system_prompt is not None:
            raise ValueError(
                f"system_prompt needs the chat template; format {format!r} with "
                f"use_chat_template={use_chat_template} is tokenised raw"
            )
        if not raw and prompt_style == "chat_template" and not tokenizer.chat_templates:
            raise ValueError(
                f"format {format!r} renders conversations with the chat template, but the "
                f"tokenizer {getattr(tokenizer, 'name', '')} has none (tokenizer_config.json has "
                f"no chat_template and there is no chat_template.jinja): {chat_template_hint()}"
            )
        templated = not raw and prompt_style == "chat_template"
        if templated and (warning := tokenizer.bos_spacing_warning(**(template_kwargs or {}))):
            warnings.warn(warning, stacklevel=2)
        columns = resolve_columns(format, column_map)
        self.format = format
        self.train_on = train_on
        self.max_seq_len = max_seq_len

        def make_sample(row: Any) -> tuple[dict[str, list[int]], bool]:
            example = convert_row(
                row,
                format,
                column_map,
                system_prompt=system_prompt,
                use_chat_template=use_chat_template,
                prompt_style=prompt_style,
            )
            return tokenize_example(
                tokenizer,
                example,
                train_on=train_on,
                max_seq_len=max_seq_len,
                truncation=truncation,
                template_kwargs=template_kwargs,
            )

        def build() -> CachedRows:
            rows = load_rows(
                source,
                split=split,
                data_files=data_files,
                sample_by=text_sample_by,
                max_row_bytes=max_row_bytes,
            )
            check_columns(format, columns, rows.columns, rows.name)
            return tokenize_rows(rows, make_sample, on_bad_row, _keep)

        settings = {
            "dataset": "SFTDataset", "format": format, "column_map": column_map,
            "split": split, "data_files": data_files, "train_on": train_on,
            "max_seq_len": max_seq_len, "truncation": truncation, "on_bad_row": on_bad_row,
            "use_chat_template": use_chat_template, "system_prompt": system_prompt,
            "template_kwargs": template_kwargs, "prompt_style": prompt_style,
            "text_sample_by": text_sample_by, "max_row_bytes": max_row_bytes,
        }  # fmt: skip
        built, self.cache_note = tokenize_with_cache(cache_dir, source, tokenizer, settings, build)
        self.samples: list[dict[str, list[int]]] = built.samples
        self.row_indices: list[int] = built.row_indices
        self.report = built.report
        self.source = built.report.source

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]


def _keep(built: CachedRows, sample: dict[str, Any], index: int, cut: bool) -> None:
    built.samples.append(sample)
    built.row_indices.append(index)
    built.report.samples += 1
    built.report.truncated += int(cut)
    built.report.tokens += len(sample["input_ids"])
    built.report.trained_tokens += count_trained(sample["labels"])
