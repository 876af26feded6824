"""``benchmarks/async_grpo.py`` still runs end to end on the current code (slow): a short run
of every mode and two seeds writes its report with each section and each mode's rows, read
from the runs' own ``metrics.jsonl`` and ``rollouts.jsonl`` (a change to either format breaks
it here, not in the next session's benchmark run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.recipes.sft_world import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "async_grpo.py"
SECTIONS = ["## Verdict", "## Throughput and where a step's time goes",
            "## Timing model: predicted vs measured step time",
            "## Reward per update and per wall-clock second"]  # fmt: skip
ROWS = ["| grpo (in-process, no Ray) |", "| grpo_async sync |", "| grpo_async overlap |",
        "| grpo_async off_policy (k=2) |"]  # fmt: skip


@pytest.mark.slow
def test_the_async_benchmark_writes_its_report(tmp_path):
    output = tmp_path / "async_grpo.md"
    command = [sys.executable, str(SCRIPT), "--steps", "8", "--seeds", "0", "1",
               "--prompts-per-step", "4", "--new-tokens", "16", "--output", str(output)]  # fmt: skip
    # the script starts its own Ray instance in a temp folder of its own (RAY_AUTH_MODE set)
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = output.read_text()
    assert all(section in report for section in SECTIONS), report[:2000]
    assert all(row in report for row in ROWS), report[:3000]
    assert "- Reward per policy version" in report  # two seeds: read from rollouts.jsonl
