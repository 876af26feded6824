"""Periodic validation loss: the recipe's val_loss is the token-mean loss of the held-out split,
recomputed here independently from the saved checkpoint; TensorBoard gets the same scalars."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.recipes.sft_world import make_chat_data, make_model_dir, run_sft
from tunesmith.data import SFTDataset, Tokenizer, split_train_val
from tunesmith.models import from_hf


def test_val_loss_is_the_token_mean_loss_of_the_held_out_split(tmp_path):
    model_dir, data = make_model_dir(tmp_path), make_chat_data(tmp_path / "chat.jsonl", rows=20)
    out = tmp_path / "run"
    loggers = (
        f"metric_loggers=[{{_component_: tunesmith.training.JSONLLogger, log_dir: {out}}},"
        f" {{_component_: tunesmith.training.TensorBoardLogger, log_dir: {out}/tb}}]"
    )
    run_sft(
        model_dir,
        data,
        out,
        "val_fraction=0.25",
        "eval_every_n_steps=2",
        "max_steps=4",
        "batch_size=3",
        "lr_scheduler.num_warmup_steps=1",
        loggers,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_loss = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val_loss) == [2, 4]

    tokenizer = Tokenizer.from_pretrained(model_dir)
    dataset = SFTDataset(
        tokenizer, source=str(data), max_seq_len=128, on_bad_row="skip", train_on="assistant"
    )
    _, held_out = split_train_val(dataset, 0.25, seed=0)
    model = from_hf(out / "checkpoints" / "step_000004").eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in held_out:
            logits = model(torch.tensor([sample["input_ids"]]))[0]
            labels = torch.tensor(sample["labels"])
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    assert val_loss[4] == pytest.approx(total / tokens, rel=1e-5)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]
    assert events.Scalars("val_loss")[-1].value == pytest.approx(val_loss[4], rel=1e-6)
