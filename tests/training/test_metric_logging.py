import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
import yaml

from tunesmith.training import (
    JSONLLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)

CFG = {"model": {"_component_": "tunesmith.models.llama3", "dim": 64}, "lr": 2e-5, "tags": ["a"]}


def test_stdout_format(capsys):
    logger = StdoutLogger()
    logger.log(10, {"loss": 1.23454321, "lr": 2e-5, "tokens": 4096, "grad_norm": torch.tensor(0.5)})
    logger.log(11, {"loss": float("nan"), "big": 123456.0, "zero": 0.0})
    logger.log(11, {"val_loss": 2.0, "big": 123456.0, "n": 3})  # not a training record: all
    out = capsys.readouterr().out
    assert out.splitlines() == [  # a training record: the console's fields only
        "step 10 | loss 1.235 | lr 2.0e-05 | grad_norm 0.5",
        "step 11 | loss nan",
        "step 11 | val_loss 2 | big 1.235e+05 | n 3",
    ]


def test_stdout_log_config(capsys):
    StdoutLogger().log_config(CFG)
    assert capsys.readouterr().out == ""  # quiet by default
    StdoutLogger(print_config=True).log_config(CFG)
    out = capsys.readouterr().out
    assert out.startswith("config:\n")
    assert yaml.safe_load(out[len("config:\n") :]) == CFG


def test_jsonl_round_trip(tmp_path):
    logger = JSONLLogger(tmp_path / "run", timestamps=False)
    logger.log(1, {"loss": 2.5, "lr": 1e-4})
    # flushed per line: readable before close
    assert (
        tmp_path / "run" / "metrics.jsonl"
    ).read_text() == '{"step": 1, "loss": 2.5, "lr": 0.0001}\n'
    logger.log(2, {"loss": torch.tensor(1.25), "tokens": 7})
    logger.log_config(CFG)
    logger.close()
    logger.close()  # idempotent

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in lines] == [
        {"step": 1, "loss": 2.5, "lr": 1e-4},
        {"step": 2, "loss": 1.25, "tokens": 7},
    ]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == CFG

    # A resumed run appends to the same file.
    with JSONLLogger(tmp_path / "run") as again:
        again.log(3, {"loss": 1.0})
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    with pytest.raises(RuntimeError, match="closed"):
        again.log(4, {"loss": 1.0})


def test_log_config_accepts_omegaconf(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"output_dir": "/out", "log_dir": "${output_dir}/logs", "n": 3})
    with JSONLLogger(tmp_path) as logger:
        logger.log_config(cfg)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {
        "output_dir": "/out",
        "log_dir": "/out/logs",
        "n": 3,
    }


@pytest.mark.parametrize(
    "metrics,err,match",
    [
        ({"loss": "high"}, TypeError, "'loss'"),
        ({"loss": True}, TypeError, "'loss'"),
        ({"step": 3.0}, ValueError, "reserved"),
        ({"loss": torch.ones(3)}, TypeError, "'loss'"),
    ],
)
def test_bad_metrics_name_the_key(tmp_path, metrics, err, match):
    with JSONLLogger(tmp_path) as logger, pytest.raises(err, match=match):
        logger.log(1, metrics)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_tensorboard_event_file_has_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardLogger(tmp_path / "tb") as logger:
        for step in range(5):
            logger.log(step, {"loss": 3.0 - 0.5 * step, "lr": 1e-4 * (step + 1)})
        logger.log_config(CFG)

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([3.0, 2.5, 2.0, 1.5, 1.0])
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([1e-4 * k for k in range(1, 6)])


def test_tensorboard_missing_names_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"tunesmith\[tb\]"):
        TensorBoardLogger(tmp_path)


def test_wandb_missing_names_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"tunesmith\[wandb\]"):
        WandBLogger("proj")


def test_wandb_calls_run_api(monkeypatch, tmp_path):
    calls = []

    class Config:
        def update(self, d, allow_val_change=False):
            calls.append(("config", d, allow_val_change))

    class Run:
        config = Config()

        def log(self, metrics, step=None):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    logger = WandBLogger("proj", name="run1", log_dir=tmp_path / "wb", tags=["x"])
    logger.log(5, {"loss": torch.tensor(0.25)})
    logger.log_config(CFG)
    logger.close()
    logger.close()
    assert calls == [
        (
            "init",
            {
                "project": "proj",
                "entity": None,
                "name": "run1",
                "tags": ["x"],
                "dir": str(tmp_path / "wb"),
            },
        ),
        ("log", {"loss": 0.25}, 5),
        ("config", CFG, True),
        ("finish",),
    ]


def test_optional_backends_not_imported_at_module_import(tmp_path):
    # A fake `wandb` on the path that records being imported; importing our package must not.
    (tmp_path / "wandb.py").write_text("import os; open(os.environ['FLAG'], 'w').close()\n")
    code = textwrap.dedent(
        """
        import sys
        import tunesmith.training
        import tunesmith.training.logging.loggers, tunesmith.training.logging.plot
        bad = [m for m in ("wandb", "tensorboard", "torch.utils.tensorboard", "matplotlib")
               if m in sys.modules]
        assert not bad, bad
        """
    )
    flag = tmp_path / "imported"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FLAG": str(flag)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    assert not flag.exists()


def test_multi_logger_fans_out_and_null_logger(tmp_path, capsys):
    jsonl = JSONLLogger(tmp_path, timestamps=False)
    multi = MultiLogger([StdoutLogger(), jsonl, NullLogger()])
    multi.log(1, {"loss": 0.5})
    multi.log_config({"a": 1})
    multi.close()
    assert capsys.readouterr().out.splitlines()[0] == "step 1 | loss 0.5"
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5}
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"a": 1}
    with pytest.raises(RuntimeError, match="closed"):  # closed through the fan-out
        jsonl.log(2, {"loss": 0.1})
    for logger in (StdoutLogger(), jsonl, NullLogger(), multi):
        assert isinstance(logger, MetricLogger)
    with pytest.raises(TypeError, match=r"loggers\[1\]"):
        MultiLogger([NullLogger(), object()])


def test_multi_logger_close_closes_all_then_raises(tmp_path):
    class Broken(NullLogger):
        def close(self):
            raise OSError("boom")

    jsonl = JSONLLogger(tmp_path)
    with pytest.raises(OSError, match="boom"):
        MultiLogger([Broken(), jsonl]).close()
    with pytest.raises(RuntimeError, match="closed"):
        jsonl.log(2, {"loss": 0.1})


def test_jsonl_records_carry_wall_time_and_elapsed_training_time(tmp_path, monkeypatch):
    clock = {"wall": 1_000_000.0, "mono": 50.0}
    monkeypatch.setattr(time, "time", lambda: clock["wall"])
    monkeypatch.setattr(time, "monotonic", lambda: clock["mono"])
    with JSONLLogger(tmp_path) as logger:
        clock["wall"] += 2.0
        clock["mono"] += 2.0
        logger.log(1, {"loss": 0.5})
    clock["wall"] += 3600.0  # the run is down for an hour, then resumed
    clock["mono"] = 7.0  # another process: another monotonic clock
    with JSONLLogger(tmp_path) as logger:
        clock["wall"] += 1.5
        clock["mono"] += 1.5
        logger.log(2, {"loss": 0.4})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "loss": 0.5, "time": 1_000_002.0, "elapsed_s": 2.0}
    # the clock goes on from the last record: 2 s before the stop + 1.5 s after the resume
    assert lines[1] == {"step": 2, "loss": 0.4, "time": 1_003_603.5, "elapsed_s": 3.5}
