"""docs/architecture.md's table of model families is the one the family table generates
(:func:`tunesmith.models.catalog.markdown_table`): a family added, or a spec that changes what
works with it, fails here until the page is rewritten.

``python -m tests.docs.test_models_table`` rewrites the table in the page.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tunesmith.models.catalog import markdown_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
BEGIN = "<!-- families table:"
END = "<!-- end of families table -->"


def _span(text: str) -> tuple[int, int]:
    """Where the table between the two marker lines of ``text`` starts and ends."""
    start = text.index("\n", text.index(BEGIN)) + 1
    return start, text.index(END)


def test_the_docs_families_table_is_the_generated_one():
    text = PAGE.read_text()
    start, stop = _span(text)
    assert text[start:stop].rstrip("\n") == markdown_table(), (
        "docs/architecture.md's families table is out of date: "
        "python -m tests.docs.test_models_table"
    )


def test_the_span_is_the_table_between_the_markers():
    text = f"intro\n{BEGIN} how -->\n| a |\n|---|\n{END}\nafter\n"
    start, stop = _span(text)
    assert text[start:stop] == "| a |\n|---|\n"


def _write_docs() -> None:
    text = PAGE.read_text()
    start, stop = _span(text)
    PAGE.write_text(text[:start] + markdown_table() + "\n" + text[stop:])
    print(f"wrote the families table of {PAGE}", file=sys.stderr)


if __name__ == "__main__":
    _write_docs()
