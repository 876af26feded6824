"""KTOLoss == the KTO paper's loss (Ethayarajh et al. 2024, Eq. 7-8) written out below on
hand-built log-probs, with its edge cases: one label only, the KL estimate clamped at 0,
weights, and zero-length completions refused."""

from __future__ import annotations

import math

import pytest
import torch

from tunesmith.modules.losses import KTOLoss, UnpairedLogps


def _paper(pi, ref, desirable, kl, beta, w_d, w_u):
    """Per completion, in plain Python floats: v = w_D·σ(β(r - z)) or w_U·σ(β(z - r)), with
    z = max(0, KL); the loss is w - v (the paper's λ_y - v), i.e. w·(1 - σ(...))."""

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    z = max(0.0, kl)
    out = []
    for p, r, d in zip(pi, ref, desirable, strict=True):
        ratio = p - r
        if d:
            out.append(w_d - w_d * sigmoid(beta * (ratio - z)))
        else:
            out.append(w_u - w_u * sigmoid(beta * (z - ratio)))
    return out


PI = [-4.0, -9.5, -2.25, -7.0, -3.0]
REF = [-5.0, -9.0, -3.0, -6.0, -3.5]
TOKENS = [2, 3, 1, 4, 2]
CASES = {  # id -> (labels, kl, beta, desirable_weight, undesirable_weight)
    "mixed": ([True, False, True, False, False], 0.3, 0.1, 1.0, 1.0),
    "weighted": ([True, False, True, False, False], 0.7, 0.5, 1.33, 0.8),
    "all-desirable": ([True] * 5, 0.2, 1.0, 1.0, 1.0),
    "all-undesirable": ([False] * 5, 0.2, 1.0, 1.0, 2.0),
    "negative-kl-clamped": ([True, False, True, False, True], -0.9, 2.0, 1.0, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_losses_and_rewards_equal_the_paper(case):
    labels, kl, beta, w_d, w_u = CASES[case]
    loss = KTOLoss(beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    policy = torch.tensor(PI, dtype=torch.float64, requires_grad=True)
    rows = UnpairedLogps(policy, torch.tensor(TOKENS), torch.tensor(labels))
    out = loss(rows, torch.tensor(REF, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64))
    expected = _paper(PI, REF, labels, kl, beta, w_d, w_u)
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-12)
    assert out.rewards.tolist() == pytest.approx([beta * (p - r) for p, r in zip(PI, REF)])
    assert out.kl.item() == max(0.0, kl)
    assert not out.rewards.requires_grad and not out.kl.requires_grad
    out.losses.sum().backward()  # the gradient flows to the policy only, never through z
    assert policy.grad.abs().min() > 0


def test_kl_is_detached():
    kl = torch.tensor(0.4, requires_grad=True)
    rows = UnpairedLogps(torch.tensor([-1.0], requires_grad=True), torch.tensor([1]),
                         torch.tensor([True]))  # fmt: skip
    KTOLoss()(rows, torch.tensor([-1.5]), kl).losses.sum().backward()
    assert kl.grad is None


def test_zero_length_completion_is_refused():
    rows = UnpairedLogps(
        torch.tensor([-1.0, 0.0]), torch.tensor([3, 0]), torch.tensor([True, False])
    )
    with pytest.raises(ValueError, match=r"completions \[1\] of the batch have no trained token"):
        KTOLoss()(rows, torch.tensor([-1.0, 0.0]), torch.tensor(0.0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, "beta must be > 0"),
        ({"desirable_weight": 0.0}, "desirable_weight must be > 0"),
        ({"undesirable_weight": -1.0}, "undesirable_weight must be > 0"),
    ],
)
def test_bad_settings_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KTOLoss(**kwargs)


def test_shapes_must_agree():
    rows = UnpairedLogps(torch.tensor([-1.0, -2.0]), torch.tensor([1, 1]), torch.tensor([True]))
    with pytest.raises(ValueError, match=r"desirable has shape \[1\], expected \[2\]"):
        KTOLoss()(rows, torch.tensor([-1.0, -2.0]), torch.tensor(0.0))
