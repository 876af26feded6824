"""Bad-row errors and the per-dataset report of what was kept, skipped and truncated.

A row that cannot become a correct training sample raises :class:`BadRow` inside the
converters. The dataset either stops with a :class:`BadRowError` (naming the file, the
row and the reason) or counts the row in its :class:`DataReport` and skips it. Both name a
row the same way (:func:`row_number`): by the 1-based line it starts on where the reader
knows it (JSON Lines, JSON arrays, CSV, text), else by its 1-based row number.

Example::

    >>> report = DataReport(source="train.jsonl", unit="line")
    >>> report.add_bad(BadRow(MISSING_FIELD, "no 'output'"), 3)
    >>> report.skipped, report.examples["missing_field"]
    ({'missing_field': 1}, [3])
    >>> print(report.summary().splitlines()[1])
      skipped 1 x missing_field (lines 3; first: no 'output')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tunesmith.config.errors import override_hint

__all__ = [
    "raise_if_empty",
    "BAD_ROW_POLICIES",
    "OnBadRow",
    "read_samples",
    "row_number",
    "BAD_ROW_REASONS",
    "EMPTY_ASSISTANT_TURN",
    "EMPTY_TEXT",
    "IDENTICAL_RESPONSES",
    "INVALID_UTF8",
    "LAST_TURN_NOT_ASSISTANT",
    "MALFORMED_JSON",
    "MISSING_FIELD",
    "NO_ASSISTANT_TURN",
    "NO_TRAINED_TOKENS",
    "PROMPT_MISMATCH",
    "ROLES_OUT_OF_ORDER",
    "TEMPLATE_ERROR",
    "TOO_LONG",
    "ROW_TOO_LARGE",
    "UNKNOWN_ROLE",
    "WRONG_TYPE",
    "BadRow",
    "BadRowError",
    "DataError",
    "DataReport",
]

# Reason codes: stable strings, used as keys of DataReport.skipped / .examples.
MALFORMED_JSON = "malformed_json"
INVALID_UTF8 = "invalid_utf8"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
ROLES_OUT_OF_ORDER = "roles_out_of_order"
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
EMPTY_TEXT = "empty_text"
TEMPLATE_ERROR = "template_error"
TOO_LONG = "too_long"
ROW_TOO_LARGE = "row_too_large"  # a line or row over the reader's byte limit
NO_TRAINED_TOKENS = "no_trained_tokens"
# Preference pairs (preference_dataset.py)
LAST_TURN_NOT_ASSISTANT = "last_turn_not_assistant"
PROMPT_MISMATCH = "prompt_mismatch"
IDENTICAL_RESPONSES = "identical_responses"

BAD_ROW_REASONS = (
    MALFORMED_JSON,
    INVALID_UTF8,
    MISSING_FIELD,
    WRONG_TYPE,
    UNKNOWN_ROLE,
    ROLES_OUT_OF_ORDER,
    NO_ASSISTANT_TURN,
    EMPTY_ASSISTANT_TURN,
    EMPTY_TEXT,
    TEMPLATE_ERROR,
    TOO_LONG,
    ROW_TOO_LARGE,
    NO_TRAINED_TOKENS,
    LAST_TURN_NOT_ASSISTANT,
    PROMPT_MISMATCH,
    IDENTICAL_RESPONSES,
)


OnBadRow = Literal["error", "skip"]
"""What a dataset does with a bad row (``on_bad_row``): stop with a :class:`BadRowError`, or
count it in its :class:`DataReport` and go on."""
BAD_ROW_POLICIES: tuple[str, ...] = get_args(OnBadRow)


class DataError(ValueError):
    """A dataset that cannot be used as given (bad file, missing column, bad row...)."""


class BadRow(Exception):
    """Raised by converters for one unusable row; carries a reason code and a detail.

    Example::

        >>> str(BadRow(WRONG_TYPE, "messages[1].content is int, expected str"))
        'wrong_type: messages[1].content is int, expected str'
    """

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in BAD_ROW_REASONS:
            raise ValueError(f"unknown bad-row reason {reason!r}; known: {BAD_ROW_REASONS}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_LINE = re.compile(r"\(line (\d+)\)")


def row_number(index: int, where: str) -> tuple[str, int]:
    """How every message names the source row ``index`` (0-based) that a reader located at
    ``where`` (``" (line 7)"``, or ``""``): ``("line", n)``, the 1-based line it starts on,
    where the reader knows it, else ``("row", index + 1)``.

    >>> row_number(1, " (line 3)"), row_number(1, "")
    (('line', 3), ('row', 2))
    """
    found = _LINE.search(where)
    return ("line", int(found.group(1))) if found else ("row", index + 1)


class BadRowError(DataError):
    """A bad row met with ``on_bad_row="error"``: names the source, the row (as
    :func:`row_number` does) and the reason. ``row`` is the 0-based index of the row."""

    def __init__(self, source: str, row: int, where: str, bad: BadRow) -> None:
        unit, number = row_number(row, where)
        super().__init__(
            f"{source}: bad row at {unit} {number}: {bad.reason}: {bad.detail} "
            f"(set {override_hint('on_bad_row', 'skip')} to skip and count such rows)"
        )
        self.source = source
        self.row = row
        self.reason = bad.reason
        self.detail = bad.detail


@dataclass
class DataReport:
    """What happened to each row of a dataset.

    ``rows`` counts every row read, ``samples`` the rows that became samples,
    ``skipped`` maps reason -> count, ``examples`` maps reason -> the first
    ``max_examples`` skipped rows in source order, numbered as :class:`BadRowError` numbers
    them (:func:`row_number`: 1-based; ``unit`` says whether lines or rows), ``details`` the
    detail text of the first example per reason. ``truncated`` counts kept samples
    that were cut to ``max_seq_len``; ``tokens`` / ``trained_tokens`` sum the kept
    samples' lengths and their positions with a label.
    """

    source: str
    rows: int = 0
    samples: int = 0
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    max_examples: int = 10
    unit: str = "row"

    @property
    def num_skipped(self) -> int:
        """Total number of skipped rows."""
        return sum(self.skipped.values())

    def add_bad(self, bad: BadRow, row: int) -> None:
        """Count one skipped row (its number in :attr:`unit`) under its reason."""
        self.skipped[bad.reason] = self.skipped.get(bad.reason, 0) + 1
        rows = self.examples.setdefault(bad.reason, [])
        if len(rows) < self.max_examples:
            rows.append(row)
        self.details.setdefault(bad.reason, bad.detail)

    def summary(self) -> str:
        """One human-readable paragraph for the training log."""
        lines = [
            f"{self.source}: {self.rows} rows -> {self.samples} samples "
            f"({self.tokens} tokens, {self.trained_tokens} trained), "
            f"{self.truncated} truncated, {self.num_skipped} skipped"
        ]
        for reason, count in sorted(self.skipped.items()):
            rows = ", ".join(str(r) for r in self.examples[reason])
            more = ", ..." if count > len(self.examples[reason]) else ""
            lines.append(
                f"  skipped {count} x {reason} ({self.unit}s {rows}{more}; first: "
                f"{self.details[reason]})"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        """Plain-data view, e.g. for a metrics logger or a JSON file."""
        return {
            "source": self.source,
            "rows": self.rows,
            "samples": self.samples,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "skipped": dict(self.skipped),
            "examples": {k: list(v) for k, v in self.examples.items()},
        }


def read_samples(
    rows: Iterable[tuple[int, str, Any]],
    make_sample: Callable[[Any], tuple[Any, bool]],
    on_bad_row: str,
    report: DataReport,
) -> Iterator[tuple[int, Any, bool]]:
    """``(row index, sample, was_truncated)`` for each row ``make_sample`` turns into a sample.

    Counts every row in ``report``. A row that is a :class:`BadRow` (the reader could not
    parse it) or whose ``make_sample`` raises one raises :class:`BadRowError` naming the
    source and row when ``on_bad_row="error"``, else is counted as skipped.
    """
    for index, where, row in rows:
        report.rows += 1
        try:
            if isinstance(row, BadRow):
                raise row
            sample, cut = make_sample(row)
        except BadRow as bad:
            if on_bad_row == "error":
                raise BadRowError(report.source, index, where, bad) from bad
            report.unit, number = row_number(index, where)
            report.add_bad(bad, number)
            continue
        yield index, sample, cut


def raise_if_empty(report: DataReport, what: str = "samples") -> None:
    """A dataset whose every row was skipped is an error that lists the reasons."""
    if report.samples == 0:
        reasons = "; ".join(line.strip() for line in report.summary().splitlines()[1:])
        raise DataError(f"{report.source}: no usable {what}, every row was skipped: {reasons}")
