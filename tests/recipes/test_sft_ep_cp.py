"""Context parallel on a mixture-of-experts model, alone and with expert parallel, trains like
one process (tiny Qwen3-MoE, load-balancing coefficient 0.1 so the aux loss weighs).

Under context parallel each rank holds a share of every row, so its router sees only those
tokens; the load-balancing loss is a product of two means over the *whole* rows, so each
rank's token sums are added over the cp group first (``load_balancing_loss(reduce=...)``,
a differentiable sum): without that the logged loss differs from one process's by ~1e-4
relative, which these tests see. Runs compared with ``assert_same_as_single`` (loss and grad
norm rel 1e-5, token counts exact, weights after 3 steps atol 1e-5):

- cp 2 on 2 ranks, two right-padded rows per step (padding inside the rows and the split's
  own padding to a multiple of 4, both outside the aux loss by the attention mask);
- dp_shard 2 x cp 2 with ep 2 on 4 ranks: each ep pair is the two dp_shard ranks of one cp
  coordinate, every expert has a second holder (the other cp coordinate), batch 1 per rank as
  two micro-batches of one in the single process.
"""

from __future__ import annotations

import pytest
import torch

from tests.recipes.sft_world import (
    assert_same_as_single,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    run_sft,
    sft_overrides,
)
from tunesmith.models.zoo import qwen3_moe
from tunesmith.modules.moe import load_balancing_loss
from tunesmith.training.parallel.distributed import ParallelDims, expert_rank_layout

STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_cp")
    model_dir = make_model_dir(root, family=qwen3_moe, router_aux_loss_coef=0.1)
    data = make_counting_data(root / "count.jsonl", rows=24)
    return root, model_dir, data


def _run(model_dir, data, tmp_path, world_size: int, *parallelism: str, batch: int = 1):
    out = tmp_path / "parallel"
    overrides = sft_overrides(
        model_dir, data, out, f"batch_size={batch}", f"max_steps={STEPS}", *parallelism
    )
    launch_ranks(overrides, tmp_path, world_size=world_size, timeout=300)
    return out


def test_moe_cp2_on_two_ranks_equals_one_process(world, tmp_path):
    root, model_dir, data = world
    single = run_sft(model_dir, data, tmp_path / "single", "batch_size=2", f"max_steps={STEPS}")
    out = _run(model_dir, data, tmp_path, 2, "parallelism.cp=2", "parallelism.dp_shard=1", batch=2)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)


def test_ep2_with_cp2_and_dp_shard2_on_four_ranks_equals_one_process(world, tmp_path):
    root, model_dir, data = world
    single = run_sft(
        model_dir,
        data,
        tmp_path / "single",
        "batch_size=1",
        "gradient_accumulation_steps=2",
        f"max_steps={STEPS}",
    )
    out = _run(
        model_dir,
        data,
        tmp_path,
        4,
        "parallelism.dp_shard=2",
        "parallelism.cp=2",
        "parallelism.ep=2",
    )
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


def test_ep_groups_under_cp_pair_dp_shard_ranks_of_one_cp_coordinate():
    """Ranks are ``dp_shard * 2 + cp`` (cp inner): ep pairs {0, 2} (cp 0) and {1, 3} (cp 1);
    the two pairs hold the same experts (``expert_dp``)."""
    dims = ParallelDims.resolve({"dp_shard": 2, "cp": 2, "ep": 2}, world_size=4)
    assert expert_rank_layout(dims).tolist() == [[[0, 2], [1, 3]]]


def test_load_balancing_loss_of_split_rows_with_summed_statistics_equals_the_whole():
    """Rows cut in two shares (as context parallel cuts them), each share's statistics summed
    with the other's by ``reduce``: the loss and its gradient are the whole rows'."""
    torch.manual_seed(0)
    layers = [torch.randn(2 * 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    whole = load_balancing_loss(layers, top_k=2, attention_mask=mask)
    (expected,) = torch.autograd.grad(whole, layers[0])

    def share(cols: slice) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [x.view(2, 6, 8)[:, cols].reshape(-1, 8) for x in layers], mask[:, cols]

    first, second = share(slice(0, 3)), share(slice(3, 6))
    kept: list[torch.Tensor] = []
    load_balancing_loss(first[0], 2, first[1], lambda sums: kept.append(sums) or sums)
    other = kept[0].detach()
    split = load_balancing_loss(second[0], 2, second[1], lambda sums: sums + other)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=0)
    alone = load_balancing_loss(second[0], 2, second[1])  # without the sum: another value
    assert abs(alone.item() - whole.item()) > 1e-3
    # the gradient through the second share's rows is the whole loss's on those rows
    (got,) = torch.autograd.grad(split, layers[0])
    rows = torch.zeros(2, 6, dtype=torch.bool)
    rows[:, 3:] = True
    torch.testing.assert_close(got[rows.reshape(-1)], expected[rows.reshape(-1)])
