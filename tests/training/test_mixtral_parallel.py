"""Mixtral under FSDP2 (dp_shard 2), expert parallel (ep 2 x dp_shard 2) and tensor parallel
(tp 2) on two gloo ranks == one process, 5 optimizer steps each through the Trainer with the
SFT objective (cross-entropy plus the load-balancing loss, its coefficient raised so it weighs):
the logged losses, grad norms and router statistics, and the final weights.

One two-rank run does all three layouts in turn. The one-process reference takes the step's
data-parallel shares as micro-batches (two for dp_shard 2 and ep 2; one for tp 2, whose two
ranks see the same rows). Marked slow, one four-rank run: ep 2 within dp_shard 4 (two holders
of each expert) and ep 2 within tp 2 x dp_shard 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tests.models.conftest import randomize_
from tests.training.test_trainer import CTX, config
from tunesmith.models import build_model, mixtral
from tunesmith.modules.losses import CrossEntropyLoss
from tunesmith.training.objectives.token import TokenCrossEntropy
from tunesmith.training.parallel.distributed import full_tensor, init_distributed
from tunesmith.training.parallelize import parallelize
from tunesmith.training.trainer import Trainer

STEPS = 5
LAYOUTS = {  # name -> (parallelism, world size, data-parallel ranks)
    "dp_shard2": ({"dp_shard": 2}, 2, 2),
    "ep2": ({"dp_shard": 2, "ep": 2}, 2, 2),
    "tp2": ({"tp": 2, "dp_shard": 1}, 2, 1),
    # four ranks (slow): two holders of each expert; ep inside tp 2 x dp_shard 2
    "ep2_dp_shard4": ({"dp_shard": 4, "ep": 2}, 4, 4),
    "ep2_tp2_dp_shard2": ({"tp": 2, "dp_shard": 2, "ep": 2}, 4, 2),
}


def _model() -> torch.nn.Module:
    """mixtral_tiny with 6 experts (ep 2 divides them), top-3, window 8 < the 12-token rows."""
    spec = mixtral.spec("mixtral_tiny", num_experts=6, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    return randomize_(build_model(spec), seed=1)


def _batches(step: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """The step's rows, one micro-batch per data-parallel rank (a padded row, some labels
    ignored)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(dp):
        ids = torch.randint(3, 256, (2, 12), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[0, :4] = -100
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "position_ids": positions})  # fmt: skip
    return out


def _train(model, ctx, out: Path, dp: int, rank: int) -> list[dict[str, float]]:
    trainer = Trainer.from_config(config(out, max_steps=STEPS), ctx, model=model,
                                  objective=TokenCrossEntropy(CrossEntropyLoss()), source=None)  # fmt: skip
    logged = []
    for step in range(STEPS):
        batches = _batches(step, dp)
        logged.append(trainer.step(batches if ctx.world_size == 1 else [batches[rank % dp]]))
    return logged


def _worker(rank: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        dims, _, dp = LAYOUTS[name]
        ctx = init_distributed("cpu", parallelism=dims)
        with tempfile.TemporaryDirectory() as out:
            model = parallelize(_model(), ctx)
            logged = _train(model, ctx, Path(out), dp, ctx.dims.dp_rank(rank))
        weights = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
        results[name] = {"logged": logged, "weights": weights if rank == 0 else {}}
    return results


def _runs(world: int, tmp_path_factory) -> tuple[list[dict], dict[int, dict]]:
    """Every layout of ``world`` ranks in one run, and the one-process runs they equal."""
    names = [name for name, (_, size, _) in LAYOUTS.items() if size == world]
    ranks = run_on_ranks(_worker, world, names, timeout_s=300)
    single = {}
    for dp in sorted({LAYOUTS[name][2] for name in names}):
        model = _model()
        logged = _train(model, CTX, tmp_path_factory.mktemp(f"single{dp}"), dp, 0)
        single[dp] = {"logged": logged, "weights": dict(model.named_parameters())}
    return ranks, single


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _runs(2, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _runs(4, tmp_path_factory)


@pytest.mark.parametrize("layout", [name for name, (_, size, _) in LAYOUTS.items() if size == 2])
def test_layout_on_two_ranks_equals_one_process(two_ranks, layout):
    _check(two_ranks, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, (_, size, _) in LAYOUTS.items() if size == 4])
def test_layout_on_four_ranks_equals_one_process(four_ranks, layout):
    _check(four_ranks, layout)


def _check(runs: tuple[list[dict], dict[int, dict]], layout: str) -> None:
    ranks, single = runs
    want = single[LAYOUTS[layout][2]]
    for rank in ranks:
        for got, expected in zip(rank[layout]["logged"], want["logged"], strict=True):
            for key in ("loss", "grad_norm", "trained_tokens", "moe_load_max", "moe_load_cv"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5), key
            assert got["moe_dropped_tokens"] == expected["moe_dropped_tokens"] == 0
    weights = ranks[0][layout]["weights"]
    assert weights.keys() == want["weights"].keys()
    initial = dict(_model().named_parameters())
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, want["weights"][name].detach(), atol=1e-5, rtol=0,
                                   msg=lambda m, n=name: f"{layout} {n}: {m}")  # fmt: skip
    moved = max((want["weights"][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3  # the steps trained
