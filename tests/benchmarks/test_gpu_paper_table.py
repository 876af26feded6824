"""``benchmarks/gpu/paper_table.py`` (issue #39) stays runnable between GPU windows: its CPU
dry run trains every rung of the ladder on the tiny stand-in of each model family and writes
the report; the plan keeps to its budget; a row out of memory retries at half the batch; the
renderer reads the targets off tunesmith and torchtune rows; the not-run file says so.

torchtune is not a project dependency: where the rows' processes cannot import it, every
torchtune row must say why; where they can (``PAPER_TABLE_TORCHTUNE_SITE``: a folder holding
torchtune 0.6.1 and torchao 0.10, see ``benchmarks/gpu/README.md``), its rows must run and
start from tunesmith's loss (the same weights)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.recipes.sft_world import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu" / "paper_table.py"


@pytest.fixture(scope="module")
def pt():
    """The script as a module (its ``sys.path`` additions undone after loading)."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("paper_table_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def _cells(report: str, shape: str, stack: str, rung: str) -> list[str]:
    prefix = f"| {shape} | {stack} | {rung} |"
    lines = [line for line in report.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, report[:2000])
    return [c.strip() for c in lines[0][len(prefix) :].split("|")[:-1]]


def test_the_dry_run_trains_every_rung_and_writes_the_table(pt, tmp_path):
    out = tmp_path / "table.md"
    command = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)]
    if os.environ.get("PAPER_TABLE_TORCHTUNE_SITE"):
        command += ["--torchtune-site", os.environ["PAPER_TABLE_TORCHTUNE_SITE"]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = out.read_text()
    assert report.startswith("# The paper's table on one GPU") and "**Dry run**" in report
    ran = {}
    for shape in pt.GPU_SHAPES:
        for stack in shape.stacks:
            for rung in pt.rungs_of(shape):
                cells = _cells(report, shape.name, stack, rung)
                if stack == "tunesmith" and pt.dry_run_row(shape, rung):
                    # tokens/s, MFU, step s, warm-up s, peaks, loss, batch: all numbers
                    assert re.fullmatch(r"[\d,]+", cells[0]) and cells[1].endswith("%"), cells
                    ran[(shape.name, rung)] = float(cells[6])
                elif stack == "tunesmith":
                    assert cells[0].startswith("not run: dry run"), cells
    assert len(ran) == 7 + 2 + 2  # the whole Qwen3-0.6B ladder, two rungs of each Llama
    # every row of a ladder saw the same batches: the first loss is ln(vocab) at random init
    assert ran[("Qwen3-0.6B", "baseline bf16")] == pytest.approx(ran[("Qwen3-0.6B", "+compile")])
    assert _cells(report, "Qwen3-0.6B", "tunesmith", "+packing")[-1] == "57k tokens/s"
    torchtune = re.search(r"^- torchtune: (.*)\.$", report, re.M).group(1)
    for rung in pt.rungs_of(pt.GPU_SHAPES[0]):
        cells = _cells(report, "Qwen3-0.6B", "torchtune", rung)
        if torchtune.startswith("not run"):
            assert cells[0].startswith("not run: torchtune does not import"), cells
        else:  # the same weights and batches: the same loss as tunesmith's row
            assert float(cells[6]) == pytest.approx(ran[("Qwen3-0.6B", rung)], abs=0.02), rung
            assert re.fullmatch(r"[\d.]+x / [\d.]+x", _cells(report, "Qwen3-0.6B",
                                "tunesmith", rung)[8])  # fmt: skip


def test_the_plan_keeps_to_its_budget_and_the_rest_waits_in_reserve(pt):
    import argparse

    args = pt.build_parser().parse_args(["--budget-s", "120"])
    settings = pt.settings_from(args)
    rows = pt.plan(settings)
    planned = [r for r in rows if r.status == "planned"]
    assert planned and planned[0].rung == "baseline bf16"
    assert pt.planned_s(settings, rows) <= 120
    assert {r.status for r in rows} == {"planned", "reserve"}
    assert all(
        r.why == "after the plan: runs if time is left" for r in rows if r.status == "reserve"
    )
    # the full budget plans the headline ladder of both stacks first
    full = pt.plan(pt.settings_from(argparse.Namespace(**{**vars(args), "budget_s": 450.0})))
    assert [r.stack for r in full if r.status == "planned"][:14] == ["tunesmith"] * 7 + [
        "torchtune"
    ] * 7


def test_a_row_out_of_memory_retries_at_half_the_batch(pt, monkeypatch):
    shape = pt.GPU_SHAPES[2]  # the full 8B, batch 2
    calls = []

    def run_row(settings, shape_, stack, rung, batch):
        calls.append(batch)
        if batch > fits:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return pt.Row(shape_.name, stack, rung, status="ran", batch=batch)

    monkeypatch.setattr(pt, "run_row", run_row)
    monkeypatch.setattr(pt, "release", lambda: None)
    fits = 1
    row = pt.run_row_fitting(None, shape, "tunesmith", "baseline bf16")
    assert (row.status, row.batch, row.why, calls) == ("ran", 1, "out of memory at batch 2", [2, 1])
    fits = 0
    row = pt.run_row_fitting(None, shape, "tunesmith", "baseline bf16")
    assert (row.status, row.why) == ("oom", "out of memory at batch 2, 1")
    assert pt.cell(row, None, 1.0)[0] == "did not fit: out of memory at batch 2, 1"


def test_the_targets_are_read_off_both_stacks(pt):
    def row(stack, rung, tokens_per_s, peak):
        return pt.Row("Qwen3-0.6B", stack, rung, status="ran", tokens_per_s=tokens_per_s,
                      peak_allocated=peak, loss=2.0)  # fmt: skip

    rows = [row("tunesmith", "+packing", 30000, 8), row("tunesmith", "+linear CE", 24000, 4),
            row("torchtune", "+packing", 20000, 8), row("torchtune", "+linear CE", 10000, 2)]  # fmt: skip
    speed, memory = pt.verdicts(rows)
    assert "**1.50x (+packing: 30,000 vs +packing: 20,000 tokens/s" in speed
    assert "0 of 1 pairs at or below torchtune (above: Qwen3-0.6B +linear CE)" in memory
    assert pt.ratio(rows, rows[0]) == "1.50x / 1.00x" and pt.ratio(rows, rows[2]) == ""


def test_the_not_run_file_says_it_has_not_run(pt, tmp_path, monkeypatch):
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", ["paper_table.py", "--not-run", "--out", str(out)])
    assert pt.main() == 0
    report = out.read_text()
    assert "**Not run yet on a GPU**" in report
    for text in pt.PAPER.values():
        assert text in report
    assert "planned, ~" in _cells(report, "Qwen3-0.6B", "tunesmith", "+compile")[0]
    assert report.count("| reserve: after the plan") > 0


def test_a_spent_budget_stops_the_rows_process_and_each_row_says_so(tmp_path):
    out = tmp_path / "table.md"
    command = [sys.executable, str(SCRIPT), "--dry-run", "--budget-s", "0", "--stacks",
               "tunesmith", "--shapes", "Qwen3-0.6B", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith("| Qwen3-0.6B | tunesmith |")]
    assert len(rows) == 7
    assert all("| not run: its process was stopped at the budget |" in row for row in rows), rows
    assert "planned total 0 s (budget 0 s)" in report
