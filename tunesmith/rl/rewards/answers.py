"""Answer rewards: pull the final answer out of a completion and compare it with the reference.

:func:`extract_answer` finds the answer by one of these modes:

- ``"answer_tag"``: the content of the last ``<answer>...</answer>``;
- ``"boxed"``: the content of the last ``\\boxed{...}`` (braces balanced);
- ``"last_number"``: the last number (``-3``, ``1,000``, ``0.5``);
- ``"auto"``: the answer tag (unwrapping a ``\\boxed{}`` inside it), else the boxed content,
  else the last number;
- ``"none"``: the whole completion.

:class:`ExactAnswer` compares numbers numerically (``"1,000" == 1000``, ``"0.50" == 0.5``,
``"1/2" == 0.5``) and other strings after normalising case and whitespace.
:class:`MathAnswer` compares mathematically with ``math-verify`` (``\\frac{1}{2}`` == ``0.5``,
sets, intervals, expressions).

Example::

    >>> extract_answer("<think>2+2</think> <answer> 4 </answer>")
    '4'
    >>> extract_answer("so the result is \\\\boxed{\\\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> ExactAnswer()([Sample("", "It costs 1,000 dollars.", answer=1000)])
    [1.0]
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Literal, get_args

from tunesmith.config.registry import component
from tunesmith.rl.rewards.base import Sample

__all__ = [
    "EXTRACT_MODES",
    "ExactAnswer",
    "ExtractMode",
    "MathAnswer",
    "extract_answer",
    "parse_number",
]

logger = logging.getLogger(__name__)

ExtractMode = Literal["auto", "answer_tag", "boxed", "last_number", "none"]
EXTRACT_MODES: tuple[str, ...] = get_args(ExtractMode)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number not glued to a word or another number: "-3", "1,000", "12.5", ".5" is not one.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def check_extract_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`EXTRACT_MODES`, else a ValueError naming it."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"extract={mode!r} is not one of {list(EXTRACT_MODES)}")
    return mode


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer in ``text`` by ``mode`` (see the module docs), stripped; None if not found.

    Example::

        >>> extract_answer("x = 3, then y = -12.5", "last_number")
        '-12.5'
        >>> extract_answer("<answer>\\\\boxed{7}</answer>"), extract_answer("no answer", "boxed")
        ('7', None)
    """
    check_extract_mode(mode)
    if mode == "none":
        return text.strip()
    if mode == "answer_tag":
        return _last_answer_tag(text)
    if mode == "boxed":
        return _last_boxed(text)
    if mode == "last_number":
        return _last_number(text)
    tagged = _last_answer_tag(text)
    if tagged is not None:
        boxed = _last_boxed(tagged)
        return tagged if boxed is None else boxed
    boxed = _last_boxed(text)
    return boxed if boxed is not None else _last_number(text)


