"""Expert parallel through the SFT recipe == one process, for a tiny Qwen3-MoE model: the
logged losses (cross-entropy plus the load-balancing loss, its coefficient raised to 0.1 so it
weighs), grad norms, token counts and the exported weights after 3 steps.

Why the runs match: every rank takes one sample per step (batch 1, so no padding) and the
single process takes the same samples as ``gradient_accumulation_steps`` micro-batches of
one (the sampler hands rank ``r`` the samples ``perm[r::world]``). The load-balancing loss is
a mean per micro-batch, weighted ``1 / accumulation`` in one process and averaged over the
data-parallel ranks under EP: the same sum. ep 2 on 2 ranks holds 4 of the 8 experts per
rank; ep 2 on 4 ranks (``dp_shard`` 4) has two holders of each expert, whose gradients are
summed; ep 4 on 4 ranks holds 2 experts per rank. tp 2 x dp_shard 2 with ep 2: the MoE layers
are replicated under TP (each tp rank routes the whole sequence) and their experts split over
the two dp_shard ranks of one tp coordinate (the rank layout is checked by hand). A run of
ep2 stopped at step 2 and resumed ends as the uninterrupted one (the experts' DTensor weights
and AdamW moments round-trip through the checkpoint).
"""

from __future__ import annotations

import pytest
import torch

from tests.recipes.sft_world import (
    assert_same_as_single,
    checkpoint_weights,
    checkpoints,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_sft,
    sft_overrides,
)
from tunesmith.models.zoo import qwen3_moe
from tunesmith.training.parallel.distributed import ParallelDims, expert_rank_layout

STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    model_dir = make_model_dir(root, family=qwen3_moe, router_aux_loss_coef=0.1)
    data = make_counting_data(root / "count.jsonl", rows=24)
    return root, model_dir, data


def _single(root, model_dir, data, accumulation: int, config: str = "tiny"):
    return run_sft(
        model_dir,
        data,
        root / f"single{accumulation}_{config}",
        "batch_size=1",
        f"gradient_accumulation_steps={accumulation}",
        f"max_steps={STEPS}",
        config=config,
    )


def _expert_parallel(
    model_dir,
    data,
    tmp_path,
    world_size: int,
    timeout: float,
    config: str = "tiny",
    ep: int = 2,
    tp: int = 1,
):
    out = tmp_path / "ep"
    overrides = sft_overrides(
        model_dir,
        data,
        out,
        "batch_size=1",
        f"max_steps={STEPS}",
        f"parallelism.dp_shard={world_size // tp}",
        f"parallelism.ep={ep}",
        f"parallelism.tp={tp}",
    )
    launch_ranks(overrides, tmp_path, config=config, world_size=world_size, timeout=timeout)
    return out


def test_ep2_on_two_ranks_equals_one_process(world, tmp_path):
    root, model_dir, data = world
    single = _single(root, model_dir, data, accumulation=2)
    out = _expert_parallel(model_dir, data, tmp_path, world_size=2, timeout=240)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)


def test_ep2_with_dp4_on_four_ranks_equals_one_process(world, tmp_path):
    root, model_dir, data = world
    single = _single(root, model_dir, data, accumulation=4)
    out = _expert_parallel(model_dir, data, tmp_path, world_size=4, timeout=400)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


@pytest.mark.slow
def test_ep4_on_four_ranks_equals_one_process(world, tmp_path):
    """ep 4 on 4 ranks (dp_shard 4): 2 of the 8 experts per rank, no other holder."""
    root, model_dir, data = world
    single = _single(root, model_dir, data, accumulation=4)
    out = _expert_parallel(model_dir, data, tmp_path, world_size=4, timeout=400, ep=4)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


@pytest.mark.slow
def test_ep2_with_tp2_on_four_ranks_equals_one_process(world, tmp_path):
    """tp 2 x dp_shard 2 with ep 2: the MoE layers see the whole sequence on both tp ranks
    (replicated under TP) and split their experts over the two dp_shard ranks of the same tp
    coordinate; two data-parallel ranks, so two micro-batches in one process."""
    root, model_dir, data = world
    single = _single(root, model_dir, data, accumulation=2)
    out = _expert_parallel(model_dir, data, tmp_path, world_size=4, timeout=400, tp=2)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


def test_expert_mesh_pairs_ranks_of_one_tp_coordinate():
    """The ep groups of tp 2 x dp_shard 4 x ep 2 (ranks ``dp * 2 + tp``): each pairs two
    dp_shard neighbours with the same tp coordinate; ``expert_dp`` joins the pairs that hold
    the same experts. Computed by hand from the rank layout."""
    dims = ParallelDims.resolve({"dp_shard": 4, "tp": 2, "ep": 2}, world_size=8)
    assert expert_rank_layout(dims).tolist() == [
        [[0, 2], [4, 6]],  # tp 0: ep groups {0, 2} and {4, 6}
        [[1, 3], [5, 7]],  # tp 1
    ]
    dims = ParallelDims.resolve({"dp_replicate": 2, "dp_shard": 2, "cp": 2, "ep": 2}, 8)
    # ranks = ((replicate * 2 + shard) * 2 + cp): ep pairs the two shards of a (replicate, cp)
    assert expert_rank_layout(dims).tolist() == [[[0, 2], [1, 3], [4, 6], [5, 7]]]


