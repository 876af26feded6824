"""``benchmarks/multiturn_rollout.py`` runs on the current code: its dry run writes the table,
both runs sampled the same trajectories, and the kept prefixes prefilled fewer tokens."""

from __future__ import annotations

import re
import sys

from tests.recipes.sft_world import REPO_ROOT


def test_the_multiturn_rollout_benchmark_dry_run(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import multiturn_rollout
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    text = multiturn_rollout.main(["--dry-run", "--out", str(tmp_path)])
    assert (tmp_path / "multiturn_rollout.md").read_text() == text
    assert "every token of every row, in each of 1 pairs): yes" in text, text
    plain = re.search(r"\| every turn prefilled whole \| [\d.]+ \| [\d.]+ \| (\d+) \| 0 \|", text)
    kept = re.search(
        r"\| `keep_prefixes\(\)` \(the recipes\) \| [\d.]+ \| [\d.]+ \| (\d+) \| (\d+) \|", text
    )
    assert plain and kept, text
    assert int(kept[1]) + int(kept[2]) == int(plain[1])  # kept + prefilled = all, per call
    assert int(kept[1]) < int(plain[1]) / 2
