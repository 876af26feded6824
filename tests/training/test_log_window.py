"""Logging every n steps logs the window's means (the loss over every unit of the window), not
the last step's; lines show ``step N/total``, the elapsed time and an ETA; log lines are never
glued to a progress bar."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
from tqdm import tqdm

from tests.recipes.sft_world import make_counting_data, make_model_dir, read_metrics, run_sft
from tunesmith.training.logging import loggers as metric_logging
from tunesmith.training.logging.loggers import MetricWindow, StdoutLogger, format_duration


def test_window_means_by_hand():
    window = MetricWindow("trained_tokens", weighted=["loss"])
    steps = [
        {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_seen": 100, "trained_tokens": 10,
         "accuracy": 0.5, "reward": 1.0},
        {"loss": 1.0, "lr": 9e-4, "grad_norm": 3.0, "tokens_seen": 250, "trained_tokens": 30,
         "accuracy": 0.9, "reward": 0.0},
        {"loss": 0.0, "lr": 8e-4, "tokens_seen": 260, "trained_tokens": 0, "skipped_update": 1.0},
    ]  # fmt: skip
    for i, step in enumerate(steps):
        window.add(step, weighted=["accuracy"] if i < 2 else [])
    means = window.means()
    assert means["loss"] == pytest.approx((2.0 * 10 + 1.0 * 30 + 0.0 * 0) / 40)  # 1.25
    assert means["accuracy"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)  # weighted too
    assert means["reward"] == pytest.approx(0.5)  # a rollout metric: the mean of the steps
    assert means["grad_norm"] == pytest.approx(2.0)  # the steps that have one
    assert means["trained_tokens"] == 40 and type(means["trained_tokens"]) is int
    assert means["lr"] == 8e-4 and means["tokens_seen"] == 260  # the last: a position
    assert means["skipped_update"] == 1.0
    assert list(means)[:5] == ["loss", "lr", "grad_norm", "tokens_seen", "trained_tokens"]
    window.clear()
    assert len(window) == 0 and window.means() == {}


def test_a_window_without_units_is_the_plain_mean():
    window = MetricWindow("pairs")
    window.add({"loss": 3.0, "pairs": 0})
    window.add({"loss": 1.0, "pairs": 0})
    assert window.means()["loss"] == 2.0


def test_logged_loss_is_the_unit_weighted_mean_of_the_window(tmp_path):
    model_dir = make_model_dir(tmp_path)
    data = make_counting_data(tmp_path / "count.jsonl", rows=24)  # answers of 1..6 numbers
    every = run_sft(model_dir, data, tmp_path / "every", "max_steps=5")
    windowed = run_sft(model_dir, data, tmp_path / "windowed", "max_steps=5", "log_every_n_steps=3")
    steps, lines = read_metrics(every), read_metrics(windowed)
    assert sorted(lines) == [3, 5]  # every 3rd step, and the last
    for end, window in ((3, [1, 2, 3]), (5, [4, 5])):
        units = [steps[s]["trained_tokens_in_window"] for s in window]
        assert len(set(units)) > 1  # the weighting matters
        loss = sum(steps[s]["loss"] * u for s, u in zip(window, units)) / sum(units)
        assert lines[end]["loss"] == pytest.approx(loss, rel=1e-12)
        assert lines[end]["loss"] != pytest.approx(steps[end]["loss"], rel=1e-6)
        assert lines[end]["trained_tokens_in_window"] == sum(units)
        assert lines[end]["grad_norm"] == pytest.approx(
            sum(steps[s]["grad_norm"] for s in window) / len(window), rel=1e-12
        )
        assert lines[end]["lr"] == steps[end]["lr"]
        assert lines[end]["tokens_seen"] == steps[end]["tokens_seen"]
    first = json.loads((windowed / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and "first_step_s" in first and "loss" not in first
    assert "first_step_s" not in lines[3] and lines[3]["step_time_s"] > 0  # steps 2-3 only


def test_stdout_lines_show_step_of_total_elapsed_and_eta(monkeypatch):
    clock = iter([100.0, 130.0, 160.0])  # begin, then one log call each
    monkeypatch.setattr(metric_logging.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    logger = StdoutLogger(stream)
    logger.begin(200, start_step=0)
    logger.log(10, {"loss": 1.5})  # 30 s for 10 steps: 190 left take 570 s
    logger.log(20, {"loss": 1.25})  # 60 s for 20 steps: 180 left take 540 s
    assert stream.getvalue().splitlines() == [
        "step 10/200 | loss 1.5 | elapsed 0:00:30 | eta 0:09:30",
        "step 20/200 | loss 1.25 | elapsed 0:01:00 | eta 0:09:00",
    ]
    assert format_duration(3725.9) == "1:02:05"


def test_a_resumed_run_counts_its_pace_from_where_it_resumed(monkeypatch):
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(metric_logging.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    logger = StdoutLogger(stream)
    logger.begin(100, start_step=50)
    logger.log(60, {"loss": 1.0})  # 10 steps in 10 s: 40 left take 40 s
    assert stream.getvalue() == "step 60/100 | loss 1 | elapsed 0:00:10 | eta 0:00:40\n"


def test_log_lines_are_never_glued_to_a_progress_bar(capsys):
    bar = tqdm(total=10, file=sys.stdout, desc="sft", mininterval=0)  # a bar on the same stream
    bar.update(3)
    StdoutLogger().log(3, {"loss": 1.5})
    bar.update(1)
    bar.close()
    out = capsys.readouterr().out
    pieces = re.split(r"[\r\n]", out)
    line = [p for p in pieces if "loss 1.5" in p]
    assert line == ["step 3 | loss 1.5"], out  # alone on its line: no bar text around it
    assert out.index("step 3 | loss") > out.index("3/10")  # the bar was drawn before it ...
    assert "4/10" in out[out.index("step 3 | loss") :]  # ... and again after it


def test_progress_bar_auto_follows_whether_stdout_is_a_terminal(monkeypatch):
    from tunesmith.training.loop import _show_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert _show_bar("auto") is False  # pytest's captured stdout is no terminal
    assert _show_bar(None) is False
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert _show_bar("auto") is True and _show_bar(False) is False
    assert _show_bar(True) is True
