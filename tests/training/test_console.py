"""What a run shows on the console: one short line per logged step for every recipe (SFT, DPO,
KD, reward model, GRPO, PPO), the fields of its kind to a few significant digits, the
parameter count at the start (trainable of total for LoRA), the loss on the progress bar, a
summary at the end whose numbers are ``metrics.jsonl``'s and which names the checkpoint,
progress lines when stdout is a file and no console logger is configured, the elapsed time
continuing a resumed run's, and no known third-party notice (while other warnings and log
lines still get through).

One run of each recipe (a few steps on the tiny world) serves every test of its output."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tunesmith.training.logging.loggers as loggers_module
from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    REPO_ROOT,
    _any_component_allowed,
    checkpoints,
    make_chat_data,
    make_model_dir,
    recipe_config,
    run_config,
)
from tests.rl.rl_world import grpo_overrides, make_prompts
from tunesmith.config import load_config
from tunesmith.models import from_hf
from tunesmith.recipes import config_path
from tunesmith.training import JSONLLogger, MultiLogger, StdoutLogger
from tunesmith.training.logging.console import CONSOLE_FIELDS, RunSummary, console_line
from tunesmith.training.logging.plot import metric_panels
from tunesmith.training.logging.quiet import RAY_LEVEL, quiet_third_party

LIMIT = 160
STEPS = ["max_steps=4", "batch_size=2"]
NOISE = {  # (logger, message) of the real third-party lines, as their sources log them
    "torchao": "Failed to load /v/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not "
    "load this library: /v/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively "
    "supported by torch.compile as an opaque value type. Calling register_constant() on Enum "
    "subclasses is deprecated and will be an error in a future release.",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from "
    "kernels-community: no kernels. Please make sure you already `pip install kernels` and "
    "the kernels >= 0.11.1",
}
RAY_INFO = "Started a local Ray instance."
CONTROL = "tunesmith-test: a line that is not noise"


def noisy_from_hf(path: str, dtype: str = "float32"):
    """The model of the LoRA run, built after the third-party lines a real run may meet (and
    lines of the same loggers that are not noise)."""
    warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
    warnings.warn(CONTROL, UserWarning, stacklevel=1)
    for name, message in NOISE.items():
        logging.getLogger(name).warning(message)
        logging.getLogger(name).warning(CONTROL)
    logging.getLogger("ray._private.worker").info(RAY_INFO)
    logging.getLogger("ray._private.worker").warning(CONTROL)
    return from_hf(path, dtype=dtype)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.name, record.getMessage()))


@contextlib.contextmanager
def _captured():
    """stdout, stderr, the warnings shown and the log records that reach the noisy loggers'
    handlers."""
    import ray  # noqa: F401  (imported: its logger has its handlers)

    out, err, records = io.StringIO(), io.StringIO(), _Records()
    names = [*NOISE, "ray"]
    for name in names:
        logging.getLogger(name).addHandler(records)
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as shown,
        ):
            warnings.simplefilter("always")
            yield out, err, shown, records
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(records)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each recipe's run: its output folder and what it printed (the LoRA SFT run with
    validation, its model built by :func:`noisy_from_hf`; GRPO with no console logger)."""
    root = tmp_path_factory.mktemp("console")
    model_dir = make_model_dir(root)
    chat = make_chat_data(root / "chat.jsonl", rows=8)
    val = make_chat_data(root / "val.jsonl", rows=4, seed=1)
    pairs = make_preference_data(root / "pairs.jsonl", rows=8)
    prompts = make_prompts(root / "prompts.jsonl", rows=24)
    noisy = "model.model._component_=tests.training.test_console.noisy_from_hf"
    configs = {
        "sft": recipe_config("sft", "tiny_lora", model_dir, chat, root / "sft", *STEPS, noisy,
                             "eval_every_n_steps=2", val=val),
        "dpo": recipe_config("dpo", "tiny", model_dir, pairs, root / "dpo", *STEPS,
                             "progress_bar=true"),
        "kd": recipe_config("kd", "tiny", model_dir, chat, root / "kd", *STEPS,
                            f"teacher_dir={model_dir}"),
        "reward_model": recipe_config("reward_model", "tiny", model_dir, pairs, root / "rm", *STEPS),
        "grpo": load_config(config_path("tiny", "grpo"), grpo_overrides(
            model_dir, prompts, root / "grpo", "max_steps=3", "generation.max_new_tokens=6",
            "progress_bar=auto", f"metric_loggers=[{{_component_: tunesmith.training.JSONLLogger, "
            f"log_dir: {root / 'grpo'}}}]")),
        "ppo": load_config(config_path("tiny", "ppo"), grpo_overrides(
            model_dir, prompts, root / "ppo", "max_steps=3", "generation.max_new_tokens=6")),
    }  # fmt: skip
    out = {}
    for recipe, cfg in configs.items():
        with _captured() as (stdout, stderr, shown, records), _any_component_allowed():
            run_config(recipe, cfg)
        out[recipe] = {"dir": Path(cfg.output_dir), "out": stdout.getvalue(), "model": model_dir,
                       "err": stderr.getvalue(), "warnings": [str(w.message) for w in shown],
                       "logs": records.lines}  # fmt: skip
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _step_lines(text: str) -> list[str]:
    """The lines of training records (not evaluations, not the notes a step may print)."""
    return [line for line in text.splitlines() if line.startswith("step ") and "elapsed" in line]


