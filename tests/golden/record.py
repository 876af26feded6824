"""Record the goldens: run every :data:`~tests.golden.runs.RUNS` entry and write
``tests/golden/<run>.json`` (its :func:`~tests.golden.runs.summarize` plus where it was
recorded: :func:`~tests.golden.runs.fingerprint` and the commit).

Record from a clean checkout of the commit the goldens stand for, so that no uncommitted edit
leaks into them; for example::

    git worktree add /tmp/golden-head HEAD
    cp tests/golden/*.py /tmp/golden-head/tests/golden/   # if they are not committed yet
    cd /tmp/golden-head && PYTHONPATH=$PWD python -m tests.golden.record --out <repo>/tests/golden
    git worktree remove --force /tmp/golden-head

``--only NAME`` records some runs; ``--out DIR`` writes elsewhere (default: next to this file).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from tests.golden.runs import GOLDEN_DIR, RUNS, build_world, execute, fingerprint, summarize


def _commit() -> str:
    """The commit of the tree the recipes were imported from (with ``+dirty`` if it has
    uncommitted changes under ``tunesmith/``), or ``unknown``."""
    import tunesmith

    root = Path(tunesmith.__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "tunesmith"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _dumps(golden: dict) -> str:
    """Indented JSON with every list of scalars on one line (shapes, first values)."""
    text = json.dumps(golden, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)


def record(names: list[str], out: Path) -> list[Path]:
    """Run ``names`` and write their goldens to ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        world = build_world(Path(tmp) / "world")
        for name in names:
            run = RUNS[name]
            output_dir = execute(run, world, Path(tmp) / name)
            golden = {
                "run": name,
                "recorded": {**fingerprint(), "commit": _commit(), "num_threads": 1},
                **summarize(run, world, output_dir),
            }
            path = out / f"{name}.json"
            path.write_text(_dumps(golden) + "\n")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR)
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for path in record(args.only, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
