"""The preference dataset: rows of (prompt, chosen, rejected) -> paired token ids and labels.

It feeds preference optimisation (DPO, IPO, SimPO, ORPO, ...) and reward-model training.
Like :class:`~tunesmith.data.sft_dataset.SFTDataset`, everything is tokenised once, at
construction, keeping each row's index; a bad pair either stops construction with a
:class:`~tunesmith.data.report.BadRowError` (``on_bad_row="error"``) or is skipped and
counted in :attr:`PreferenceDataset.report` (``on_bad_row="skip"``).

Formats (``column_map`` renames fields to your columns):

==========================  ==========================  ===============
format                      required fields             optional fields
==========================  ==========================  ===============
``messages``                ``chosen``, ``rejected``    ``prompt``
``prompt_chosen_rejected``  ``prompt``, ``chosen``,     ``system``
                            ``rejected`` (strings)
==========================  ==========================  ===============

``messages``: ``chosen`` and ``rejected`` are whole conversations (lists of
``{role, content}``) that end in an assistant message; everything before that last
message is the prompt and must be the same in both. With a ``prompt`` column (a list of
messages, or a string = one user message), ``chosen``/``rejected`` may instead be the
continuation only: a list of messages or a string (one assistant message), as in TRL's
conversational "prompt/chosen/rejected" data. A ``chosen``/``rejected`` list that starts
with a system or user message is a whole conversation and the ``prompt`` column is then
not read (UltraFeedback-style data repeats the prompt there).
``prompt_chosen_rejected``: plain strings, rendered as a user turn and an assistant turn;
with ``use_chat_template=False`` (base models, no chat template) they are raw text instead
(see below; no ``system`` column or ``system_prompt`` then).

Raw text (``use_chat_template=False``): ``prompt + chosen`` and ``prompt + rejected`` are each
tokenised as one text with the tokenizer's special tokens (BOS) and EOS appended, the prompt
boundary taken from the character offsets
(:meth:`~tunesmith.data.tokenizer.Tokenizer.encode_split`: a token straddling the boundary
belongs to the response), exactly like SFT's raw ``prompt_completion``. The prompt tokens of
both sides must be identical (else ``prompt_mismatch``); the responses and EOS are trained.

Tokenisation: the prompt (the shared messages plus the template's generation prompt) is
tokenised once; each full conversation is tokenised with
``Tokenizer.tokenize_conversation(..., return_spans=True)``, and its response is the tokens
after the prompt. Both full token sequences must start with the prompt's tokens. When a
template does not keep that prefix stable (the reply's first characters merge with the end
of the generation prompt into one token, or the template renders the last assistant turn's
header differently from its generation prompt), the prompt becomes the longest common
prefix of the chosen and rejected tokens that ends at or before the start of both last
replies (the spans ``tokenize_conversation`` gives); the few tokens between that point and
each reply are then untrained response context. Either way the sequences are exactly the
template's rendering of each conversation (tokens after the end-of-turn token, such as
Qwen's newline, included but not trained).

Trained tokens: only the last assistant reply, with its end-of-turn token, as
``tokenize_conversation`` marks it. Labels are shifted as everywhere in tunesmith
(``labels[i]`` is the target of position ``i``, see ``labels.py``), so the first trained
label sits at position ``prompt_len - 1`` or later.

Truncation, when ``prompt_len + max(len(chosen), len(rejected)) > max_seq_len``:

- ``"keep_end"`` (default) / ``"keep_start"``: first, if ``max_prompt_len`` is given and
  the prompt is longer, the prompt is cut to ``max_prompt_len`` tokens keeping its end
  (the latest turns and the generation prompt) or its start; then both responses are cut
  to the same budget ``max_seq_len - prompt_len``, keeping their start. Pairs that fit are
  not touched, whatever ``max_prompt_len`` says.
- ``"drop"``: the pair is a ``too_long`` bad row.

A response left with no trained token is ``no_trained_tokens``.

Bad pairs (reason codes from ``report.py``): ``missing_field`` (no or empty
chosen/rejected), ``wrong_type``, ``empty_assistant_turn``, the conversation checks of
``formats.check_messages``, ``last_turn_not_assistant``, ``prompt_mismatch`` (the parts
before the last assistant message differ), ``identical_responses`` (chosen equals
rejected, as messages or as tokens after tokenisation and truncation), ``template_error``,
``too_long`` and ``no_trained_tokens``.

A sample is ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
"rejected_labels"}`` (lists of int, each sequence ``prompt + response``) plus
``"prompt_len"`` (int): both sequences share their first ``prompt_len`` tokens. Batch
samples with :func:`~tunesmith.data.collate.collate_preference`.

Example (YAML)::

    dataset:
      _component_: tunesmith.data.preference_dataset.PreferenceDataset
      source: data/prefs.jsonl
      format: prompt_chosen_rejected
      column_map: {prompt: question, chosen: good, rejected: bad}
      max_seq_len: 1024
      max_prompt_len: 512
      on_bad_row: skip
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from torch.utils.data import Dataset

from tunesmith.config.registry import component
from tunesmith.data.chat_template import TemplateBudgetError, chat_template_hint
from tunesmith.data.formats import check_columns, check_messages, resolve_columns
from tunesmith.data.labels import count_trained, make_labels
from tunesmith.data.report import (
    BAD_ROW_POLICIES,
    EMPTY_ASSISTANT_TURN,
    IDENTICAL_RESPONSES,
    LAST_TURN_NOT_ASSISTANT,
    MISSING_FIELD,
    NO_TRAINED_TOKENS,
    PROMPT_MISMATCH,
    TEMPLATE_ERROR,
    TOO_LONG,
    WRONG_TYPE,
    BadRow,
    OnBadRow,
)
from tunesmith.data.sources import MAX_ROW_BYTES, DataSource, check_max_row_bytes, load_rows
from tunesmith.data.token_cache import CachedRows, tokenize_rows, tokenize_with_cache

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = [
    "BAD_ROW_POLICIES",
    "PREFERENCE_FORMATS",
    "PREFERENCE_FORMAT_FIELDS",
    "PREFERENCE_TRUNCATION",
    "PreferenceDataset",
    "PreferencePair",
    "RawPreferencePair",
    "convert_preference_row",
    "resolve_preference_columns",
    "tokenize_pair",
]

PREFERENCE_FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("chosen", "rejected"), ("prompt",)),
    "prompt_chosen_rejected": (("prompt", "chosen", "rejected"), ("system",)),
}
"""format -> (required fields, optional fields)."""

PREFERENCE_FORMATS = tuple(PREFERENCE_FORMAT_FIELDS)
PreferenceFormat = Literal[PREFERENCE_FORMATS]  # type: ignore[valid-type]
PreferenceTruncation = Literal["keep_end", "keep_start", "drop"]
PREFERENCE_TRUNCATION: tuple[str, ...] = get_args(PreferenceTruncation)

_SIDES = ("chosen", "rejected")


@dataclass
class RawPreferencePair:
    """A checked raw-text pair (no chat template): the prompt and the two continuations."""

    prompt: str
    chosen: str
    rejected: str


@dataclass
class PreferencePair:
    """A checked pair: the shared prompt messages and the two final assistant messages."""

    prompt: list[dict[str, Any]]
    chosen: dict[str, Any]
    rejected: dict[str, Any]


# ------------------------------------------------------------------------------ columns


def resolve_preference_columns(
    format: str, column_map: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Map each field of a preference ``format`` to its column name.

    Example::

        >>> resolve_preference_columns("prompt_chosen_rejected", {"chosen": "good"})
        {'prompt': 'prompt', 'chosen': 'good', 'rejected': 'rejected', 'system': 'system'}
    """
    return resolve_columns(format, column_map, PREFERENCE_FORMAT_FIELDS)


