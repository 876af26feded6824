"""What each registered model family is and what it works with, derived from the family table.

One row per :func:`~tunesmith.models.family.families` entry: its HF ``model_type``,
architecture and built-in chat template (from the :class:`~tunesmith.models.family.Family`),
the sizes its family file ships (the zoo module's ``SIZES``, the ``*_tiny`` test models left
out), and which parallel layouts its architecture allows, read from its largest shipped
:class:`~tunesmith.models.spec.ModelSpec` (nothing here names a family):

- every recipe (sft, dpo, kto, kd, gkd, reward_model, grpo, grpo_async, online_dpo, ppo):
  recipes build models from a config.json through the family table and never name a family;
- tensor parallel: every layout the builder makes (heads split; a qk-norm over the whole
  projection sharded with its columns, ``training/parallel/tp_styles.py::ProjectionNorm``);
- context parallel: every attention kind (ring attention caps soft-capped scores in each
  block; windows, document masks and RoPE variants happen before or inside it);
- expert parallel for mixture-of-experts models (``num_experts > 0``) only.

``tunesmith ls --models`` prints :func:`text_table`; the table of ``docs/architecture.md`` is
:func:`markdown_table` (``python -m tests.docs.test_models_table`` rewrites it).

Example::

    >>> from tunesmith.models.catalog import family_rows
    >>> row = next(r for r in family_rows() if r.name == "qwen3_moe")
    >>> row.model_type, row.sizes, row.expert_parallel
    ('qwen3_moe', ('qwen3_30b_a3b', 'qwen3_235b_a22b'), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tunesmith.models import zoo
from tunesmith.models.family import Family, families

if TYPE_CHECKING:
    from tunesmith.models.spec import ModelSpec

__all__ = ["HEADERS", "FamilyRow", "family_row", "family_rows", "markdown_table", "text_table"]

ALL_RECIPES = "all"
"""The recipes column: every recipe takes every family (none names one)."""

TINY_SUFFIX = "_tiny"
"""Sizes named ``<family>_tiny`` are the random test models, not shipped sizes."""

HEADERS: tuple[str, ...] = (
    "family",
    "model_type",
    "architecture",
    "template",
    "recipes",
    "TP",
    "CP",
    "EP",
    "sizes",
)
"""The columns of both tables (TP / CP / EP: tensor, context, expert parallel)."""


@dataclass(frozen=True)
class FamilyRow:
    """One family's row: what it is and what works with it.

    ``tensor_parallel`` / ``context_parallel`` / ``expert_parallel`` are None when the family
    has no size to read them from (a family registered outside the zoo).
    """

    name: str
    model_type: str
    architecture: str
    template: str | None
    sizes: tuple[str, ...]
    recipes: str
    tensor_parallel: bool | None
    context_parallel: bool | None
    expert_parallel: bool | None

    def cells(self) -> tuple[str, ...]:
        """The row as text, in :data:`HEADERS` order ('-': none, '?': unknown)."""

        def word(value: bool | None) -> str:
            return "?" if value is None else "yes" if value else "no"

        return (
            self.name,
            self.model_type,
            self.architecture,
            self.template or "-",
            self.recipes,
            word(self.tensor_parallel),
            word(self.context_parallel),
            word(self.expert_parallel),
            ", ".join(self.sizes) or "-",
        )


def _largest_spec(family: Family) -> tuple[tuple[str, ...], ModelSpec | None]:
    """The sizes the family file ships (``*_tiny`` left out) and the spec of its largest size
    (of its tiny ones when it ships no other; None for a family outside the zoo)."""
    module = zoo.FAMILY_FILES.get(family.name)
    if module is None or getattr(module, "FAMILY", None) is not family:
        return (), None
    names = tuple(module.SIZES)
    shipped = tuple(n for n in names if not n.endswith(TINY_SUFFIX))
    specs = [module.spec(n) for n in shipped or names]
    return shipped, max(specs, key=lambda s: s.approx_parameters(), default=None)


def family_row(family: Family) -> FamilyRow:
    """The row of ``family``: its entry's fields, and the features of its largest spec."""
    sizes, spec = _largest_spec(family)
    tp = cp = ep = None
    if spec is not None:
        tp = True  # the plan covers every layout: per-head and whole-projection qk-norms alike
        cp = True  # ring attention: windows, soft-caps, partial/interleaved/no RoPE alike
        ep = spec.num_experts > 0
    return FamilyRow(
        name=family.name,
        model_type=family.model_type,
        architecture=family.architecture,
        template=family.template,
        sizes=sizes,
        recipes=ALL_RECIPES,
        tensor_parallel=tp,
        context_parallel=cp,
        expert_parallel=ep,
    )


def family_rows() -> tuple[FamilyRow, ...]:
    """A row for every registered family, in registration order."""
    return tuple(family_row(f) for f in families())


def markdown_table(rows: tuple[FamilyRow, ...] | None = None) -> str:
    """The families as a Markdown table (the one in ``docs/architecture.md``).

    Example::

        >>> print(markdown_table(family_rows()[:0]))
        | family | model_type | architecture | template | recipes | TP | CP | EP | sizes |
        |---|---|---|---|---|---|---|---|---|
    """
    rows = family_rows() if rows is None else rows
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows:  # names as code: the family, its type, class, template and sizes
        cells = [f"`{c}`" if c != "-" else c for c in row.cells()[:4]]
        cells += [*row.cells()[4:-1], ", ".join(f"`{s}`" for s in row.sizes) or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_table(rows: tuple[FamilyRow, ...] | None = None) -> str:
    """The families as aligned columns (``tunesmith ls --models``), the sizes last."""
    rows = family_rows() if rows is None else rows
    table = [tuple(h.upper() for h in HEADERS), *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1]
        for line in table
    )
