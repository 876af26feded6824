import json
import struct
import sys

import pytest

from tunesmith.training import JSONLLogger, plot_run, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _log_run(run_dir, with_lr=True, with_val=True):
    with JSONLLogger(run_dir) as logger:
        for step in range(1, 31):
            metrics = {"loss": 3.0 / step}
            if with_lr:
                metrics["lr"] = 1e-4 * min(1.0, step / 5)
            logger.log(step, metrics)
            if with_val and step % 10 == 0:
                logger.log(step, {"val_loss": 3.5 / step})


def test_plot_run_writes_png(tmp_path):
    _log_run(tmp_path / "run")
    out = plot_run(tmp_path / "run")
    assert out == tmp_path / "run" / "loss.png"
    width, height = _png_size(out)
    assert (width, height) == (800, 600)  # two panels: loss + lr


def test_plot_run_custom_output_single_panel(tmp_path):
    _log_run(tmp_path / "run", with_lr=False, with_val=False)
    out = plot_run(tmp_path / "run", tmp_path / "plots" / "curve.png")
    assert out == tmp_path / "plots" / "curve.png"
    assert _png_size(out) == (800, 400)  # no lr logged: loss panel only


def test_read_metrics_last_value_wins(tmp_path):
    _log_run(tmp_path)
    with JSONLLogger(tmp_path) as logger:  # a resumed run re-logs steps 29-30
        logger.log(29, {"loss": 9.0})
        logger.log(30, {"loss": 8.0})
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series["loss"][:2] == [(1, 3.0), (2, 1.5)]
    assert series["loss"][-2:] == [(29, 9.0), (30, 8.0)]
    assert len(series["loss"]) == 30
    assert series["val_loss"] == [(10, 0.35), (20, 0.175), (30, 3.5 / 30)]


def test_missing_metrics_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        plot_run(tmp_path)


def test_no_loss_values_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "lr": 1e-4}) + "\n")
    with pytest.raises(ValueError, match="no 'loss' or 'val_loss'"):
        plot_run(tmp_path)


def test_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"loss": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        plot_run(tmp_path)


def test_missing_matplotlib_names_extra(monkeypatch, tmp_path):
    _log_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"tunesmith\[plot\]"):
        plot_run(tmp_path)