def test_ep2_with_lora_on_attention_equals_one_process(world, tmp_path):
    """LoRA adapters (attention; the experts frozen, split over ep) train as in one process."""
    root, model_dir, data = world
    single = _single(root, model_dir, data, accumulation=2, config="tiny_lora")
    out = _expert_parallel(model_dir, data, tmp_path, world_size=2, timeout=240, config="tiny_lora")
    logged_1, logged_2 = read_metrics(single), read_metrics(out)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step in logged_1:
        assert logged_2[step]["loss"] == pytest.approx(logged_1[step]["loss"], rel=1e-5)
        assert logged_2[step]["grad_norm"] == pytest.approx(logged_1[step]["grad_norm"], rel=1e-5)
    adapters_1, adapters_2 = final_weights(single), final_weights(out)
    assert adapters_1 and adapters_1.keys() == adapters_2.keys()
    assert all("lora" in name for name in adapters_1)
    for name in adapters_1:
        torch.testing.assert_close(adapters_2[name], adapters_1[name], atol=1e-5, rtol=0)


def test_ep2_with_lora_on_the_experts_equals_one_process(world, tmp_path):
    """LoRA on the experts (and attention) under ep2 on 2 ranks == one process: the stacked
    adapters split with their experts, train on each rank's experts (gradients averaged like
    the experts'), and the saved PEFT folder gathers them into the one-process tensors."""
    root, model_dir, data = world
    common = ("batch_size=1", f"max_steps={STEPS}",
              "model.target_modules=[q_proj,v_proj,gate_proj,up_proj,down_proj]")  # fmt: skip
    single = run_sft(
        model_dir,
        data,
        tmp_path / "single",
        *common,
        "gradient_accumulation_steps=2",
        config="tiny_lora",
    )
    out = tmp_path / "ep"
    overrides = sft_overrides(
        model_dir, data, out, *common, "parallelism.dp_shard=2", "parallelism.ep=2"
    )
    launch_ranks(overrides, tmp_path, config="tiny_lora", world_size=2, timeout=240)
    logged_1, logged_2 = read_metrics(single), read_metrics(out)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step in logged_1:
        assert logged_2[step]["loss"] == pytest.approx(logged_1[step]["loss"], rel=1e-5)
        assert logged_2[step]["grad_norm"] == pytest.approx(logged_1[step]["grad_norm"], rel=1e-5)
    adapters_1, adapters_2 = final_weights(single), final_weights(out)
    assert adapters_1.keys() == adapters_2.keys()
    experts = [name for name in adapters_1 if ".experts." in name]
    assert experts and any(".self_attn." in name for name in adapters_1)
    # the expert adapters trained (lora_B left zero) and have every expert: [E * r, in]
    assert all(adapters_1[n].abs().max() > 0 for n in experts if "lora_B" in n)
    for name in adapters_1:
        torch.testing.assert_close(
            adapters_2[name], adapters_1[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_ep2_stopped_and_resumed_equals_uninterrupted(world, tmp_path):
    """ep2 on 2 ranks stopped with a checkpoint at step 2 and resumed to step 4 ends with the
    uninterrupted run's weights and logs its losses: the experts' DTensor weights and their
    AdamW moments (sharded over ep) round-trip through the checkpoint."""
    root, model_dir, data = world
    steps, stop = 4, 2

    def launch(out, *extra):
        overrides = sft_overrides(
            model_dir,
            data,
            out,
            "batch_size=1",
            f"max_steps={steps}",
            "parallelism.dp_shard=2",
            "parallelism.ep=2",
            *extra,
        )
        logs = out.parent / f"{out.name}-logs"
        logs.mkdir(exist_ok=True)
        launch_ranks(overrides, logs, world_size=2, timeout=240)

    reference, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    launch(reference)
    launch(resumed, f"stop_after_steps={stop}")
    assert [p.name for p in checkpoints(resumed)] == [f"step_{stop:06d}"]
    launch(resumed, "resume=true")
    assert checkpoints(resumed)[-1].name == f"step_{steps:06d}"

    logged, logged_ref = read_metrics(resumed), read_metrics(reference)
    assert sorted(logged) == sorted(logged_ref) == list(range(1, steps + 1))
    for step in range(stop + 1, steps + 1):
        for key in ("loss", "grad_norm", "trained_tokens_in_window"):
            assert logged[step][key] == pytest.approx(logged_ref[step][key], rel=1e-6), (
                f"{key} at step {step}"
            )
    weights, expected = final_weights(resumed), final_weights(reference)
    assert weights.keys() == expected.keys()
    assert any(".experts." in name for name in weights)
    for name in weights:
        torch.testing.assert_close(
            weights[name], expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    at_stop = checkpoint_weights(checkpoints(resumed)[0])
    assert max((expected[k] - at_stop[k]).abs().max().item() for k in at_stop) > 1e-4