@pytest.mark.parametrize("recipe", ["sft", "dpo", "kd", "reward_model", "grpo", "ppo"])
def test_every_recipe_prints_short_lines_with_the_fields_of_its_kind(runs, recipe):
    text = runs[recipe]["out"]
    assert text and all(len(line) < LIMIT for line in text.splitlines()), text
    trained = _step_lines(text)
    assert trained, text
    fields = ("reward", "len") if recipe in ("grpo", "ppo") else ("epoch", "loss", "lr", "rss")
    for line in trained:
        assert all(f" {field} " in line for field in fields), line
        assert "tokens_seen" not in line and "_in_window" not in line  # the file's only


def test_the_step_line_shows_the_records_numbers_to_a_few_digits(runs):
    records = {r["step"]: r for r in _records(runs["sft"]["dir"]) if "loss" in r}
    lines = {
        int(re.match(r"step (\d+)/", line)[1]): line for line in _step_lines(runs["sft"]["out"])
    }
    assert sorted(lines) == sorted(records) == [1, 2, 3, 4]
    for step, record in records.items():
        line = lines[step]
        assert f"step {step}/4 | epoch {record['epoch']:.2f} | loss {record['loss']:.4g} | " in line
        assert f"acc {100 * record['token_accuracy']:.1f}%" in line
        assert f"lr {record['lr']:.1e}" in line and f"rss {record['peak_rss_gb']:.3g} GB" in line
    ppo = {r["step"]: r for r in _records(runs["ppo"]["dir"]) if "reward" in r}
    for line in _step_lines(runs["ppo"]["out"]):
        record = ppo[int(re.match(r"step (\d+)/", line)[1])]
        assert f"reward {record['reward']:.3g}±{record['reward_std']:.2g}" in line
        assert f"vloss {record['critic/loss']:.3g}" in line


def test_the_summary_holds_the_runs_numbers_and_names_the_checkpoint(runs):
    run = runs["sft"]
    records = _records(run["dir"])
    train = [r for r in records if "loss" in r]
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    text = run["out"][run["out"].index("done: ") :].splitlines()
    best_step, best = min(evals, key=lambda e: e[1])
    peak = max(r["peak_rss_gb"] for r in train)
    assert text[0].startswith(f"done: step 4/4 | {train[-1]['tokens_seen']:,} tokens seen | ")
    assert text[0].endswith(f" tokens/s | peak rss {peak:.3g} GB")
    assert (
        text[1] == f"  val_loss {evals[-1][1]:.4g} at the end, best {best:.4g} (step {best_step})"
    )
    assert text[2] == f"  checkpoint: {checkpoints(run['dir'])[-1]}"
    shown = re.search(r"elapsed (\d+):(\d\d):(\d\d)", text[0]).groups()
    seconds = int(shown[0]) * 3600 + int(shown[1]) * 60 + int(shown[2])
    assert abs(seconds - records[-1]["elapsed_s"]) <= 1
    assert len(evals) == 2 and "token_accuracy" in train[0] and "val_token_accuracy" in records[-1]


