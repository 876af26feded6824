"""RELIABILITY.md cannot drift from the suite: the committed file is exactly what
``python -m tests.faults.report`` renders from the catalogue and the committed outcomes, and
every catalogue case has a recorded, passing outcome (a new case fails this test until
``make test-faults`` has run it)."""

from __future__ import annotations

from tests.faults.catalogue import CASES, GROUPS
from tests.faults.report import OUTPUT, RESULTS, load_results, render, summary


def test_reliability_md_is_generated_from_the_current_catalogue():
    results = load_results(RESULTS)
    assert OUTPUT.read_text() == render(CASES, results), (
        "RELIABILITY.md is out of date: run `make test-faults` (or `python -m tests.faults.report`)"
    )


def test_every_case_has_a_passing_recorded_outcome():
    results = load_results(RESULTS)
    missing = [c.id for c in CASES if c.id not in results]
    failed = [c.id for c in CASES if c.id in results and not results[c.id]["passed"]]
    assert missing == [] and failed == [], f"not run: {missing}; failed: {failed}"
    counts = summary(CASES, results)
    assert counts["checkpoints lost"] == 0
    assert counts["faults injected"] == counts["faults survived"] >= 40
    refused_or_counted = (
        counts["bad inputs refused cleanly"]
        + counts["bad rows skipped and counted (on_bad_row=skip)"]
    )
    assert counts["bad inputs tried"] == refused_or_counted >= 70
    assert counts["code-execution attempts and unsafe loads refused"] >= 15
    assert counts["cases failed"] == counts["cases not run"] == 0


def test_ci_runs_a_case_of_every_kind():
    """``make test`` (CI) exercises every class of fault, bad input and safety case."""
    kinds = {(c.group, c.kind) for c in CASES}
    in_ci = {(c.group, c.kind) for c in CASES if c.ci}
    assert kinds == in_ci, f"no CI case for {sorted(kinds - in_ci)}"


def test_report_lists_every_case_once_and_counts_failures():
    fake = {c.id: {"passed": True} for c in CASES}
    fake[CASES[0].id] = {"passed": False}
    text = render(CASES, fake)
    for case in CASES:
        assert text.count(f"| `{case.id}` |") == 1, case.id
    assert text.count("**FAILED**") == 1
    assert summary(CASES, fake)["cases failed"] == 1
    assert {c.group for c in CASES} == set(GROUPS)
