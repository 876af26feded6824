"""The bad-input catalogue, end to end through the CLI (in process): each broken config,
dataset, checkpoint or tokenizer makes ``tunesmith run sft`` exit 1 with one line
``tunesmith: error: ...`` naming the file and the row, key or tensor, no traceback, and nothing
written anywhere in the case's folder; where the user asked for skipping, the bad row is a
counted skip and training uses only the good rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.faults.bad_inputs import BAD_INPUTS, World
from tests.faults.catalogue import cases, params
from tests.recipes.sft_world import checkpoints
from tunesmith.cli.main import main

BUILDERS = {b.id: b.build for b in BAD_INPUTS}
# Further lines of a config error list more problems, each as "dotted.key: problem".
_ISSUE_LINE = re.compile(r"^[\w.\[\]<>-]+: \S")


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (an empty folder made
    on the way, e.g. the checkpoint root before a failed resume, holds nothing and is not
    counted; nor is the tokenised-rows cache, whose entries are keyed by their content: it
    changes no run)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if not p.is_dir() and ".tunesmith_cache" not in p.parts
    }


def shown(text: str, world: World, shared: Path) -> str:
    """``text`` with this machine's temporary paths replaced by stable names (for the report)."""
    return text.replace(str(world.tmp), "<case>").replace(str(shared), "<world>")


# Kinds with tests of their own (other commands than `run sft`, a bound in seconds, a memory
# limit, `validate` beside `run`): test_hostile_inputs.py, test_ray_safety.py, test_safety.py.
RUN_ELSEWHERE = ("hang", "size", "cli-input", "ray-config", "config-route")


def test_every_catalogue_case_has_a_builder():
    assert {c.id for c in cases("bad_input") if c.kind not in RUN_ELSEWHERE} == set(BUILDERS)
    assert len(BUILDERS) >= 30


@pytest.mark.parametrize(
    "case", [p for p in params("bad_input") if p.values[0].kind not in RUN_ELSEWHERE]
)
def test_bad_input_is_refused_cleanly_or_counted(case, fault_world, tmp_path, capsys, outcome):
    world = World(fault_world.model_dir, fault_world.chat, fault_world.finished, tmp_path)
    setup = BUILDERS[case.id](world)
    base = [
        f"model_dir={world.model_dir}", f"dataset.source={world.data}", f"output_dir={world.out}",
        "max_steps=2", "progress_bar=false",
    ]  # fmt: skip
    before = snapshot(tmp_path)
    code = main([*setup.flags, "run", "sft", "--config", setup.config, *base, *setup.overrides])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err

    if setup.skipped is not None:  # asked for skipping: trained on the good rows, counted the bad
        assert code == 0, err
        summary = [
            line for line in out.splitlines() if line.startswith("dataset:") or "skipped" in line
        ]
        for word in setup.words:
            assert word in out, f"{word!r} not in the dataset report {summary}"
        assert [p.name for p in checkpoints(world.out)] == ["step_000002"]
        outcome.update(
            outcome="counted skip", report=shown(" / ".join(summary), world, fault_world.root)
        )
        return

    assert code == 1, f"exit {code}; stderr: {err}"
    lines = err.splitlines()
    assert lines and lines[0].startswith("tunesmith: error: "), err
    for line in lines[1:]:
        assert _ISSUE_LINE.match(line), f"not one clear error: {err}"
    for word in setup.words:
        assert word in err, f"{word!r} not in: {err}"
    assert snapshot(tmp_path) == before, "the refused run wrote or changed files"
    outcome.update(outcome="refused", error=shown(lines[0], world, fault_world.root))
