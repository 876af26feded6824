"""Hostile sizes and hangs (``hostile_cases.py``), end to end through the CLI: each input ends
within its bound with one line ``tunesmith: error: ...`` naming the input (or, where the user
asked for skipping, a counted skip), no traceback.

The ``hang`` and ``size`` cases run in a child process (forked from the fault suite's fork
server) under a memory limit (RLIMIT_AS: what the child maps plus 2.5 GB) and a timeout, so a
regression fails the test instead of hanging the suite or taking the machine down; the
``cli-input`` ones run in process. Where it is cheap, the test first shows the input is
hostile (plain jinja2 still rendering after 2 s or failing under a memory limit; a prompt with
more tokens than the model has positions).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from tests.faults import harness  # noqa: F401  (sets the fork server's preload)
from tests.faults.catalogue import params
from tests.faults.hostile_cases import HOSTILE, Attempt, run_limited
from tests.faults.kit import World
from tests.faults.test_bad_inputs import snapshot
from tunesmith.cli.main import main

BUILDERS = {h.id: h.build for h in HOSTILE}
CASES = [p for p in params("bad_input") if p.id in BUILDERS]
EXTRA_GB = 2.5  # the memory a child may map beyond what it starts with


def test_every_hostile_case_is_in_the_catalogue():
    assert {p.id for p in CASES} == set(BUILDERS)
    assert len(BUILDERS) >= 30


def _in_child(attempt: Attempt, tmp: Path) -> tuple[int, str]:
    import multiprocessing

    log = tmp / "child.log"
    stdin = None
    if attempt.stdin is not None:
        stdin = tmp / "stdin.txt"
        stdin.write_bytes(attempt.stdin)
    process = multiprocessing.get_context("forkserver").Process(
        target=run_limited,
        args=(attempt.argv, str(log), EXTRA_GB, None if stdin is None else str(stdin)),
    )
    process.start()
    process.join(attempt.bound)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise AssertionError(f"ran past its bound of {attempt.bound} s: {_tail(log)}")
    return process.exitcode, log.read_text(errors="replace") if log.exists() else ""


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no output)"


def _in_process(attempt: Attempt, capsys, monkeypatch) -> tuple[int, str]:
    if attempt.stdin is not None:
        stream = io.TextIOWrapper(io.BytesIO(attempt.stdin), encoding="utf-8")
        monkeypatch.setattr(sys, "stdin", stream)
    code = main(attempt.argv)
    out, err = capsys.readouterr()
    return code, out + err


def _shown(text: str, world: World, root: Path) -> str:
    return text.replace(str(world.tmp), "<case>").replace(str(root), "<world>")[:300]


@pytest.mark.parametrize("case", CASES)
def test_hostile_input_ends_in_time_with_one_line(
    case, fault_world, tmp_path, capsys, monkeypatch, outcome
):
    world = World(fault_world.model_dir, fault_world.chat, fault_world.finished, tmp_path)
    attempt = BUILDERS[case.id](world)
    if attempt.live is not None:
        outcome["hostile"] = attempt.live()
    before = snapshot(tmp_path)
    started = time.monotonic()
    if case.kind in ("hang", "size"):
        code, output = _in_child(attempt, tmp_path)
    else:
        code, output = _in_process(attempt, capsys, monkeypatch)
    seconds = time.monotonic() - started
    assert seconds <= attempt.bound, f"took {seconds:.1f} s, bound {attempt.bound} s"
    assert "Traceback" not in output, output[-3000:]
    outcome["seconds"] = round(seconds, 2)

    if attempt.skipped is not None:
        assert code == 0, output[-3000:]
        report = [line for line in output.splitlines() if "skipped" in line]
        assert any(attempt.skipped in line for line in report), output[-3000:]
        outcome.update(
            outcome="counted skip", error=_shown(" / ".join(report), world, fault_world.root)
        )
        return
    errors = [line for line in output.splitlines() if line.startswith("tunesmith: error: ")]
    assert code == 1, f"exit {code}: {output[-3000:]}"
    assert len(errors) == 1, output[-3000:]
    for word in attempt.words:
        assert word in errors[0], f"{word!r} not in: {errors[0][:1000]}"
    after = {k: v for k, v in snapshot(tmp_path).items() if k not in ("child.log", "stdin.txt")}
    assert after == before, "the refused command wrote or changed files"
    outcome.update(outcome="refused", error=_shown(errors[0], world, fault_world.root))
