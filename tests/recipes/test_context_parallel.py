"""Context parallel (``parallelism.cp``) trains like one process.

Each run splits every row over the ``cp`` ranks (zigzag halves, ring attention) and must log
the single process's loss, grad norm and other metrics at each of :data:`STEPS` steps (rel
1e-5) and end with its weights (atol 1e-5):

- ``sft`` cp2, right-padded rows (odd lengths: padded to a multiple of 4 by the split) and
  packed rows (documents crossing the split);
- ``sft`` cp4 on 4 ranks (each row in eight zigzag chunks; ~12 s);
- ``sft`` cp2 x dp_shard2 and cp2 x tp2 on 4 ranks (slow);
- ``dpo`` cp2: the per-row log-probabilities summed over the cp ranks;
- ``kd`` cp2 (a wider teacher, split like the student; slow);
- ``reward_model`` under cp2 is refused, naming the recipe.

The model has GQA (4 query heads, 2 key/value heads) and an odd vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    checkpoint_weights,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    recipe_overrides,
    run_recipe,
)
from tunesmith.config import ConfigError
from tunesmith.training.objectives import TokenCrossEntropy
from tunesmith.training.parallel.context_parallel import check_objective, shard_batch, zigzag_index
from tunesmith.training.parallel.distributed import ParallelDims

STEPS, BATCH = 3, 4
CP2 = ("parallelism.cp=2", "parallelism.dp_shard=1")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    model_dir = make_model_dir(root / "model", vocab_size=657)
    chat = make_counting_data(root / "count.jsonl", rows=24)
    pairs = make_preference_data(root / "add.jsonl", rows=16, seed=0, task="add")
    return {"root": root, "model_dir": model_dir, "data": {"sft": chat, "dpo": pairs},
            "single": {}}  # fmt: skip


def _single(world, recipe: str, *shared: str):
    key = (recipe, shared)
    if key not in world["single"]:
        out = world["root"] / f"single_{recipe}_{len(world['single'])}"
        run_recipe(
            recipe,
            "tiny",
            world["model_dir"],
            world["data"][recipe],
            out,
            f"batch_size={BATCH}",
            f"max_steps={STEPS}",
            *shared,
        )
        world["single"][key] = out
    return world["single"][key]


def _parallel(world, tmp_path, recipe: str, ranks: int, per_rank: int, *extra: str):
    out = tmp_path / "cp"
    overrides = recipe_overrides(
        world["model_dir"],
        world["data"][recipe],
        out,
        f"batch_size={per_rank}",
        f"max_steps={STEPS}",
        *extra,
    )
    launch_ranks(overrides, tmp_path, recipe=recipe, world_size=ranks, timeout=300)
    return out


def _assert_same(single, parallel, model_dir) -> None:
    logged_1, logged_2 = read_metrics(single), read_metrics(parallel)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step, one in logged_1.items():
        two = logged_2[step]
        assert one.keys() == two.keys(), step
        for key, value in one.items():
            if isinstance(value, (int, float)) and not key.endswith(("_s", "_gb")):  # timings
                assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{key} step {step}"
    weights_1, weights_2 = final_weights(single), final_weights(parallel)
    assert weights_1.keys() == weights_2.keys()
    for name in weights_1:
        torch.testing.assert_close(
            weights_2[name], weights_1[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    initial = checkpoint_weights(model_dir)
    assert max((weights_1[k] - initial[k]).abs().max().item() for k in initial) > 1e-3


def test_sft_cp2_equals_one_process(world, tmp_path):
    single = _single(world, "sft")
    out = _parallel(world, tmp_path, "sft", 2, BATCH, *CP2)
    _assert_same(single, out, world["model_dir"])


def test_sft_cp2_packed_equals_one_process(world, tmp_path):
    single = _single(world, "sft", "packed=true", "dataset.max_seq_len=150")
    out = _parallel(
        world, tmp_path, "sft", 2, BATCH, *CP2, "packed=true", "dataset.max_seq_len=150"
    )
    _assert_same(single, out, world["model_dir"])


def test_dpo_cp2_equals_one_process(world, tmp_path):
    single = _single(world, "dpo", "optimizer.lr=1e-3")
    out = _parallel(world, tmp_path, "dpo", 2, BATCH, *CP2, "optimizer.lr=1e-3")
    _assert_same(single, out, world["model_dir"])


def test_sft_cp4_equals_one_process(world, tmp_path):
    single = _single(world, "sft")
    out = _parallel(world, tmp_path, "sft", 4, BATCH, "parallelism.cp=4", "parallelism.dp_shard=1")
    _assert_same(single, out, world["model_dir"])


@pytest.mark.slow
def test_sft_cp2_dp2_equals_one_process(world, tmp_path):
    single = _single(world, "sft")
    out = _parallel(
        world, tmp_path, "sft", 4, BATCH // 2, "parallelism.cp=2", "parallelism.dp_shard=2"
    )
    _assert_same(single, out, world["model_dir"])


@pytest.mark.slow
def test_sft_cp2_tp2_equals_one_process(world, tmp_path):
    single = _single(world, "sft")
    out = _parallel(
        world,
        tmp_path,
        "sft",
        4,
        BATCH,
        "parallelism.cp=2",
        "parallelism.tp=2",
        "parallelism.dp_shard=1",
    )
    _assert_same(single, out, world["model_dir"])


@pytest.mark.slow
def test_kd_cp2_equals_one_process(world, tmp_path):
    teacher = world.get("teacher")
    if teacher is None:
        teacher = world["teacher"] = make_model_dir(
            world["root"] / "teacher",
            seed=1,
            vocab_size=657,
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
        )
    world["data"]["kd"] = world["data"]["sft"]
    single = _single(world, "kd", f"teacher_dir={teacher}")
    out = _parallel(world, tmp_path, "kd", 2, BATCH, *CP2, f"teacher_dir={teacher}")
    _assert_same(single, out, world["model_dir"])


def test_whole_sequence_objectives_are_refused():
    from tunesmith.training.objectives import PairwiseRanking

    check_objective(object.__new__(TokenCrossEntropy), 2)  # token sums: fine
    with pytest.raises(
        ConfigError, match=r"cp 2: PairwiseRanking \(tunesmith.training.objectives.ranking\)"
    ):
        check_objective(object.__new__(PairwiseRanking), 2)
    check_objective(object.__new__(PairwiseRanking), 1)  # no context parallel: nothing to refuse


def test_cp_is_a_mesh_dimension():
    dims = ParallelDims.resolve({"cp": 2, "dp_shard": "auto"}, world_size=8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.dp_cp) == (4, 2, 4, 8)
    assert dims.mesh_shape() == ((4, 2), ("dp_shard", "cp"))
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # cp ranks share samples


def test_shard_batch_pads_and_cuts_zigzag():
    ids = torch.arange(10, 16)[None].repeat(2, 1)  # 6 tokens: padded to 8, chunks of 2
    batch = {
        "input_ids": ids, "labels": ids + 100, "position_ids": torch.arange(6)[None].repeat(2, 1),
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, -1]]),
        "attention_mask": torch.ones(2, 6, dtype=torch.long),
        "reference_chosen": torch.tensor([1.5, 2.5]),  # [b]: kept whole
    }  # fmt: skip
    rank0 = shard_batch(batch, cp_rank=0, cp_size=2)
    rank1 = shard_batch(batch, cp_rank=1, cp_size=2)
    assert rank0["cp_index"].tolist() == [[0, 1, 6, 7]] * 2
    assert rank1["cp_index"].tolist() == [[2, 3, 4, 5]] * 2
    assert rank0["input_ids"].tolist() == [[10, 11, 0, 0]] * 2
    assert rank0["labels"].tolist() == [[110, 111, -100, -100]] * 2
    assert rank0["position_ids"].tolist() == [[0, 1, 6, 7]] * 2  # padding counts on
    assert rank0["document_ids"].tolist() == [[0, 0, -1, -1], [0, 0, -1, -1]]
    assert rank0["attention_mask"].tolist() == [[1, 1, 0, 0]] * 2
    assert rank1["document_ids"].tolist() == [[0, 1, 1, 1], [0, 0, 0, -1]]
    assert rank1["reference_chosen"] is batch["reference_chosen"]
    assert shard_batch(batch, cp_rank=0, cp_size=2, multiple=2)["input_ids"].shape == (2, 4)
    assert shard_batch(batch, cp_rank=0, cp_size=2, multiple=3)["input_ids"].shape == (2, 6)
    assert zigzag_index(12, 2, 3).tolist() == [4, 5, 6, 7]
