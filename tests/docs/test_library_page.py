"""docs/library.md's script, run as the page shows it: in one process (stopping at step 4),
resumed to step 8, and under ``torchrun --standalone --nproc-per-node 2``, in a workspace
that holds what the page assumes (``models/Qwen3-0.6B``: a tiny model and tokenizer;
``data.jsonl``). The resumed run's steps equal an uninterrupted run's.

``python train.py`` and ``torchrun ... train.py`` start real interpreters with a bare
environment; the resumed and the uninterrupted runs are the same script in children of the
suite's fork server (:func:`tests.forked.run_script`: the same environment, arguments and
working folder, without the interpreter's start-up).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tests.docs.doc_commands import fenced_blocks
from tests.recipes.sft_world import make_chat_data, make_model_dir

PAGE = Path(__file__).resolve().parents[2] / "docs" / "library.md"
VENV_BIN = Path(sys.executable).parent
STOP_LINE = "stop_after_steps=None if RESUME else 4,"
ENV = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # the scripts' whole env


def page_script() -> str:
    """The page's one Python block (the script it calls train.py)."""
    (script,) = [
        "\n".join(b.lines) + "\n" for b in fenced_blocks(PAGE.read_text()) if b.tag == "python"
    ]
    assert script.startswith("# train.py") and STOP_LINE in script
    return script


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("library")
    build = tmp_path_factory.mktemp("library-build")
    shutil.copytree(make_model_dir(build), root / "models" / "Qwen3-0.6B")
    make_chat_data(root / "data.jsonl", rows=16)
    return root


def _workspace(workspace: Path, name: str, script: str) -> Path:
    """A copy of the workspace with ``script`` as train.py."""
    folder = workspace.parent / f"{workspace.name}-{name}"
    shutil.copytree(workspace, folder)
    (folder / "train.py").write_text(script)
    return folder


def _run(workspace: Path, name: str, command: list[str], script: str) -> Path:
    """``command`` in a copy of the workspace with ``script`` as train.py; its folder."""
    folder = _workspace(workspace, name, script)
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (folder / "output.txt").write_text(done.stdout + done.stderr)
    return folder


def _forked(folder: Path, *argv: str) -> None:
    """``python train.py ARGV`` in ``folder``, in a fork-server child; its output appended to
    ``output.txt``."""
    log = folder / "output.txt"
    child = forked.start(forked.run_script, "train.py", list(argv), str(folder), log=log, env=ENV)
    assert forked.wait_all([child], timeout=600) == [0], log.read_text()[-3000:]


def _losses(folder: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (folder / "runs/lora/metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "runs/lora/checkpoints").glob("step_*"))


def test_the_script_stops_resumes_and_equals_an_uninterrupted_run(workspace):
    python = [str(VENV_BIN / "python"), "train.py"]
    script = page_script()
    stopped = _run(workspace, "stopped", python, script)
    assert _steps(stopped) == ["step_000004"] and sorted(_losses(stopped)) == [1, 2, 3, 4]
    assert (stopped / "runs/lora/checkpoints/step_000004/adapter_model.safetensors").is_file()

    _forked(stopped, "--resume")
    assert _steps(stopped) == ["step_000004", "step_000008"]

    whole = _workspace(workspace, "whole", script.replace(STOP_LINE, "stop_after_steps=None,"))
    _forked(whole)
    assert _steps(whole) == ["step_000004", "step_000008"]
    resumed, uninterrupted = _losses(stopped), _losses(whole)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 9))
    assert resumed == uninterrupted  # the same data order and updates, to the bit
    assert uninterrupted[8] < uninterrupted[1]  # and it learns


def test_the_script_runs_on_two_ranks_under_torchrun(workspace):
    command = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py"]
    folder = _run(workspace, "two-ranks", command, page_script())
    assert _steps(folder) == ["step_000004"] and sorted(_losses(folder)) == [1, 2, 3, 4]
    adapter = folder / "runs/lora/checkpoints/step_000004/adapter_model.safetensors"
    assert adapter.is_file()  # gathered from the 2 shards into one PEFT folder