def test_a_lora_run_prints_its_trainable_and_total_parameters(runs):
    base = from_hf(runs["sft"]["model"])
    total = sum(p.numel() for p in base.parameters())
    adapters = sum(
        8 * (m.in_features + m.out_features)  # rank 8: A [8, in] and B [out, 8]
        for name, m in base.named_modules()
        if name.endswith(("q_proj", "v_proj"))
    )
    share = adapters / (total + adapters)
    expected = f"parameters: {adapters:,} trained of {total + adapters:,} ({share:.2%})"
    assert expected in runs["sft"]["out"].splitlines()
    assert f"parameters: {total:,}, all trained" in runs["dpo"]["out"].splitlines()


def test_the_progress_bar_shows_the_loss(runs):
    """DPO with ``progress_bar=true``: the bar (on stderr) ends with the last step's loss."""
    last = [r for r in _records(runs["dpo"]["dir"]) if "loss" in r][-1]
    bar = runs["dpo"]["err"].replace("\r", "\n").splitlines()
    assert any(re.search(rf"4/4 .*loss {last['loss']:.4g}\]", line) for line in bar), bar


def test_a_run_without_a_console_logger_prints_progress_to_a_file(runs):
    """GRPO with only the JSONL logger, stdout not a terminal: a line at the first step and at
    the last (at most one every 30 s between), then the summary."""
    lines = _step_lines(runs["grpo"]["out"])
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 3/3"]
    assert "done: step 3/3" in runs["grpo"]["out"]


def test_third_party_notices_are_left_out_and_other_lines_kept(runs):
    run = runs["sft"]
    assert not [w for w in run["warnings"] if "set_vital" in w], run["warnings"]
    assert CONTROL in run["warnings"]
    logged = run["logs"]
    for name, message in NOISE.items():
        assert (name, message) not in logged
        assert (name, CONTROL) in logged  # the same logger's other lines get through
    assert ("ray._private.worker", RAY_INFO) not in logged
    assert ("ray._private.worker", CONTROL) in logged


