"""The families table (``tunesmith/models/catalog.py``, ``tunesmith ls --models``): one row per
registered family, read from its ``Family`` entry and its family file, and what it says about
parallel layouts agrees with what the parallel code refuses on the family's own model."""

from __future__ import annotations

import pytest

from tunesmith.cli.main import main
from tunesmith.models import Family, build_model, families, zoo
from tunesmith.models.catalog import HEADERS, family_row, family_rows, markdown_table, text_table
from tunesmith.models.family import register_family, unregister_family
from tunesmith.modules.attention import Attention
from tunesmith.modules.mla import MultiHeadLatentAttention
from tunesmith.training.parallel.tensor_parallel import check_tp_shardable

ROWS = {row.name: row for row in family_rows()}


def test_every_registered_family_has_one_row():
    rows = family_rows()
    assert [r.name for r in rows] == [f.name for f in families()]
    assert len({r.name for r in rows}) == len(rows) == len(families())
    assert {r.model_type for r in rows} == {f.model_type for f in families()}
    assert {"llama3", "qwen3", "qwen3_moe", "gemma2", "gemma3", "olmo2"} <= set(ROWS)


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_a_row_is_its_family_entry_and_family_file(family):
    row = ROWS[family.name]
    assert (row.model_type, row.architecture, row.template) == (
        family.model_type,
        family.architecture,
        family.template,
    )
    sizes = zoo.FAMILY_FILES[family.name].SIZES
    assert row.sizes == tuple(s for s in sizes if not s.endswith("_tiny"))
    assert row.sizes and all("tiny" not in s for s in row.sizes)
    assert row.recipes == "all"


def test_what_works_with_the_families_that_limit_it():
    assert ROWS["olmo2"].tensor_parallel is True  # its whole-projection qk-norm is sharded too
    assert ROWS["gemma2"].context_parallel is True  # the ring caps each block's scores
    assert ROWS["qwen3_moe"].expert_parallel is True
    assert ROWS["gemma3"].context_parallel is True  # the config carries a soft-cap it ignores
    assert ROWS["qwen3"].tensor_parallel is True  # a per-head qk-norm splits with the heads
    assert ROWS["deepseek_v3"].tensor_parallel is True  # MLA: heads split, latents replicated
    dense = [r for r in ROWS.values() if not r.expert_parallel]
    assert {"qwen3_moe", "deepseek_v3", "deepseek_v2"}.isdisjoint(r.name for r in dense)


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_the_parallel_columns_agree_with_the_refusals(family):
    """TP is 'yes' where check_tp_shardable takes the family's model, CP 'yes' for every
    attention kind (ring attention runs them all), EP 'yes' where layers hold experts (the tiny
    model: the same architecture as the sizes, built on the meta device)."""
    row = ROWS[family.name]
    module = zoo.FAMILY_FILES[family.name]
    tiny = [s for s in module.SIZES if s.endswith("_tiny")]
    model = build_model(module.spec(tiny[0]), device="meta")
    try:
        check_tp_shardable(model)
        shardable = True
    except ValueError:
        shardable = False
    assert row.tensor_parallel is shardable
    attention = [m for m in model.modules() if isinstance(m, (Attention, MultiHeadLatentAttention))]
    assert row.context_parallel is True  # ring attention serves every Attention
    assert attention
    assert row.expert_parallel is model.spec.is_moe


def test_a_family_outside_the_zoo_has_a_row_with_unknown_features():
    toy = register_family(Family("toy_table", "toy_table", "ToyForCausalLM"))
    try:
        row = family_row(toy)
        assert row in family_rows()
    finally:
        unregister_family("toy_table")
    assert row.sizes == () and row.template is None
    assert row.cells() == (
        "toy_table",
        "toy_table",
        "ToyForCausalLM",
        "-",
        "all",
        "?",
        "?",
        "?",
        "-",
    )


def test_the_markdown_table_has_a_line_per_family():
    lines = markdown_table().splitlines()
    assert lines[0] == "| " + " | ".join(HEADERS) + " |"
    assert len(lines) == 2 + len(families())
    olmo2 = next(line for line in lines if line.startswith("| `olmo2` |"))
    cells = [c.strip() for c in olmo2.strip("|").split("|")]
    assert cells[HEADERS.index("TP")] == "yes" and "`olmo2_1b`" in cells[-1]
    gemma2 = next(line for line in lines if line.startswith("| `gemma2` |"))
    assert [c.strip() for c in gemma2.strip("|").split("|")][HEADERS.index("CP")] == "yes"


def test_ls_models_prints_the_table(capsys):
    assert main(["ls", "--models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(text_table() + "\n")
    lines = out.splitlines()
    header = lines[0].split()
    assert header == [h.upper() for h in HEADERS]
    printed = {}
    for family in families():
        (line,) = [ln for ln in lines if ln.split()[0] == family.name]
        words = line.split()
        assert words[1] == family.model_type
        printed[family.name] = {h: words[header.index(h)] for h in ("TP", "CP", "EP")}
        assert ROWS[family.name].cells()[-1] in line  # the sizes, last
    assert printed["gemma2"]["CP"] == "yes" and printed["olmo2"]["TP"] == "yes"
    assert printed["qwen3_moe"]["EP"] == printed["llama3"]["TP"] == printed["llama3"]["CP"] == "yes"


def test_plain_ls_still_lists_recipes(capsys):
    assert main(["ls"]) == 0
    assert capsys.readouterr().out.startswith("RECIPE")