# ------------------------------------------------------------------------- row -> pair


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _required(row: Mapping[str, Any], column: str) -> Any:
    value = row.get(column)
    if value is None:
        raise BadRow(MISSING_FIELD, f"column {column!r} is missing or null")
    if _is_list(value) and len(value) == 0:
        raise BadRow(MISSING_FIELD, f"column {column!r} is an empty list")
    return value


def _text(row: Mapping[str, Any], column: str, required: bool = True) -> str | None:
    value = _required(row, column) if required else row.get(column)
    if value is not None and not isinstance(value, str):
        raise BadRow(WRONG_TYPE, f"column {column!r} is {type(value).__name__}, expected str")
    return value


def _assistant(text: str, column: str) -> dict[str, Any]:
    if not text.strip():
        raise BadRow(EMPTY_ASSISTANT_TURN, f"column {column!r} is empty")
    return {"role": "assistant", "content": text}


def _prompt_messages(value: object, column: str) -> list[Any] | None:
    """The ``prompt`` column of the ``messages`` format: None, a list, or one user string."""
    if value is None:
        return None
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if _is_list(value):
        return list(value)
    raise BadRow(
        WRONG_TYPE, f"column {column!r} is {type(value).__name__}, expected a list of messages"
    )


def _starts_conversation(messages: Sequence[Any]) -> bool:
    first = messages[0]
    return isinstance(first, Mapping) and first.get("role") in ("system", "user")


