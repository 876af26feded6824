"""Gradient accumulation: batch B with K accumulation steps == one batch of B*K, through the
recipe (same logged losses and gradient norms, same weights after N steps).

The micro-batches train different numbers of tokens (checked below), so a per-micro-batch mean
(mean of means) would give a different update than the recipe's token mean over the whole step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.recipes.sft_world import (
    checkpoint_weights,
    final_weights,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.modules.losses import IGNORE_INDEX

MICRO, ACCUM, STEPS, ROWS, SEED = 2, 3, 4, 24, 0
ULPS = 4
"""Weights may differ by this many float32 ulps of their value (beyond ``atol``)."""

SGD = ["optimizer._component_=torch.optim.SGD", "~optimizer.weight_decay", "optimizer.lr=0.5"]
ADAMW: list[str] = []  # the shipped config's optimizer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("accum")
    return make_model_dir(root), make_counting_data(root / "count.jsonl", rows=ROWS)


def _trained_tokens_per_micro_batch(model_dir, data) -> list[list[int]]:
    """The trained-token count of each micro-batch of each step, in the recipe's sample order
    (DistributedSampler over one rank, shuffled with the run's seed, epoch 0)."""
    dataset = SFTDataset(Tokenizer.from_pretrained(model_dir), source=str(data))
    order = list(DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED, drop_last=True))
    counts = [sum(t != IGNORE_INDEX for t in dataset[i]["labels"]) for i in order]
    micro = [sum(counts[i : i + MICRO]) for i in range(0, len(counts), MICRO)]
    return [micro[s * ACCUM : (s + 1) * ACCUM] for s in range(STEPS)]


def test_micro_batches_train_different_numbers_of_tokens(world):
    # What makes the equivalence below a real test of token normalisation.
    for step, counts in enumerate(_trained_tokens_per_micro_batch(*world), start=1):
        assert len(set(counts)) > 1, f"step {step}: micro-batches all train {counts[0]} tokens"


@pytest.mark.parametrize(
    ("optimizer", "atol"),
    [pytest.param(SGD, 1e-7, id="sgd"), pytest.param(ADAMW, 1e-6, id="adamw")],
)
def test_accumulated_micro_batches_equal_one_big_batch(world, tmp_path, optimizer, atol):
    model_dir, data = world
    common = [f"max_steps={STEPS}", f"seed={SEED}", *optimizer]
    accumulated = run_sft(
        model_dir,
        data,
        tmp_path / "accum",
        f"batch_size={MICRO}",
        f"gradient_accumulation_steps={ACCUM}",
        *common,
    )
    big = run_sft(model_dir, data, tmp_path / "big", f"batch_size={MICRO * ACCUM}", *common)

    logged_a, logged_b = read_metrics(accumulated), read_metrics(big)
    assert sorted(logged_a) == sorted(logged_b) == list(range(1, STEPS + 1))
    expected_tokens = [sum(c) for c in _trained_tokens_per_micro_batch(model_dir, data)]
    for step in logged_a:
        a, b = logged_a[step], logged_b[step]
        tokens = a["trained_tokens_in_window"]
        assert tokens == b["trained_tokens_in_window"] == expected_tokens[step - 1]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), f"loss at step {step}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), f"grad at step {step}"

    weights_a, weights_b = final_weights(accumulated), final_weights(big)
    assert weights_a.keys() == weights_b.keys()
    # Other summation orders of the same sums: ``atol`` (below the update of any weight), plus
    # a few float32 ulps of the weight itself, which an absolute tolerance alone cannot give a
    # norm weight near 1 (its ulp, 1.2e-7, is above the SGD ``atol``; one ulp off there on
    # some CPUs).
    ulps = ULPS * torch.finfo(torch.float32).eps
    for name in weights_a:
        # Under Adam the key biases' low-frequency RoPE components, whose gradient is almost
        # exactly zero (a shift of every key a query sees leaves its softmax unchanged), get
        # rounding noise normalised into an update: 1e-5 there, ``atol`` everywhere else.
        tol = 1e-5 if optimizer is ADAMW and name.endswith("k_proj.bias") else atol
        torch.testing.assert_close(weights_a[name], weights_b[name], atol=tol, rtol=ulps, msg=name)
    initial = checkpoint_weights(model_dir)  # training moved the weights well beyond ``atol``
    assert max((weights_a[k] - initial[k]).abs().max().item() for k in initial) > 1e-3
