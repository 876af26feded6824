"""``benchmarks/test_durations.py`` reads pytest's JUnit report and keeps labelled runs side by
side: a real report of a small pytest run (one pass, one failure, one skip) gives those
outcomes and the slowest test first, and a second label adds the before/after ratio."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.recipes.sft_world import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "test_durations.py"

TESTS = """
import time, pytest
def test_slow(): time.sleep(0.3)
def test_fails(): assert 1 == 2
@pytest.mark.skip(reason="shown as skipped")
def test_skipped(): pass
"""


def _script():
    spec = importlib.util.spec_from_file_location("test_durations_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_real_report_and_two_labels(tmp_path):
    (tmp_path / "test_small.py").write_text(TESTS)
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={junit}",
            str(tmp_path / "test_small.py"),
        ],
        capture_output=True,
        cwd=tmp_path,
        check=False,
    )
    script = _script()
    cases = script.read_cases(junit)
    assert sorted(c.outcome for c in cases) == ["failed", "passed", "skipped"]
    for label, wall in (("before", 100.0), ("after", 40.0)):
        script.main(
            [
                "--junit",
                str(junit),
                "--wall",
                str(wall),
                "--load-start",
                "1.0 1.0 1.0",
                "--label",
                label,
                "--results",
                str(tmp_path),
            ]
        )
    runs = json.loads((tmp_path / "test_durations.json").read_text())
    assert set(runs) == {"before", "after"}
    assert runs["after"]["outcomes"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert runs["after"]["slowest"][0]["name"].endswith("test_slow")
    assert runs["after"]["slowest"][0]["seconds"] >= 0.3
    page = (tmp_path / "test_durations.md").read_text()
    assert "| after | 0m40s | 0.40 |" in page
    assert page.index("## before") < page.index("## after")
