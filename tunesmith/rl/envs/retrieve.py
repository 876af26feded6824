"""The ``retrieve`` tool: BM25 search over a local JSONL corpus (no download, no model).

:class:`BM25Index` ranks documents for a query by Okapi BM25 (the Lucene form)::

    score(D, Q) = sum over distinct terms q of Q present in D of
                  idf(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))
    idf(q)      = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5))

with ``f(q, D)`` the count of ``q`` in ``D``, ``|D|`` its length in terms, ``avgdl`` the mean
length, ``N`` the number of documents and ``n(q)`` how many contain ``q``. Terms are the
lower-cased ``\\w+`` runs. Ties keep the corpus order; documents scoring 0 are not returned.

:class:`Retrieve` loads the corpus once (one JSON object per line, its text under
``text_key`` and an optional id under ``id_key``; a bad line is a ValueError naming the file and
line) and returns the ``top_k`` documents as text.

Example::

    >>> index = BM25Index(["the cat sat", "the dog ran", "a cat and a cat"])
    >>> [i for i, _ in index.top("cat", 3)]
    [2, 0]
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from os import PathLike
from pathlib import Path

from tunesmith.config.registry import component
from tunesmith.rl.envs.tool import ToolError, function_schema

__all__ = ["BM25Index", "Retrieve", "load_corpus", "terms"]

_TERM = re.compile(r"\w+")


def terms(text: str) -> list[str]:
    """The terms of ``text``: lower-cased ``\\w+`` runs.

    >>> terms("BM25, by Robertson & Spärck Jones")
    ['bm25', 'by', 'robertson', 'spärck', 'jones']
    """
    return _TERM.findall(text.lower())


class BM25Index:
    """Okapi BM25 over a fixed list of documents (see the module docs).

    Args:
        documents: the texts, indexed by position.
        k1, b: the BM25 constants (term-frequency saturation, length normalisation).
    """

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("BM25Index: no documents")
        if not (k1 >= 0 and 0 <= b <= 1):
            raise ValueError(f"BM25Index: need k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = float(k1), float(b)
        self.counts = [Counter(terms(text)) for text in documents]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.average_length = sum(self.lengths) / len(self.lengths) or 1.0
        frequency: Counter[str] = Counter()
        for counts in self.counts:
            frequency.update(counts.keys())
        n = len(self.counts)
        self.idf = {t: math.log(1 + (n - df + 0.5) / (df + 0.5)) for t, df in frequency.items()}

    def score(self, query: str, index: int) -> float:
        """BM25 of document ``index`` for ``query``.

        >>> round(BM25Index(["a b", "b c"]).score("a", 0), 6)
        0.693147
        """
        counts = self.counts[index]
        norm = self.k1 * (1 - self.b + self.b * self.lengths[index] / self.average_length)
        total = 0.0
        for term in dict.fromkeys(terms(query)):
            f = counts.get(term, 0)
            if f:
                total += self.idf[term] * f * (self.k1 + 1) / (f + norm)
        return total

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (index, score) pairs with a score above 0, best first."""
        scored = [(i, self.score(query, i)) for i in range(len(self.counts))]
        ranked = sorted((pair for pair in scored if pair[1] > 0), key=lambda p: (-p[1], p[0]))
        return ranked[:k]


def load_corpus(
    path: str | PathLike[str], text_key: str = "text", id_key: str = "id"
) -> tuple[list[str], list[str]]:
    """``(ids, texts)`` of a JSONL corpus; a row's id defaults to its line number.

    Raises ValueError naming the file and line of a row that is not an object with a string
    under ``text_key``.
    """
    ids, texts = [], []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise ValueError(f"{path}:{number}: expected an object with a string {text_key!r}")
            ids.append(str(row.get(id_key, number)))
            texts.append(row[text_key])
    if not texts:
        raise ValueError(f"{path}: the corpus has no documents")
    return ids, texts


@component
class Retrieve:
    """The ``retrieve`` tool over a local JSONL corpus (see the module docs).

    Args:
        corpus: the JSONL file.
        text_key, id_key: the keys of a row's text and id.
        top_k: documents returned per query.
        k1, b: the BM25 constants.
        max_chars_per_document: each returned text is cut to this many characters.

    Example (YAML)::

        tools:
          - {_component_: tunesmith.rl.envs.Retrieve, corpus: data/wiki.jsonl, top_k: 3}
    """

    name = "retrieve"
    schema = function_schema(
        "retrieve",
        "Search the document collection; returns the best matching documents.",
        {"query": {"type": "string", "description": "Keywords to search for."}},
    )

    def __init__(
        self,
        corpus: str | PathLike[str],
        text_key: str = "text",
        id_key: str = "id",
        top_k: int = 3,
        k1: float = 1.5,
        b: float = 0.75,
        max_chars_per_document: int = 1000,
    ) -> None:
        for key, value in (("top_k", top_k), ("max_chars_per_document", max_chars_per_document)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Retrieve: {key} must be a positive int, got {value!r}")
        self.ids, self.texts = load_corpus(corpus, text_key, id_key)
        self.index = BM25Index(self.texts, k1=k1, b=b)
        self.top_k = top_k
        self.max_chars = max_chars_per_document

    def __call__(self, query: str) -> str:
        if not isinstance(query, str) or not terms(query):
            raise ToolError("retrieve: 'query' must be a string with at least one word")
        found = self.index.top(query, self.top_k)
        if not found:
            return "No document matches."
        return "\n\n".join(f"[{self.ids[i]}] {self.texts[i][: self.max_chars]}" for i, _ in found)
