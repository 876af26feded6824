"""Defaults users expect of a run: timed checkpoints, resume=true that refuses to start over
silently (and resume=auto that may), a validation set that is only another file, the
val_fraction split sizes, the chat template as one override checked against the vocabulary,
and a plot with each recipe's own metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.recipes.sft_world import (
    checkpoints,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    recipe_overrides,
    run_sft,
)
from tunesmith import recipes
from tunesmith.config import ConfigError
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.data.chat_template import control_tokens, load_template
from tunesmith.training import JSONLLogger, plot_run
from tunesmith.training.logging.plot import metric_panels
from tunesmith.training.logging.plot import read_metrics as read_series


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    return make_model_dir(root), make_counting_data(root / "count.jsonl", rows=16)


def test_timed_saves_checkpoint_each_time_the_interval_passed(world, tmp_path):
    model_dir, data = world
    due_every_step = "save_every_minutes=1e-9"
    out = run_sft(
        model_dir, data, tmp_path / "run", "max_steps=3", "keep_last=null", due_every_step
    )
    assert [p.name for p in checkpoints(out)] == [f"step_{s:06d}" for s in (1, 2, 3)]
    never = run_sft(
        model_dir,
        data,
        tmp_path / "never",
        "max_steps=3",
        "keep_last=null",
        "save_every_minutes=60",
    )
    assert [p.name for p in checkpoints(never)] == ["step_000003"]  # the last step only


def test_rank_zeros_clock_decides_timed_saves_for_every_rank(world, tmp_path):
    model_dir, data = world  # rank 1 never decides a save itself: it follows rank 0's
    out = tmp_path / "run"
    overrides = recipe_overrides(
        model_dir, data, out, "max_steps=3", "keep_last=null", "save_every_minutes=1e-9"
    )
    launch_ranks(overrides, tmp_path, world_size=2)
    saved = checkpoints(out)
    assert [p.name for p in saved] == [f"step_{s:06d}" for s in (1, 2, 3)]
    for step_dir in saved:
        ranks = sorted(p.name for p in (step_dir / "training_state").glob("rank*.pt"))
        assert ranks == ["rank0.pt", "rank1.pt"]


def test_resume_true_without_a_checkpoint_stops_and_auto_starts_fresh(world, tmp_path, capsys):
    model_dir, data = world
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError) as error:
        run_sft(model_dir, data, out, "max_steps=2", "resume=true")
    message = str(error.value)
    assert "\n" not in message and str(out / "checkpoints") in message
    assert "resume=false" in message and "resume=auto" in message
    assert not (out / "metrics.jsonl").exists()  # stopped before anything ran
    run_sft(model_dir, data, out, "max_steps=2", "resume=auto")  # none yet: from step 0
    assert sorted(read_metrics(out)) == [1, 2]
    capsys.readouterr()
    run_sft(model_dir, data, out, "max_steps=3", "resume=auto")  # one now: resumes it
    resumed = f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2"
    assert resumed in capsys.readouterr().out
    assert sorted(read_metrics(out)) == [1, 2, 3]


def test_val_dataset_source_alone_inherits_the_training_dataset(world, tmp_path):
    model_dir, data = world
    held_out = make_counting_data(tmp_path / "held_out.jsonl", rows=6, seed=5)
    out = run_sft(
        model_dir, data, tmp_path / "run", "max_steps=2", f"val_dataset.source={held_out}"
    )
    val_loss = read_eval_metrics(out)[2]["val_loss"]
    # the same loss by hand: the training dataset's settings (max_seq_len 128, the template) on
    # the held-out file, the final weights, mean over trained tokens
    from tunesmith.models import from_hf

    model = from_hf(model_dir, dtype=torch.float32)
    model.load_state_dict(final_weights(out))
    tok = Tokenizer.from_pretrained(model_dir)
    samples = SFTDataset(tok, source=str(held_out), max_seq_len=128).samples
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            logits = model(torch.tensor([sample["input_ids"]]))[0]
            labels = torch.tensor(sample["labels"])
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            count += int((labels != -100).sum())
    assert val_loss == pytest.approx(total / count, rel=1e-5)


def test_val_fraction_prints_the_split_sizes(world, tmp_path, capsys):
    model_dir, data = world
    run_sft(model_dir, data, tmp_path / "run", "max_steps=1", "val_fraction=0.25")
    assert "val_fraction=0.25: 12 training samples, 4 validation samples" in capsys.readouterr().out


def test_chat_template_is_one_override_and_a_mismatch_is_refused(world, tmp_path, capsys):
    model_dir, data = world  # a Qwen2.5-style vocabulary
    out = run_sft(
        model_dir, data, tmp_path / "ok", "max_steps=1", "tokenizer.chat_template=qwen2_5"
    )
    assert sorted(read_metrics(out)) == [1]
    with pytest.raises(ConfigError) as error:  # building the tokenizer component failed
        run_sft(model_dir, data, tmp_path / "bad", "max_steps=1", "tokenizer.chat_template=llama3")
    message = str(error.value)
    missing = control_tokens(load_template("llama3"))
    assert missing and "chat_template='llama3'" in message
    assert all(token in message for token in missing), message
    assert "\n" not in message


def _write(run_dir, records):
    with JSONLLogger(run_dir, timestamps=False) as logger:
        for step, metrics in records:
            logger.log(step, metrics)


@pytest.mark.parametrize(
    ("metrics", "panels"),
    [
        pytest.param(
            {
                "loss": 1.0,
                "rewards/chosen": 0.1,
                "rewards/rejected": -0.1,
                "rewards/margin": 0.2,
                "rewards/accuracy": 0.5,
                "lr": 1e-4,
            },
            [
                ("loss", ["loss"]),
                (
                    "rewards (chosen, rejected, margin)",
                    ["rewards/chosen", "rewards/rejected", "rewards/margin"],
                ),
                ("accuracy", ["rewards/accuracy"]),
                ("learning rate", ["lr"]),
            ],
            id="dpo",
        ),
        pytest.param(
            {"loss": 1.3, "rewards/margin": 0.2, "nll_loss": 1.1},
            [
                ("loss", ["loss"]),
                ("rewards (chosen, rejected, margin)", ["rewards/margin"]),
                ("chosen NLL", ["nll_loss"]),
            ],
            id="cpo",
        ),
        pytest.param(
            {"loss": 1.0, "kd_loss": 0.7, "ce_loss": 1.2},
            [("loss", ["loss"]), ("distillation losses", ["kd_loss", "ce_loss"])],
            id="kd",
        ),
        pytest.param(
            {"loss": 0.1, "reward": 0.4, "reward/correct": 0.3, "reward_std": 0.2, "kl": 0.01},
            [("loss", ["loss"]), ("reward", ["reward", "reward/correct"]), ("KL", ["kl"])],
            id="grpo",
        ),
    ],
)
def test_plot_shows_each_recipes_own_metrics(tmp_path, metrics, panels):
    _write(tmp_path, [(1, metrics), (2, metrics)])
    assert metric_panels(read_series(tmp_path / "metrics.jsonl")) == panels
    png = plot_run(tmp_path)
    width, height = _png_size(png)
    extra = len([p for p in panels if p[0] not in ("loss", "learning rate")])
    base = 6 if len(panels) > 1 else 4
    assert (width, height) == (800, int((base + 2.5 * extra) * 100))


def test_plot_draws_the_val_curves_of_recipe_metrics(tmp_path):
    _write(
        tmp_path,
        [
            (1, {"loss": 1.0, "rewards/margin": 0.1}),
            (1, {"val_loss": 1.1, "val_rewards/margin": 0.05}),
        ],
    )
    panels = dict(metric_panels(read_series(tmp_path / "metrics.jsonl")))
    assert panels["rewards (chosen, rejected, margin)"] == ["rewards/margin", "val_rewards/margin"]
    assert panels["loss"] == ["loss", "val_loss"]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_shipped_configs_save_periodically_show_a_bar_on_a_terminal_and_cache_tokens():
    configs = sorted(Path(recipes.__file__).parent.glob("configs/*/*.yaml"))
    assert len(configs) > 10
    for path in configs:
        text = path.read_text()
        assert re.search(r"(?m)^save_every_minutes: \d+", text), path
        assert re.search(r"(?m)^progress_bar: auto", text), path
        if "tunesmith.data.SFTDataset" in text or "tunesmith.data.PreferenceDataset" in text:
            assert "cache_dir: ${output_dir}/../.tunesmith_cache" in text, path


def test_a_val_source_alone_cannot_inherit_from_a_mixture():
    from omegaconf import OmegaConf

    from tunesmith.config import ConfigError
    from tunesmith.training.datasets import inherit_val_dataset

    cfg = OmegaConf.create(
        {
            "dataset": {"_component_": "tunesmith.data.DatasetMix", "parts": {"a": {}, "b": {}}},
            "val_dataset": {"source": "held.jsonl"},
        }
    )
    with pytest.raises(
        ConfigError,
        match=r"val_dataset.*mixture of \['a', 'b'\]: give "
        "val_dataset its own _component_",
    ):
        inherit_val_dataset(cfg)
