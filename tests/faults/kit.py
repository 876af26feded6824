"""What the fault/bad-input catalogue is made of, shared by every module that adds cases.

:class:`Case` is one row of the reliability suite (``tests/faults/catalogue.py`` lists them all);
:class:`BadInput` is a broken config, dataset, checkpoint or tokenizer with a builder that makes it
inside the case's own folder (:class:`World`) and returns a :class:`Setup`: the CLI overrides and
the words the one-line error must hold. The helpers build the usual broken things.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BAD_LINE",
    "BAD_ROW",
    "GOOD_ROW",
    "REFUSED",
    "BadInput",
    "Case",
    "Setup",
    "World",
    "edit_json",
    "json_bytes",
    "model_copy",
    "reseal",
    "resume_copy",
    "rows_with",
]

REFUSED = "exit 1, one line 'tunesmith: error: ...' naming {}; nothing written"


@dataclass(frozen=True)
class Case:
    """One case: ``id`` (the test id), its ``group`` and ``kind``, the fault or input
    (``what``), the outcome the suite checks (``expect``), and whether CI runs it."""

    id: str
    group: str
    kind: str
    what: str
    expect: str
    ci: bool = True


@dataclass(frozen=True)
class World:
    """What builders start from: a good model folder, good chat data (16 rows), a finished run
    (checkpoints ``step_000001`` and ``step_000002``), and the case's own empty folder."""

    model_dir: Path
    data: Path
    finished: Path
    tmp: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out"


@dataclass
class Setup:
    """How to run a case and what its error (or skip report) must say."""

    overrides: list[str]
    words: list[str]
    config: str = "tiny"
    skipped: str | None = None  # a bad-row reason: the run succeeds, counting one skip
    flags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BadInput:
    id: str
    kind: str
    what: str
    expect: str
    build: Callable[[World], Setup]


# ----------------------------------------------------------------------------- helpers

GOOD_ROW = {
    "messages": [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "3"}]
}
BAD_ROW, BAD_LINE = 8, 9  # the bad row sits after 8 good ones


def rows_with(world: World, bad: bytes) -> Path:
    """JSONL: 8 good rows, the ``bad`` line, 8 good rows."""
    good = (json.dumps(GOOD_ROW) + "\n").encode() * 8
    path = world.tmp / "data.jsonl"
    path.write_bytes(good + bad + b"\n" + good)
    return path


def json_bytes(obj: object) -> bytes:
    return json.dumps(obj).encode()


def model_copy(world: World) -> Path:
    return Path(shutil.copytree(world.model_dir, world.tmp / "model"))


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def reseal(checkpoint: Path) -> None:
    """Rewrite ``checkpoint``'s COMPLETE manifest to match its files as they are now, so a
    case damaged on purpose reaches the loader's own checks (as a checkpoint edited by a tool
    that rewrote the manifest, or crafted by someone who did, would) instead of stopping at
    the manifest check."""
    from tunesmith.models.manifest import MARKER, file_entries, read_manifest

    manifest = read_manifest(checkpoint) or {}
    names = [
        p.relative_to(checkpoint).as_posix()
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != MARKER
    ]
    manifest["files"] = file_entries(checkpoint, names)
    (checkpoint / MARKER).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def resume_copy(world: World) -> Path:
    """A copy of the finished run holding only ``step_000001``; returns that checkpoint."""
    shutil.copytree(world.finished, world.out)
    shutil.rmtree(world.out / "checkpoints" / "step_000002")
    return world.out / "checkpoints" / "step_000001"