def _full_conversation(
    value: object, column: str, prompt: list[Any] | None, prompt_column: str
) -> tuple[list[Any], str]:
    """One side of a ``messages`` row as a whole conversation, and its name for messages."""
    if isinstance(value, str):
        if prompt is None:
            raise BadRow(
                WRONG_TYPE,
                f"column {column!r} is a string; without a {prompt_column!r} column it must be "
                "a conversation (a list of messages)",
            )
        return [*prompt, _assistant(value, column)], f"{prompt_column}+{column}"
    if not _is_list(value):
        raise BadRow(
            WRONG_TYPE,
            f"column {column!r} is {type(value).__name__}, expected a list of messages or a str",
        )
    if prompt is None or _starts_conversation(value):
        return list(value), column
    return [*prompt, *value], f"{prompt_column}+{column}"


def _with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    if system is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _conversations(
    row: Mapping[str, Any], format: str, columns: Mapping[str, str]
) -> tuple[list[Any], list[Any], str, str]:
    """(chosen, rejected) conversations of a row, unchecked, with their names for messages."""
    chosen_value = _required(row, columns["chosen"])
    rejected_value = _required(row, columns["rejected"])
    if format == "prompt_chosen_rejected":
        prompt_text = _text(row, columns["prompt"])
        system = _text(row, columns["system"], required=False)
        prompt = [{"role": "user", "content": prompt_text}]
        if system is not None:
            prompt.insert(0, {"role": "system", "content": system})
        chosen = [*prompt, _assistant(_text(row, columns["chosen"]), columns["chosen"])]
        rejected = [*prompt, _assistant(_text(row, columns["rejected"]), columns["rejected"])]
        return chosen, rejected, columns["chosen"], columns["rejected"]
    prompt_column = columns["prompt"]
    prompt = _prompt_messages(row.get(prompt_column), prompt_column)
    chosen, chosen_name = _full_conversation(chosen_value, columns["chosen"], prompt, prompt_column)
    rejected, rejected_name = _full_conversation(
        rejected_value, columns["rejected"], prompt, prompt_column
    )
    return chosen, rejected, chosen_name, rejected_name


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def convert_preference_row(
    row: Mapping[str, Any],
    format: str = "messages",
    column_map: Mapping[str, str] | None = None,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> PreferencePair | RawPreferencePair:
    """Check one row and split it into the shared prompt and the two replies; raise ``BadRow``.

    ``system_prompt`` is added to conversations that have no system message. With
    ``use_chat_template=False`` (``prompt_chosen_rejected`` only) the row's strings are kept
    as raw text in a :class:`RawPreferencePair`.

    Example::

        >>> pair = convert_preference_row(
        ...     {"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "prompt_chosen_rejected")
        >>> pair.prompt, pair.chosen["content"], pair.rejected["content"]
        ([{'role': 'user', 'content': '2+2?'}], '4', '5')
    """
    columns = resolve_preference_columns(format, column_map)
    if not isinstance(row, Mapping):
        raise BadRow(WRONG_TYPE, f"row is {type(row).__name__}, expected an object")
    if not use_chat_template:
        return _raw_pair(row, format, columns)
    chosen, rejected, chosen_name, rejected_name = _conversations(row, format, columns)
    sides = []
    for messages, name in ((chosen, chosen_name), (rejected, rejected_name)):
        messages = _with_system(check_messages(messages, name), system_prompt)
        if messages[-1]["role"] != "assistant":
            raise BadRow(
                LAST_TURN_NOT_ASSISTANT,
                f"{name} ends with a {messages[-1]['role']!r} message, expected the assistant "
                "reply to be rated",
            )
        sides.append(messages)
    chosen, rejected = sides
    if chosen[:-1] != rejected[:-1]:
        at = _first_difference(chosen[:-1], rejected[:-1])
        raise BadRow(
            PROMPT_MISMATCH,
            f"{chosen_name} and {rejected_name} differ before their last assistant message "
            f"(first at message {at}; {len(chosen) - 1} vs {len(rejected) - 1} prompt messages)",
        )
    if chosen[-1] == rejected[-1]:
        raise BadRow(IDENTICAL_RESPONSES, f"{chosen_name} and {rejected_name} have the same reply")
    return PreferencePair(chosen[:-1], chosen[-1], rejected[-1])


def _raw_pair(row: Mapping[str, Any], format: str, columns: Mapping[str, str]) -> RawPreferencePair:
    if format != "prompt_chosen_rejected":
        raise ValueError(
            f"use_chat_template=False needs format 'prompt_chosen_rejected' (raw strings), "
            f"got {format!r}"
        )
    if _text(row, columns["system"], required=False) is not None:
        raise BadRow(
            WRONG_TYPE,
            f"column {columns['system']!r} is set, but raw text (use_chat_template=False) has "
            "no system turn; put it in the prompt text",
        )
    prompt = _text(row, columns["prompt"])
    chosen = _assistant(_text(row, columns["chosen"]), columns["chosen"])["content"]
    rejected = _assistant(_text(row, columns["rejected"]), columns["rejected"])["content"]
    if chosen == rejected:
        raise BadRow(
            IDENTICAL_RESPONSES, f"{columns['chosen']} and {columns['rejected']} are the same text"
        )
    return RawPreferencePair(prompt, chosen, rejected)


# ----------------------------------------------------------------------------- tokens


def _raw_sequences(
    tokenizer: Tokenizer, pair: RawPreferencePair
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Prompt ids and (response ids, mask) per side of a raw pair, each side one text."""
    eos = tokenizer.eos_id
    sides = []
    for reply in (pair.chosen, pair.rejected):
        ids, n = tokenizer.encode_split(pair.prompt, reply)
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        sides.append((ids[:n], ids[n:]))
    (prompt, chosen), (other_prompt, rejected) = sides
    if prompt != other_prompt:
        at = _first_difference(prompt, other_prompt)
        raise BadRow(
            PROMPT_MISMATCH,
            f"the prompt's tokens differ with the chosen and the rejected continuation (first "
            f"at token {at}; {len(prompt)} vs {len(other_prompt)} tokens): the prompt's end "
            "merges differently with each reply's start",
        )
    return prompt, [(chosen, [1] * len(chosen)), (rejected, [1] * len(rejected))]


def _tokenize(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any],
    what: str,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    try:
        ids, mask, spans = tokenizer.tokenize_conversation(
            messages,
            add_generation_prompt=add_generation_prompt,
            return_spans=True,
            **template_kwargs,
        )
    except TemplateBudgetError:  # the template itself is broken or hostile, not this row
        raise
    except Exception as e:  # a template's raise_exception, or a template that fails to render
        raise BadRow(
            TEMPLATE_ERROR, f"the chat template failed on the {what}: {type(e).__name__}: {e}"
        ) from e
    return list(ids), list(mask), list(spans)


def _last_reply_mask(length: int, spans: list[tuple[int, int]], side: str) -> tuple[list[int], int]:
    """Mask of the last reply span and the span's start."""
    if not spans or spans[-1][1] <= spans[-1][0]:
        raise BadRow(NO_TRAINED_TOKENS, f"the chat template marks no tokens of the {side} reply")
    start, end = spans[-1]
    return [0] * start + [1] * (end - start) + [0] * (length - end), start


def _prompt_length(prompt: list[int], sides: Sequence[tuple[list[int], int]]) -> int:
    """Where the responses start: after ``prompt`` when both sequences keep it as a prefix
    (and their replies start after it), else the longest common prefix that ends at or before
    both reply starts (see the module docs)."""
    n = len(prompt)
    if all(ids[:n] == prompt and start >= n for ids, start in sides):
        return n
    (a, start_a), (b, start_b) = sides
    return _first_difference(a[: min(start_a, start_b)], b[: min(start_a, start_b)])


def _fit(
    prompt: list[int],
    responses: list[tuple[list[int], list[int]]],
    max_seq_len: int | None,
    max_prompt_len: int | None,
    truncation: str,
) -> tuple[list[int], list[tuple[list[int], list[int]]], bool]:
    """Apply the truncation policy; return (prompt, [(ids, mask)] per side, was_cut)."""
    longest = max(len(ids) for ids, _ in responses)
    if max_seq_len is None or len(prompt) + longest <= max_seq_len:
        return prompt, responses, False
    if truncation == "drop":
        raise BadRow(
            TOO_LONG,
            f"prompt {len(prompt)} + longest response {longest} tokens > max_seq_len={max_seq_len}",
        )
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
        prompt = prompt[-max_prompt_len:] if truncation == "keep_end" else prompt[:max_prompt_len]
    budget = max_seq_len - len(prompt)
    if budget < 1:
        raise BadRow(
            NO_TRAINED_TOKENS,
            f"the prompt alone has {len(prompt)} tokens >= max_seq_len={max_seq_len}, leaving "
            "no room for the responses (set max_prompt_len to cut the prompt)",
        )
    return prompt, [(ids[:budget], mask[:budget]) for ids, mask in responses], True


def _templated_sequences(
    tokenizer: Tokenizer, pair: PreferencePair, kwargs: Mapping[str, Any]
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Prompt ids and (response ids, mask) per side of a chat pair (see the module docs)."""
    prompt_ids, _, _ = _tokenize(tokenizer, pair.prompt, kwargs, "prompt", True)
    full: list[tuple[list[int], list[int], int]] = []
    for side, reply in zip(_SIDES, (pair.chosen, pair.rejected), strict=True):
        ids, _, spans = _tokenize(tokenizer, [*pair.prompt, reply], kwargs, f"{side} conversation")
        mask, start = _last_reply_mask(len(ids), spans, side)
        full.append((ids, mask, start))
    n = _prompt_length(prompt_ids, [(ids, start) for ids, _, start in full])
    return full[0][0][:n], [(ids[n:], mask[n:]) for ids, mask, _ in full]


def tokenize_pair(
    tokenizer: Tokenizer,
    pair: PreferencePair | RawPreferencePair,
    *,
    max_seq_len: int | None = None,
    max_prompt_len: int | None = None,
    truncation: str = "keep_end",
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Tokenise one checked pair; return ``(sample, was_truncated)`` or raise ``BadRow``.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> pair = convert_preference_row(
        ...     {"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "prompt_chosen_rejected")
        >>> sample, cut = tokenize_pair(tok, pair, max_seq_len=512)
        >>> sample["chosen_input_ids"][: sample["prompt_len"]] == (
        ...     sample["rejected_input_ids"][: sample["prompt_len"]])
        True
    """
    if isinstance(pair, RawPreferencePair):
        prompt, responses = _raw_sequences(tokenizer, pair)
    else:
        prompt, responses = _templated_sequences(tokenizer, pair, dict(template_kwargs or {}))
    prompt, responses, cut = _fit(prompt, responses, max_seq_len, max_prompt_len, truncation)
    if responses[0][0] == responses[1][0]:
        after = f" after truncation to max_seq_len={max_seq_len}" if cut else ""
        raise BadRow(IDENTICAL_RESPONSES, f"chosen and rejected have the same tokens{after}")
    sample: dict[str, Any] = {}
    for side, (ids, mask) in zip(_SIDES, responses, strict=True):
        labels = make_labels(prompt + ids, [0] * len(prompt) + mask)
        if count_trained(labels) == 0:
            after = f" after truncation to max_seq_len={max_seq_len}" if cut else ""
            raise BadRow(NO_TRAINED_TOKENS, f"the {side} response has no trained tokens{after}")
        sample[f"{side}_input_ids"] = prompt + ids
        sample[f"{side}_labels"] = labels
    sample["prompt_len"] = len(prompt)
    return sample, cut


# ---------------------------------------------------------------------------- dataset


@component
class PreferenceDataset(Dataset):
    """Preference pairs (chosen / rejected replies to one prompt) from a file or Hub dataset.

    Args:
        tokenizer: a :class:`~tunesmith.data.tokenizer.Tokenizer` (with a chat template
            unless ``use_chat_template=False``).
        source: local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv`` file, local
            folder, or ``datasets.load_dataset`` name.
        format: ``"messages"`` or ``"prompt_chosen_rejected"`` (see the module docs).
        column_map: ``{field: column}`` to read a field from another column.
        split, data_files: passed to ``datasets.load_dataset`` (folders, Hub names).
        max_seq_len: longest sequence (prompt + one response) in tokens (None: no limit).
        max_prompt_len: when a pair is too long, first cut its prompt to this many tokens.
        truncation: ``"keep_end"`` or ``"keep_start"`` (which part of a cut prompt stays;
            responses always keep their start) or ``"drop"`` (too long pairs are bad rows).
        on_bad_row: ``"error"`` (raise at the first bad row) or ``"skip"`` (count it).
        system_prompt: system message for conversations that have none.
        template_kwargs: extra chat template variables (e.g. ``{"enable_thinking": False}``).
        use_chat_template: ``False`` tokenises ``prompt_chosen_rejected`` rows as raw text
            (base models; see the module docs).
        cache_dir: folder of the tokenised-rows cache (:mod:`~tunesmith.data.token_cache`:
            keyed by the data file's bytes, the tokenizer and these settings); None: no cache.
        max_row_bytes: the largest row read, in bytes (16 MiB by default): a bigger line,
            JSON array element or CSV record is a ``row_too_large`` bad row, skipped unread
            (``on_bad_row``).

    Attributes:
        samples: the sample dicts (see the module docs), in source order.
        row_indices: the source row of each sample.
        report: a :class:`~tunesmith.data.report.DataReport`; its ``tokens`` and
            ``trained_tokens`` count both sequences of every kept pair.
        cache_note: the line to log about the cache (a hit, or where the rows were cached),
            None without one.

    Example::

        >>> import json
        >>> from pathlib import Path
        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> _ = Path("prefs.jsonl").write_text(
        ...     json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\\n")
        >>> ds = PreferenceDataset(tok, source="prefs.jsonl", format="prompt_chosen_rejected",
        ...                        max_seq_len=1024)
        >>> sorted(ds[0])  # doctest: +NORMALIZE_WHITESPACE
        ['chosen_input_ids', 'chosen_labels', 'prompt_len', 'rejected_input_ids',
         'rejected_labels']
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        source: DataSource,
        format: PreferenceFormat = "messages",
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
        _check_arguments(max_seq_len, max_prompt_len, truncation, on_bad_row)
        check_max_row_bytes(max_row_bytes)
        if not use_chat_template:
            if format != "prompt_chosen_rejected":
                raise ValueError(
                    "use_chat_template=False needs format 'prompt_chosen_rejected' (raw "
                    f"strings), got {format!r}"
                )
            if system_prompt is not None:
                raise ValueError("system_prompt needs the chat template (use_chat_template=False)")
        elif warning := tokenizer.bos_spacing_warning(**(template_kwargs or {})):
            warnings.warn(warning, stacklevel=2)
        if use_chat_template and not tokenizer.chat_templates:
            raise ValueError(
                f"PreferenceDataset renders conversations with the chat template, but the "
                f"tokenizer {getattr(tokenizer, 'name', '')} has none: {chat_template_hint()}"
            )
        columns = resolve_preference_columns(format, column_map)
        self.format = format
        self.max_seq_len = max_seq_len

        def make_sample(row: Any) -> tuple[dict[str, Any], bool]:
            pair = convert_preference_row(
                row,
                format,
                column_map,
                system_prompt=system_prompt,
                use_chat_template=use_chat_template,
            )
            return tokenize_pair(
                tokenizer,
                pair,
                max_seq_len=max_seq_len,
                max_prompt_len=max_prompt_len,
                truncation=truncation,
                template_kwargs=template_kwargs,
            )

        def build() -> CachedRows:
            rows = load_rows(
                source, split=split, data_files=data_files, max_row_bytes=max_row_bytes
            )
            check_columns(format, columns, rows.columns, rows.name, PREFERENCE_FORMAT_FIELDS)
            return tokenize_rows(rows, make_sample, on_bad_row, _keep, "pairs")

        settings = {
            "dataset": "PreferenceDataset", "format": format, "column_map": column_map,
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

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def _keep(built: CachedRows, sample: dict[str, Any], index: int, cut: bool) -> None:
    built.samples.append(sample)
    built.row_indices.append(index)
    built.report.samples += 1
    built.report.truncated += int(cut)
    for side in _SIDES:
        built.report.tokens += len(sample[f"{side}_input_ids"])
        built.report.trained_tokens += count_trained(sample[f"{side}_labels"])


def _check_arguments(
    max_seq_len: int | None, max_prompt_len: int | None, truncation: str, on_bad_row: str
) -> None:
    if truncation not in PREFERENCE_TRUNCATION:
        raise ValueError(f"truncation must be one of {PREFERENCE_TRUNCATION}, got {truncation!r}")
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    if max_seq_len is not None and max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2 (or None), got {max_seq_len}")
    if max_prompt_len is not None:
        if max_seq_len is None:
            raise ValueError("max_prompt_len needs max_seq_len (it only applies to long pairs)")
        if not 1 <= max_prompt_len < max_seq_len:
            raise ValueError(
                f"max_prompt_len must be in [1, max_seq_len={max_seq_len}), got {max_prompt_len}"
            )
