"""Issue #38: a run stopped before its first checkpoint leaves ``metrics.jsonl`` (and
``config.yaml``) in its output dir; the next fresh run moves them aside (not deleted) and
starts its own record, a resumed run keeps appending, and readers never join two runs."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from tests.recipes.sft_world import make_chat_data, make_model_dir, run_sft
from tunesmith.training import plot_run, read_metrics


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_runs")
    return make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=16)


def _steps(output_dir) -> list[int]:
    """The step of every record of ``output_dir/metrics.jsonl``, in file order."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_fresh_run_moves_an_earlier_runs_metrics_aside(world, tmp_path, capsys):
    model_dir, data = world
    out = run_sft(model_dir, data, tmp_path / "out", "max_steps=2")
    shutil.rmtree(out / "checkpoints")  # as if killed before its first checkpoint
    old = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    capsys.readouterr()

    run_sft(model_dir, data, out, "max_steps=3")
    assert _steps(out) == [1, 2, 3]  # its own records only, each step once
    (aside,) = out.glob("earlier-run-*")
    assert {name: (aside / name).read_bytes() for name in old} == old  # intact
    assert _steps(aside) == [1, 2]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "earlier run" in ln]
    assert lines == [
        "starting a fresh run (no checkpoint to resume): moved the earlier run's "
        f"metrics.jsonl, config.yaml to {aside} (not deleted)"
    ]


def test_resumed_run_keeps_appending(world, tmp_path, capsys):
    model_dir, data = world
    out = run_sft(model_dir, data, tmp_path / "out", "max_steps=4", "stop_after_steps=2")
    assert _steps(out) == [1, 2]
    run_sft(model_dir, data, out, "max_steps=4", "resume=true")
    assert _steps(out) == [1, 2, 3, 4]  # the records continue
    assert not list(out.glob("earlier-run-*")) and not list(out.glob("overwritten-*"))
    assert "earlier run" not in capsys.readouterr().out


def _write(path, *runs: range) -> None:
    lines = [{"step": s, "loss": float(10 * i + s)} for i, run in enumerate(runs) for s in run]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plot_of_two_runs_plots_the_last_and_warns(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, range(1, 6), range(1, 4))  # a second "step": 1 after step 5, on line 6
    with pytest.warns(UserWarning) as caught:
        assert plot_run(tmp_path).is_file()
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"{metrics}:6: a later run starts here (step 1 after step 5)")
    assert "\n" not in message
    with pytest.warns(UserWarning, match=f"{metrics}:6:"):
        assert read_metrics(metrics) == {"loss": [(1, 11.0), (2, 12.0), (3, 13.0)]}

    _write(metrics, range(1, 6), range(4, 7))  # a resume redoing steps 4-5: one run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        series = read_metrics(metrics)
    assert series["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
