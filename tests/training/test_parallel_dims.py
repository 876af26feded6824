"""The ``parallelism`` section: sizes resolved against the world, refused with the numbers
before any process group or weight, and the data-parallel bookkeeping (rank, size, the
sampler's share) that the loop, evaluation and DPO's precompute use."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tunesmith.config import ConfigError
from tunesmith.training.loop import LOOP_KEYS, make_loader
from tunesmith.training.parallel.distributed import (
    DistributedContext,
    ParallelDims,
    close_distributed,
    init_distributed,
)
from tunesmith.training.parallelize import check_model_fits
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import LOOP_RULES, RESUMABLE_KEYS


def test_default_is_every_rank_data_parallel_shard():
    for section in (None, {}, {"dp_shard": -1}, {"dp_shard": "auto"}):
        dims = ParallelDims.resolve(section, world_size=4)
        assert dims == ParallelDims(dp_shard=4)
        assert dims.mesh_shape() == ((4,), ("dp_shard",))
        assert (dims.dp, dims.dp_cp) == (4, 4)
    assert ParallelDims.resolve(None, 1).mesh_shape() == ((1,), ("dp_shard",))


def test_hsdp_sizes_and_mesh():
    dims = ParallelDims.resolve({"dp_replicate": 2, "dp_shard": 2}, world_size=4)
    assert dims == ParallelDims.resolve({"dp_replicate": 2}, world_size=4)  # auto: 4 / 2
    assert dims.mesh_shape() == ((2, 2), ("dp_replicate", "dp_shard"))
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    only_replicas = ParallelDims.resolve({"dp_replicate": 2, "dp_shard": 1}, world_size=2)
    assert only_replicas.mesh_shape() == ((2, 1), ("dp_replicate", "dp_shard"))


def test_dp_rank_and_size_skip_the_tp_and_cp_neighbours():
    """Mesh order (dp_replicate, dp_shard, cp, tp): tp ranks are adjacent, then cp; all of a
    data-parallel rank's cp x tp ranks see the same samples (bookkeeping only: tp/cp > 1 are
    refused until #15/#16)."""
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert dims.world_size == 16 and dims.dp == 4 and dims.dp_cp == 8
    assert [dims.dp_rank(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert [dims.dp_cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.mesh_shape() == ((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp"))
    ctx = DistributedContext(5, 16, 5, torch.device("cpu"), None, dims=dims)
    # FSDP2 shards over dp_shard x cp (context parallel, #16); rank 5 is cp rank 0 of its pair
    assert (ctx.dp_rank, ctx.dp_size, ctx.dp_cp_size, ctx.shard_size) == (1, 4, 8, 4)
    assert [
        DistributedContext(r, 16, r, torch.device("cpu"), None, dims=dims).cp_rank for r in range(8)
    ] == [0, 0, 1, 1, 0, 0, 1, 1]
    plain = DistributedContext(1, 2, 1, torch.device("cpu"), None)  # no dims: world = dp
    assert (plain.dp_rank, plain.dp_size, plain.dp_cp_size, plain.shard_size) == (1, 2, 2, 2)


def test_sampler_takes_the_dp_rank_and_size():
    ctx = DistributedContext(3, 4, 3, torch.device("cpu"), None, dims=ParallelDims(2, tp=2))
    _, sampler = make_loader(
        list(range(16)), lambda items: items, ctx, batch_size=2, shuffle=False, seed=0
    )
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert list(sampler) == list(range(1, 16, 2))


@pytest.mark.parametrize(
    ("section", "world", "words"),
    [
        (
            {"dp_replicate": 2, "dp_shard": 3},
            4,
            ["dp_replicate 2 x dp_shard 3 x cp 1 x tp 1 = 6 rank(s), but the world has 4"],
        ),
        ({"dp_shard": 2}, 1, ["dp_shard 2", "= 2 rank(s), but the world has 1"]),
        (
            {"dp_replicate": 3},
            4,
            ["dp_replicate 3 x cp 1 x tp 1 = 3 does not divide the world of 4 rank(s)"],
        ),
        (
            {"tp": 2, "sequence_parallel": "yes"},
            2,
            ["sequence_parallel: expected true or false", "'yes'"],
        ),
        ({"ep": 3, "dp_shard": 4}, 4, ["ep 3 does not divide dp_shard 4"]),
        ({"dp_shard": 0}, 1, ["dp_shard: expected an int >= 1", "got 0"]),
        ({"tp": "2"}, 1, ["tp: expected an int >= 1, got '2' (a string)"]),
        ({"dp": 2}, 1, ["unknown key 'dp'"]),
    ],
)
def test_bad_sizes_are_refused_naming_the_numbers(section, world, words):
    with pytest.raises(ConfigError) as error:
        ParallelDims.resolve(section, world)
    assert str(error.value).startswith("parallelism: ")
    for word in words:
        assert word in str(error.value)


def test_refused_before_the_process_group_starts():
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="= 2 rank.s., but the world has 1"):
        init_distributed("cpu", parallelism={"dp_replicate": 2, "dp_shard": 1})
    assert not dist.is_initialized()
    ctx = init_distributed("cpu", parallelism={"dp_shard": "auto"})
    try:
        assert ctx.mesh.mesh_dim_names == ("dp_shard",) and ctx.fsdp_mesh is ctx.mesh
        assert ctx.dp_group is None and ctx.dp_cp_group is None  # the default group
    finally:
        close_distributed()


def test_config_key_is_checked_up_front_and_fixed_on_resume():
    assert "parallelism" in LOOP_KEYS and "parallelism" not in RESUMABLE_KEYS
    good = OmegaConf.create({"parallelism": {"dp_replicate": 2, "dp_shard": -1}})
    assert check_rules(good, {"parallelism": LOOP_RULES["parallelism"]}) == []
    bad = OmegaConf.create({"parallelism": {"dp_shard": 1.5}})
    [issue] = check_rules(bad, {"parallelism": LOOP_RULES["parallelism"]})
    assert str(issue) == (
        "parallelism: dp_shard: expected an int >= 1 (or -1 / 'auto': what is left of the "
        "world), got 1.5"
    )


class _Spec:
    num_attention_heads, num_key_value_heads, num_experts = 16, 4, 6


def test_model_that_cannot_take_the_sizes_is_refused():
    check_model_fits(_Spec(), ParallelDims(tp=4, ep=2))
    with pytest.raises(ConfigError) as error:
        check_model_fits(_Spec(), ParallelDims(tp=8, ep=4))
    assert str(error.value).splitlines() == [
        "parallelism: tp 8 does not divide num_key_value_heads 4 of the model",
        "parallelism: ep 4 does not divide num_experts 6 of the model",
    ]
    check_model_fits(None, ParallelDims(tp=3))  # no spec: nothing to check
