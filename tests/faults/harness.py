"""Parent side of the fault suite: start real training processes, read what they left behind.

Children are forked by the suite's fork server (:mod:`tests.forked`), which imported torch,
tunesmith and :mod:`tests.faults.child` once, so a child costs well under a second instead of
~10 s of imports, and the parent (pytest) itself never forks after running torch code. Each child runs the
``tunesmith`` CLI with its output in a log file.

Example::

    done = run_child(["run", "sft", "--config", "tiny", *overrides], tmp_path / "log")
    done.exitcode, done.output
    # -> (0, 'dataset: ...')
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.faults.catalogue import PHASES
from tests.forked import CONTEXT as _CONTEXT  # its server preloads tests.faults.child
from tests.recipes.sft_world import final_weights, read_metrics, sft_overrides


@dataclass
class Finished:
    """A child that ended: its exit code (``-N``: killed by signal N), output and run time."""

    exitcode: int
    output: str
    seconds: float


def start_child(
    argv: list[str],
    log: Path,
    *,
    env: dict[str, str | None] | None = None,
    probes: dict[str, Any] | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start ``tunesmith ARGV`` in a new process (output appended to ``log``) and return it."""
    from tests.faults.child import run_cli

    log.touch()
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in (probes or {}).items()}
    process = _CONTEXT.Process(
        target=run_cli, args=(argv, str(log), env or {}, kwargs if probes else None)
    )
    process.start()
    return process


def with_a_bad_row(source: Path, dest: Path | str) -> tuple[Path, int]:
    """``source`` (JSONL) copied to ``dest`` with a line that is not JSON appended: a file the
    CLI's checks pass (it is there) that a rank fails to read (``on_bad_row=error``). Returns
    the copy and the 1-based line of the bad row.

    Example::

        data, line = with_a_bad_row(fault_world.chat, tmp_path / "broken.jsonl")
    """
    rows = source.read_text().splitlines()
    dest = Path(dest)
    dest.write_text("\n".join([*rows, '{"messages": [}']) + "\n")
    return dest, len(rows) + 1


def finish(process, log: Path, *, timeout: float, started: float) -> Finished:
    """Wait for ``process`` (killing it after ``timeout`` s, which fails the caller's check)."""
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise AssertionError(f"the child ran past {timeout} s:\n{log.read_text()[-3000:]}")
    return Finished(process.exitcode, log.read_text(), time.monotonic() - started)


def run_child(argv: list[str], log: Path, *, timeout: float = 120, **kwargs: Any) -> Finished:
    """:func:`start_child` and wait for it."""
    started = time.monotonic()
    return finish(start_child(argv, log, **kwargs), log, timeout=timeout, started=started)


def sft_argv(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> list[str]:
    """``run sft --config tiny`` on the local world, with ``overrides``."""
    return [
        "run",
        "sft",
        "--config",
        "tiny",
        *sft_overrides(model_dir, data, output_dir, *overrides),
    ]


# ----------------------------------------------------------------------------- event maps


def phases(events: list[str]) -> list[str]:
    """The phase of each event: ``training``, ``checkpoint`` (a periodic save) or ``export``
    (the final save, which writes the model the run delivers, and anything after it)."""
    steps = [int(e.split()[1]) for e in events if e.startswith("save_begin ")]
    final = max(steps)
    labels, label = [], "training"
    for event in events:
        if event.startswith("save_begin "):
            label = "export" if int(event.split()[1]) == final else "checkpoint"
        labels.append(label)
        if event.startswith("save_end ") and label == "checkpoint":
            label = "training"
    return labels


def kill_point(seed: int, events: list[str]) -> tuple[int, str]:
    """The event a seed kills at, and its phase: seeds cycle through :data:`PHASES`; within a
    phase, ``random.Random(seed)`` picks any of its events."""
    phase = PHASES[seed % len(PHASES)]
    candidates = [i for i, label in enumerate(phases(events)) if label == phase]
    return random.Random(seed).choice(candidates), phase


def expected_checkpoints(events: list[str], killed_at: int) -> list[str]:
    """The ``step_*`` folders that must exist after a kill at event ``killed_at``: every one
    renamed into place (committed) at or before it, less those pruned at or before it."""
    present: list[str] = []
    for event in events[: killed_at + 1]:
        if not (event.startswith("rename ") and event.endswith(" end")):
            continue
        source, target = event.removeprefix("rename ").removesuffix(" end").split(" -> ")
        if source.startswith(".tmp-step_") and target.startswith("step_"):
            present.append(target)
        elif source.startswith("step_") and target.startswith(".del-step_"):
            present.remove(source)
    return sorted(present)


def read_mark(mark: Path) -> dict[str, Any]:
    """What the child wrote just before it signalled itself (event name, monotonic time)."""
    return json.loads(mark.read_text())


# ----------------------------------------------------------------------------- comparisons

COMPARED = ("loss", "lr", "grad_norm", "tokens_seen", "trained_tokens_in_window")


def assert_same_weights(got: dict, expected: dict, what: str) -> None:
    """Same tensor names, each bitwise equal."""
    assert got.keys() == expected.keys(), what
    for name in got:
        assert torch.equal(got[name], expected[name]), f"{what}: {name} differs"


def assert_same_run(run: Path, reference: Path) -> None:
    """Final weights bitwise equal; every step's logged metrics (the last record of a step
    wins, so a resumed run's repeat of a step counts) equal."""
    assert_same_weights(final_weights(run), final_weights(reference), "final weights")
    logged, expected = read_metrics(run), read_metrics(reference)
    assert sorted(logged) == sorted(expected)
    for step in expected:
        for key in COMPARED:
            assert logged[step][key] == expected[step][key], f"{key} at step {step}"


def stop(process) -> None:
    """SIGKILL ``process`` if it still runs (also a stopped one) and reap it."""
    if process.exitcode is None:
        process.kill()
        process.join(30)


__all__ = [
    "COMPARED",
    "PHASES",
    "assert_same_run",
    "assert_same_weights",
    "Finished",
    "expected_checkpoints",
    "finish",
    "kill_point",
    "phases",
    "read_mark",
    "run_child",
    "sft_argv",
    "start_child",
    "stop",
]