def parse_number(value: Any) -> Fraction | float | None:
    """``value`` as a number, or None: ints/floats as they are, strings like ``"1,000"``,
    ``" -0.50 "``, ``"1/2"``, ``"$18"``, ``"1e-3"`` exactly (thousands commas only in groups of
    three). Booleans are not numbers.

    Example::

        >>> parse_number("1,000"), parse_number("3/4"), parse_number("1,2"), parse_number(True)
        (Fraction(1000, 1), Fraction(3, 4), None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("$"):
        text = text[1:].strip()
    if "," in text:
        if not _THOUSANDS.match(text):
            return None
        text = text.replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    text = " ".join(str(text).split()).lower()
    return text[:-1].rstrip() if text.endswith(".") else text


def _references(answer: Any) -> list[Any]:
    if answer is None:
        raise ValueError("the sample has no reference answer (Sample.answer is None)")
    return list(answer) if isinstance(answer, (list, tuple)) else [answer]


@component
class ExactAnswer:
    """1.0 when the extracted answer equals the reference, else 0.0.

    Both parse as numbers (:func:`parse_number`): equal within ``rel_tol`` (relative) or
    ``abs_tol``; else the strings compare after lower-casing, collapsing whitespace and
    dropping a final period. A list/tuple reference accepts any of its items. A sample
    without a reference raises (the :class:`~tunesmith.rl.rewards.RewardSet` scores it 0 and
    counts it); a completion with no answer scores 0.

    Args:
        extract: how to find the answer (:data:`EXTRACT_MODES`).
        numeric: compare numerically when both sides are numbers.
        rel_tol, abs_tol: numeric tolerances.

    Example::

        >>> reward = ExactAnswer(extract="answer_tag")
        >>> reward([Sample("", "<answer>0.50</answer>", answer="0.5"),
        ...         Sample("", "<answer> PARIS </answer>", answer="Paris"),
        ...         Sample("", "0.5", answer="0.5")])
        [1.0, 1.0, 0.0]
    """

    name = "exact_answer"

    def __init__(
        self,
        extract: ExtractMode = "auto",
        numeric: bool = True,
        rel_tol: float = 1e-6,
        abs_tol: float = 1e-9,
        name: str = "exact_answer",
    ) -> None:
        self.extract = check_extract_mode(extract)
        self.numeric = numeric
        self.rel_tol = float(rel_tol)
        self.abs_tol = float(abs_tol)
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        references = _references(sample.answer)
        found = extract_answer(sample.completion, self.extract)
        if found is None:
            return 0.0
        return 1.0 if any(self._equal(found, ref) for ref in references) else 0.0

    def _equal(self, found: str, reference: Any) -> bool:
        if self.numeric:
            a, b = parse_number(found), parse_number(reference)
            if a is not None and b is not None:
                if a == b:
                    return True
                fa, fb = float(a), float(b)
                return math.isclose(fa, fb, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return _normalise(found) == _normalise(reference)


_THREAD_WARNED = False


@component
class MathAnswer:
    """1.0 when the completion's answer is mathematically equal to the reference
    (``math_verify.parse`` + ``math_verify.verify``), else 0.0.

    The reference (a number or a LaTeX/plain string) is parsed as math. With
    ``extract="auto"`` the completion's ``<answer>`` tag content, else its ``\\boxed{}``
    content, is parsed; without either, the whole completion goes to math-verify, which finds
    the last LaTeX/expression answer itself. Other modes as :func:`extract_answer` (nothing
    found scores 0). Extracted text without math delimiters is read as ``$text$``.

    math-verify can be slow on adversarial input: ``timeout_s`` bounds each parse and each
    comparison (math-verify's own ``parsing_timeout``/``timeout_seconds``, whole seconds).
    That timeout uses ``signal.alarm``, which works only in the main thread; called from
    another thread the reward runs without it and warns once. A timed-out parse or
    comparison scores 0.

    Example::

        >>> reward = MathAnswer()
        >>> reward([Sample("", "<answer>\\\\frac{1}{2}</answer>", answer="0.5"),
        ...         Sample("", "so \\\\boxed{3}", answer="4")])
        [1.0, 0.0]
    """

    name = "math_answer"

    def __init__(
        self,
        extract: ExtractMode = "auto",
        timeout_s: int | None = 5,
        float_rounding: int = 6,
        name: str = "math_answer",
    ) -> None:
        self.extract = check_extract_mode(extract)
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1
        ):
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s}")
        self.timeout_s = timeout_s
        self.float_rounding = float_rounding
        self.name = name
        import math_verify  # noqa: F401  (fail at build time when the rl extra is missing)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def _timeout(self) -> int | None:
        global _THREAD_WARNED
        if self.timeout_s is None or threading.current_thread() is threading.main_thread():
            return self.timeout_s
        if not _THREAD_WARNED:
            _THREAD_WARNED = True
            logger.warning(
                "MathAnswer runs outside the main thread: math-verify's timeout (signal.alarm) "
                "is off there, so a pathological answer can take long to check"
            )
        return None

    def _parse(self, text: str, timeout: int | None) -> list:
        from math_verify import parse

        if any(mark in text for mark in ("$", "\\(", "\\[", "\\boxed")):
            return parse(text, parsing_timeout=timeout)
        return parse(f"${text}$", parsing_timeout=timeout) or parse(text, parsing_timeout=timeout)

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        from math_verify import parse, verify

        timeout = self._timeout()
        references = _references(sample.answer)
        if self.extract == "auto":
            found = _last_answer_tag(sample.completion)
            found = _last_boxed(sample.completion) if found is None else found
            if found is None:
                predicted = parse(sample.completion, parsing_timeout=timeout)
            else:
                predicted = self._parse(found, timeout)
        else:
            found = extract_answer(sample.completion, self.extract)
            predicted = [] if found is None else self._parse(found, timeout)
        if not predicted:
            return 0.0
        for reference in references:
            gold = self._parse(str(reference), timeout)
            if gold and verify(
                gold, predicted, float_rounding=self.float_rounding, timeout_seconds=timeout
            ):
                return 1.0
        return 0.0
