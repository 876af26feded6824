"""Fixtures of the fault suite, and the recorder of its outcomes.

With ``TUNESMITH_FAULTS_RESULTS=path.json`` set (``make test-faults`` sets it), every catalogue
case that ran is written to that JSON file (merged into what is there): passed or not, its
run time, and the details the test put into its ``outcome`` fixture (where a process was
killed, which checkpoints survived, which mechanism filled the disk...).
``python -m tests.faults.report`` renders RELIABILITY.md from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.harness import run_child, sft_argv
from tests.recipes.sft_world import make_chat_data, make_counting_data, make_model_dir, run_sft

RESULTS_ENV = "TUNESMITH_FAULTS_RESULTS"
_DETAILS = pytest.StashKey[dict]()
_OUTCOMES: dict[str, dict] = {}


@dataclass(frozen=True)
class FaultWorld:
    """A tiny model folder, data, and a finished run, shared by the whole suite."""

    root: Path
    model_dir: Path
    chat: Path  # 16 one-turn conversations
    count: Path  # 24 conversations whose answers differ in length
    finished: Path  # output_dir of a 2-step run with checkpoints step_000001 and step_000002


@pytest.fixture(scope="session")
def fault_world(tmp_path_factory) -> FaultWorld:
    root = tmp_path_factory.mktemp("faults")
    model_dir = make_model_dir(root)
    chat = make_chat_data(root / "chat.jsonl", rows=16)
    finished = run_sft(
        model_dir, chat, root / "finished", "max_steps=2", "save_every_n_steps=1", "keep_last=null"
    )
    count = make_counting_data(root / "count.jsonl", rows=24)
    return FaultWorld(root, model_dir, chat, count, finished)


# The run every fault case injects into: two epochs of 6 steps cut at 7, a checkpoint every 2
# steps, the last 2 kept (so saves also prune), and the final save at step 7 (the export).
SWEEP = ("batch_size=4", "max_steps=7", "save_every_n_steps=2", "keep_last=2")


@dataclass(frozen=True)
class Sweep:
    """The uninterrupted run: its numbered events, its output folder, and a twin run that keeps
    every checkpoint (the reference for whatever checkpoint a killed run has left)."""

    world: FaultWorld
    events: list[str]
    reference: Path
    every_checkpoint: Path

    def argv(self, output_dir: Path, *extra: str) -> list[str]:
        return sft_argv(self.world.model_dir, self.world.count, output_dir, *SWEEP, *extra)


@pytest.fixture(scope="session")
def sweep(fault_world, tmp_path_factory) -> Sweep:
    root = tmp_path_factory.mktemp("sweep")
    trace = root / "trace.json"
    runs = {"reference": {"trace": trace}, "every_checkpoint": None}
    for name, probes in runs.items():
        extra = ("keep_last=null",) if name == "every_checkpoint" else ()
        argv = sft_argv(fault_world.model_dir, fault_world.count, root / name, *SWEEP, *extra)
        done = run_child(argv, root / f"{name}.log", probes=probes)
        assert done.exitcode == 0, done.output[-3000:]
    events = json.loads(trace.read_text())
    return Sweep(fault_world, events, root / "reference", root / "every_checkpoint")


@pytest.fixture
def outcome(request) -> dict:
    """Details of this case's outcome for the results file (fill it in the test)."""
    details: dict = {}
    request.node.stash[_DETAILS] = details
    return details


def _case_id(item: pytest.Item) -> str | None:
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    return getattr(case, "id", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = (yield).get_result()
    case_id = _case_id(item)
    if case_id is None or not (report.when == "call" or report.failed):
        return
    _OUTCOMES[case_id] = {
        "passed": report.passed,
        "seconds": round(report.duration, 2),
        **item.stash.get(_DETAILS, {}),
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path or not _OUTCOMES:
        return
    results_file = Path(path)
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results.update(_OUTCOMES)
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
