"""A packed run evaluates its validation set packed the same way as its training set (the
loop evaluates with the training collate), and its validation loss is the unpacked run's: the
same model (``lr=0``: both runs evaluate their initial weights) on the same held-out samples
(a ``val_fraction`` split of samples of different lengths, several to a pack, with padding)
gives the same token-mean loss, for the SFT and the KD recipe (the two that pack)."""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import (
    make_counting_data,
    make_model_dir,
    read_eval_metrics,
    run_recipe,
    sample_lengths,
)
from tunesmith.data import PackedDataset, SFTDataset, Tokenizer, split_train_val

VAL_FRACTION, SEED = 0.25, 0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-val")
    student = make_model_dir(root / "student", seed=0)
    data = make_counting_data(root / "count.jsonl", rows=24, seed=5)
    return {
        "student": student,
        "teacher": make_model_dir(root / "teacher", seed=1),
        "data": data,
        "pack_len": 2 * max(sample_lengths(student, data)) + 5,  # 2 or 3 samples a pack
    }


def _overrides(world) -> list[str]:
    return [
        f"val_fraction={VAL_FRACTION}", f"seed={SEED}", "eval_every_n_steps=1", "max_steps=1",
        "batch_size=2", f"dataset.max_seq_len={world['pack_len']}", "optimizer.lr=0.0",
    ]  # fmt: skip


def _val_records(recipe: str, world, out, *extra: str) -> dict[str, float]:
    run_recipe(recipe, "tiny", world["student"], world["data"], out, *_overrides(world), *extra)
    records = read_eval_metrics(out)
    assert sorted(records) == [1], records
    return {k: v for k, v in records[1].items() if k.startswith("val_")}


def test_the_validation_split_really_packs(world):
    tokenizer = Tokenizer.from_pretrained(world["student"])
    dataset = SFTDataset(tokenizer, source=str(world["data"]), max_seq_len=world["pack_len"])
    _, held_out = split_train_val(dataset, VAL_FRACTION, seed=SEED)
    packs = PackedDataset(held_out, world["pack_len"], tokenizer.pad_id)
    assert len(packs) >= 2 and any(len(m) >= 2 for m in packs.members) and packs.fill < 1


@pytest.mark.parametrize("recipe", ["sft", "kd"])
def test_packed_val_loss_equals_unpacked_val_loss(recipe, world, tmp_path):
    extra = [f"teacher_dir={world['teacher']}"] if recipe == "kd" else []
    packed = _val_records(recipe, world, tmp_path / "packed", "packed=true", *extra)
    unpacked = _val_records(recipe, world, tmp_path / "unpacked", "packed=false", *extra)
    expected = {"val_loss"} | ({"val_kd_loss", "val_ce_loss"} if recipe == "kd" else set())
    assert packed.keys() == unpacked.keys() and expected <= packed.keys()
    assert packed["val_loss"] > 1.0  # an untrained model's loss, not an empty sum
    for key in packed:
        assert packed[key] == pytest.approx(unpacked[key], rel=1e-5, abs=1e-6), key