def test_a_ray_imported_during_a_run_logs_warnings_only():
    code = (
        "import inspect\n"
        "from tunesmith.training.logging.quiet import quiet_third_party\n"
        "with quiet_third_party():\n"
        "    import ray\n"
        "print(inspect.signature(ray.init).parameters['logging_level'].default)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_LOGGER_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )
    assert done.stdout.strip() == RAY_LEVEL, done.stderr


# -- the line and the logger, without a run -----------------------------------------------------

EXTREME = {  # every field of both tables, each at its widest
    "epoch": 12345.678, "loss": -1.23456789e-12, "token_accuracy": 1.0, "lr": 1.23e-10,
    "grad_norm": 1.2345e300, "tokens_per_s": 9.99e12, "peak_rss_gb": 12345.6,
    "peak_alloc_gb": 139.9, "skipped_update": 123456, "reward": -1.23456e-11,
    "reward_std": 1.2345e-11, "kl": -1.2345e-12, "critic/loss": 1.2345e-11,
    "completion_length": 123456.7, "completion_length_max": 1234567, "generate_s": 12345.6,
    "reward_s": 1.23e-5, "logprobs_s": 1234.5, "train_s": 1.2e-6, "val_loss": float("nan"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(CONSOLE_FIELDS))
def test_a_line_stays_short_whatever_the_values(kind):
    record = (
        dict(EXTREME) if kind == "rl" else {k: v for k, v in EXTREME.items() if "reward" not in k}
    )
    line = console_line(1234567, record, total=9999999, elapsed=3.6e8, eta=3.6e8)
    assert len(line) < LIMIT and line.startswith("step 1234567/9999999 | ") and "eta" in line
    evaluation = {f"val_reward/reward_{i}": 0.123456 for i in range(30)}
    assert len(console_line(1234567, evaluation, total=9999999)) < LIMIT


def test_the_formats_of_the_table():
    record = {"epoch": 1.5, "loss": 6.33574, "token_accuracy": 0.41234, "lr": 5e-4,
              "grad_norm": 6.02441, "tokens_per_s": 13874.4291, "peak_alloc_gb": 1.3088}  # fmt: skip
    assert console_line(2, record, total=3, elapsed=62, eta=31) == (
        "step 2/3 | epoch 1.50 | loss 6.336 | acc 41.2% | lr 5.0e-04 | grad_norm 6.02 | "
        "13.9k tok/s | mem 1.31 GB | elapsed 0:01:02 | eta 0:00:31"
    )
    rl = {"loss": 1e-9, "reward": 0.52345, "reward_std": 0.3123, "completion_length": 5.94,
          "completion_length_max": 10.0, "lr": 1e-4, "generate_s": 0.21, "reward_s": 0.003,
          "logprobs_s": 0.05, "train_s": 0.12, "peak_rss_gb": 0.612}  # fmt: skip
    assert console_line(7, rl, total=700) == (
        "step 7/700 | reward 0.523±0.31 | len 5.94/10 | loss 1e-09 | lr 1.0e-04 | "
        "gen/score/lp/train 0.21/0.003/0.05/0.12s | rss 0.612 GB"
    )


def test_a_stopped_rl_runs_summary_says_so_and_its_best_reward_is_the_highest():
    summary = RunSummary(tokens_before=1000, clock=iter([0.0, 4.0]).__next__)
    summary.begin(10, start_step=2, elapsed_before=60.0)
    for step, reward in ((3, 0.2), (4, 0.7), (5, 0.4)):
        summary.log(step, {"tokens_seen": 1000 + 500 * (step - 2), "peak_alloc_gb": step / 10})
        summary.log(step, {"val_reward": reward})
    assert summary.text(None).splitlines() == [
        "stopped: step 5/10 | 2,500 tokens seen | elapsed 0:01:04 | 375 tokens/s | peak alloc 0.5 GB",
        "  val_reward 0.4 at the end, best 0.7 (step 4)",
        "  checkpoint: none saved",
    ]


def test_elapsed_continues_a_resumed_runs_on_the_console(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0, "elapsed_s": 3600.5}\n')
    clock = iter([100.0, 100.0, 130.0, 130.0])  # JSONL opens, begin, a line on each
    monkeypatch.setattr(loggers_module.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    logger = MultiLogger([StdoutLogger(stream), JSONLLogger(tmp_path)])
    logger.begin(10, start_step=5)
    logger.log(6, {"loss": 0.5})
    logger.close()
    assert stream.getvalue() == "step 6/10 | loss 0.5 | elapsed 1:00:30 | eta 0:02:00\n"
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["elapsed_s"] == 3630.5  # the file's record says the same


def test_a_min_interval_leaves_out_lines_but_not_the_last_or_an_evaluation(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 31.0, 32.0, 33.0, 34.0])  # begin, then one per line
    monkeypatch.setattr(loggers_module.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    logger = StdoutLogger(stream, min_interval_s=30)
    logger.begin(5)
    for step in (1, 2, 3, 4, 5):
        logger.log(step, {"loss": 1.0})
    logger.log(5, {"val_loss": 2.0})
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [
        ["step 1/5", "loss 1"], ["step 3/5", "loss 1"], ["step 5/5", "loss 1"],
        ["step 5/5", "val_loss 2"],
    ]  # fmt: skip


def test_quiet_restores_what_it_changed(monkeypatch):
    monkeypatch.delenv("RAY_LOGGER_LEVEL", raising=False)
    filters = list(warnings.filters)
    with quiet_third_party():
        assert os.environ.get("RAY_LOGGER_LEVEL") == RAY_LEVEL
        assert logging.getLogger("torchao").filters
    assert warnings.filters == filters and not logging.getLogger("torchao").filters
    assert "RAY_LOGGER_LEVEL" not in os.environ


def test_the_plot_draws_the_token_accuracy_with_the_other_accuracies():
    series = {"loss": [(1, 2.0)], "token_accuracy": [(1, 0.4)], "val_token_accuracy": [(1, 0.3)]}
    assert metric_panels(series) == [
        ("loss", ["loss"]),
        ("accuracy", ["token_accuracy", "val_token_accuracy"]),
    ]
