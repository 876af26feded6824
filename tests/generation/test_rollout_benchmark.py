"""``benchmarks/rollout.py`` still runs end to end on the current code: its dry run (tiny
workload, every section, the Qwen3-shaped one included through its small stand-in) writes a
report with every table, the targets computed (each missed one with its measured bound; the
colocation one met: a step after a rollout peaks as one without), and no section left
unmeasured or failed. A
change to an engine's ``stats``, to ``rl_step.py``'s helpers or to the recipe's
``metrics.jsonl`` breaks it here, not in the next benchmark run."""

from __future__ import annotations

import subprocess
import sys

from tests.recipes.sft_world import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "rollout.py"
SECTIONS = ["## Targets", "## A. RL rollout: plain vs paged engine",
            "## B. Long tail: continuous batching", "## C. Against transformers' generate (greedy)",
            "## D. Measured bound: one paged decode step", "## E. GRPO end to end",
            "## F. Qwen3-0.6B-shaped model",
            "## G. Colocation: a training step's peak memory after a rollout", "## GPU run"]  # fmt: skip
TABLES = ["| target (the issue's) | measured | verdict |",
          "| engine | wall s | CPU s | generated tokens/s | / forward-only |",
          "| engine | wall s | CPU s | generated tokens | tokens/s | plain / this (wall) |",
          "| engine | wall s | CPU s | generated tokens/s | this / transformers (wall) |",
          "| group | ms per step | share |", "| op | group | ms per step | share |",
          "| rows (M) | ms per call | µs per row | GFLOP/s |",
          "| engine | step s | generate s | samples/s |",
          "| batch | engine | wall s | generated tokens/s | plain / this |",
          "| group | transformers ms | share | paged ms | share |",
          "| rollout before the step | step peak MiB | after a rollout - without, bytes |"]  # fmt: skip
ROWS = ["| plain |", "| paged |", "| paged, share_prefixes=False |", "| paged + compiled step |",
        "| paged, max_slots=2 |", "| transformers ", "| plain (paged=false) |",
        "| paged (default) |", "| none |", "| paged, pool kept alive (counter-example) |"]  # fmt: skip


def test_the_rollout_benchmark_dry_run_writes_every_table(tmp_path):
    command = [sys.executable, str(SCRIPT), "--dry-run", "--qwen-batches", "4",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = (tmp_path / "rollout.md").read_text()
    missing = [s for s in SECTIONS + TABLES + ROWS if s not in report]
    assert not missing, (missing, report[:3000])
    assert "Not measured" not in report and "Not run" not in report, report
    targets = report.split("## Targets", 1)[1].split("## A.", 1)[0]
    assert targets.count("| meets") + targets.count("| misses") == 4, targets
    rows = [line for line in targets.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4 and "colocation" in rows[3], targets
    for row in rows[:3]:  # every missed ratio target names the bound measured in the same run
        assert "| meets |" in row or "misses; bound " in row, row
    assert rows[3].endswith("| meets |"), rows[3]  # a step after a rollout peaks as without
    assert report.count("**Measured bound.**") == 2, report  # B's and C's, beside D
    assert "The GPU run has not happened" in report  # no rollout_cuda.md beside it
