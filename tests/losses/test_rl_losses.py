"""RL losses against their formulas: the PPO-clip gradient on-policy equals the plain policy
gradient under every aggregation; clipping (DAPO's asymmetric range, dual clip) worked out
token by token; each aggregation's sum and unit count by hand, padding and post-stop tokens
ignored even when they hold inf; GSPO's token form equals autograd through
``exp(mean(lp - old))``; the KL estimators by hand and in expectation; the clipped value loss
by hand; the chunked entropy equals the full softmax's."""

from __future__ import annotations

import math

import pytest
import torch

from tunesmith.config import instantiate
from tunesmith.modules.losses import (
    AGGREGATIONS,
    KLPenalty,
    PolicyLoss,
    ValueLoss,
    aggregate,
    kl_penalty,
    token_entropy,
    units,
    value_loss,
)

INF = float("inf")

# Three rows: 3 trained tokens then a stop-masked token; 1 token then padding; all padding.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
VALUES = torch.tensor([[1.0, 2.0, 3.0, INF], [4.0, -INF, 7.0, 7.0], [INF, 1.0, 1.0, 1.0]])


def _kwargs(mode: str) -> dict:
    return {"max_tokens": 4} if mode == "constant" else {}


# -- aggregation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected_sum", "expected_units"),
    [
        ("token_mean", 1 + 2 + 3 + 4, 4),  # 4 trained tokens
        ("seq_mean_token_sum", 1 + 2 + 3 + 4, 2),  # 2 non-empty sequences
        ("seq_mean_token_mean", (1 + 2 + 3) / 3 + 4 / 1, 2),
        ("constant", 1 + 2 + 3 + 4, 2 * 4),  # sequences x max_tokens
    ],
)
def test_aggregate_and_units_by_hand(mode, expected_sum, expected_units):
    total = aggregate(VALUES, MASK, mode, **_kwargs(mode))
    assert total.item() == pytest.approx(expected_sum)
    assert units(MASK, mode, **_kwargs(mode)) == expected_units


def test_aggregation_errors_name_the_problem():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="needs max_tokens"):
        units(MASK, "constant")
    with pytest.raises(ValueError, match="row 0 has 3 trained tokens, more than max_tokens=2"):
        units(MASK, "constant", max_tokens=2)
    with pytest.raises(ValueError, match="must both be"):
        aggregate(VALUES, MASK[:, :3], "token_mean")


# -- policy loss: on-policy gradient == plain policy gradient ----------------------------------


def _tiny_policy(seed: int = 0):
    """A linear 'model' over 5 tokens: logprobs of sampled tokens, differentiable in W."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 5, (3, 6), generator=g)
    weight = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def logprobs():
        return torch.log_softmax(features @ weight, -1).gather(-1, tokens[..., None])[..., 0]

    return weight, logprobs


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_on_policy_gradient_is_the_plain_policy_gradient(mode, per_token_advantages):
    weight, logprobs = _tiny_policy()
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    if per_token_advantages:
        adv = torch.linspace(-1, 1, 18, dtype=torch.float64).reshape(3, 6)
    max_tokens = 8 if mode == "constant" else None
    loss_fn = PolicyLoss(clip_low=0.2, clip_high=0.28, aggregation=mode, max_tokens=max_tokens)
    lp = logprobs()
    out = loss_fn(lp, lp.detach(), adv, mask)
    (out.loss / loss_fn.units(mask)).backward()
    grad, weight.grad = weight.grad.clone(), None
    assert out.metrics["clip_fraction"].item() == 0
    assert out.metrics["approx_kl"].item() == 0
    assert out.metrics["ratio"].item() / loss_fn.units(mask) == pytest.approx(1.0)

    # the textbook objective, written out: -A * logprob, averaged as the mode says
    a = adv if per_token_advantages else adv[:, None].expand(3, 6)
    per_token = -(a * logprobs()) * mask
    if mode == "token_mean":
        reference = per_token.sum() / 13  # 6 + 3 + 4 trained tokens
    elif mode == "seq_mean_token_sum":
        reference = per_token.sum() / 3
    elif mode == "seq_mean_token_mean":
        reference = (per_token.sum(-1) / torch.tensor([6, 3, 4])).mean()
    else:  # Dr. GRPO: 3 sequences x max_tokens
        reference = per_token.sum() / (3 * 8)
    reference.backward()
    assert grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, weight.grad, rtol=1e-12, atol=1e-12)


# -- policy loss: clipping by hand -------------------------------------------------------------

# (advantage, ratio, loss, d loss / d logprob, clipped low, clipped high), clip 0.2 / 0.28.
# Unclipped: loss -r*A, gradient -r*A. Clipped: the bound times A, no gradient.
CLIP_CASES = [
    (+1.0, 1.5, -1.28, 0.0, False, True),  # A > 0 above 1 + 0.28: cut
    (+1.0, 1.25, -1.25, -1.25, False, False),  # above 1 + clip_low but below 1 + clip_high
    (+1.0, 1.1, -1.1, -1.1, False, False),
    (+1.0, 0.5, -0.5, -0.5, False, False),  # A > 0 below 1 - 0.2: never clipped
    (-1.0, 0.5, 0.8, 0.0, True, False),  # A < 0 below 1 - 0.2: cut
    (-1.0, 1.5, 1.5, 1.5, False, False),  # A < 0 above the range: never clipped (no dual)
    (-2.0, 0.9, 1.8, 1.8, False, False),
]


def _clip_inputs(cases):
    adv = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    ratio = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    lp = torch.zeros(len(cases), 1, dtype=torch.float64, requires_grad=True)
    old = -ratio.log()[:, None]  # exp(0 - old) = ratio
    return lp, old, adv, torch.ones(len(cases), 1, dtype=torch.bool)


def test_clipping_token_by_token():
    lp, old, adv, mask = _clip_inputs(CLIP_CASES)
    out = PolicyLoss(clip_low=0.2, clip_high=0.28)(lp, old, adv, mask)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(sum(c[2] for c in CLIP_CASES))
    torch.testing.assert_close(
        lp.grad[:, 0], torch.tensor([c[3] for c in CLIP_CASES], dtype=torch.float64)
    )
    low, high = sum(c[4] for c in CLIP_CASES), sum(c[5] for c in CLIP_CASES)
    assert out.metrics["clip_low_fraction"].item() == low == 1
    assert out.metrics["clip_high_fraction"].item() == high == 1
    assert out.metrics["clip_fraction"].item() == low + high
    ratios = [c[1] for c in CLIP_CASES]
    assert out.metrics["ratio"].item() == pytest.approx(sum(ratios))
    k3 = sum(r - 1 - math.log(r) for r in ratios)  # KL(old || new) estimate, samples of old
    assert out.metrics["approx_kl"].item() == pytest.approx(k3)
    assert "dual_clip_fraction" not in out.metrics


def test_symmetric_clip_when_clip_high_is_unset():
    lp, old, adv, mask = _clip_inputs([(+1.0, 1.25, None, None, None, None)])
    out = PolicyLoss(clip_low=0.2)(lp, old, adv, mask)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.2)
    assert lp.grad.item() == 0.0
    assert out.metrics["clip_high_fraction"].item() == 1


def test_dual_clip_caps_negative_advantages():
    # (A, r): capped at -3*A when r > 3 with A < 0; positive A untouched
    cases = [(-1.0, 5.0), (-1.0, 2.0), (+1.0, 5.0), (-0.5, 0.5)]
    lp, old, adv, mask = _clip_inputs([(a, r, 0, 0, 0, 0) for a, r in cases])
    out = PolicyLoss(clip_low=0.2, dual_clip=3.0)(lp, old, adv, mask)
    out.loss.backward()
    # 3 (capped, no gradient), 2 (gradient 2), -1.2 (clipped high), 0.5 * 0.8 (clipped low)
    assert out.loss.item() == pytest.approx(3.0 + 2.0 - 1.2 + 0.4)
    torch.testing.assert_close(
        lp.grad[:, 0], torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    )
    assert out.metrics["dual_clip_fraction"].item() == 1
    assert out.metrics["clip_fraction"].item() == 2


def test_importance_weights_scale_each_token_and_get_no_gradient():
    lp, old, adv, mask = _clip_inputs(CLIP_CASES)
    weights = torch.linspace(0.5, 1.5, len(CLIP_CASES), dtype=torch.float64)[:, None]
    weights.requires_grad_(True)
    out = PolicyLoss(clip_low=0.2, clip_high=0.28)(lp, old, adv, mask, weights=weights)
    out.loss.backward()
    w = weights.detach()[:, 0]
    expected = sum(wi * c[2] for wi, c in zip(w.tolist(), CLIP_CASES))
    assert out.loss.item() == pytest.approx(expected)
    torch.testing.assert_close(
        lp.grad[:, 0], w * torch.tensor([c[3] for c in CLIP_CASES], dtype=torch.float64)
    )
    assert weights.grad is None


# -- policy loss: aggregation, padding, metrics ------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_policy_loss_sums_as_its_aggregation_says_and_ignores_padding(mode):
    # on-policy (r = 1) with per-token advantages -VALUES: each token's loss is its VALUE;
    # padding holds inf log-probs and advantages, which must reach neither loss nor gradient
    lp = torch.where(MASK, torch.tensor(-1.0), torch.tensor(-INF)).requires_grad_(True)
    old = torch.where(MASK, torch.tensor(-1.0), torch.tensor(INF))
    loss_fn = PolicyLoss(aggregation=mode, **_kwargs(mode))
    out = loss_fn(lp, old, -VALUES, MASK)
    assert out.loss.item() == pytest.approx(aggregate(VALUES, MASK, mode, **_kwargs(mode)).item())
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~MASK] == 0).all()
    # d loss_t / d lp_t = -A_t * r = VALUE_t, divided by the row's length under token-mean
    expected = torch.where(MASK, VALUES, torch.tensor(0.0))
    if mode == "seq_mean_token_mean":
        expected = expected / MASK.sum(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(lp.grad, expected)
    for value in out.metrics.values():
        assert torch.isfinite(value)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 2.0),  # 2 clipped tokens of 4 -> logged mean 2 / 4
        ("seq_mean_token_sum", 1 / 3 + 1),  # per-sequence fractions 1/3 and 1 -> mean 2/3
        ("seq_mean_token_mean", 1 / 3 + 1),
        ("constant", 4 * (1 / 3 + 1)),  # / (2 x 4) -> 2/3 again
    ],
)
def test_metrics_are_sums_over_the_unit(mode, expected):
    ratio = torch.tensor([[1.5, 1.0, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0], [1.5] * 4])
    lp = torch.zeros(3, 4, requires_grad=True)
    out = PolicyLoss(clip_low=0.2, aggregation=mode, **_kwargs(mode))(
        lp, -ratio.log(), torch.ones(3), MASK
    )
    assert out.metrics["clip_fraction"].item() == pytest.approx(expected)
    assert out.metrics["clip_fraction"].item() / units(MASK, mode, **_kwargs(mode)) == (
        pytest.approx(0.5 if mode == "token_mean" else 2 / 3)
    )


def test_policy_loss_refuses_bad_settings_and_shapes():
    with pytest.raises(ValueError, match="clip_low must be a number > 0"):
        PolicyLoss(clip_low=0)
    with pytest.raises(ValueError, match="ratio must be 'token' or 'sequence'"):
        PolicyLoss(ratio="seq")
    with pytest.raises(ValueError, match="dual_clip must be a number > 1"):
        PolicyLoss(dual_clip=1.0)
    with pytest.raises(ValueError, match="needs max_tokens"):
        PolicyLoss(aggregation="constant")
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[b\] or \[b, T\]"):
        PolicyLoss()(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyLoss()(lp, lp[:, :2], torch.zeros(2), torch.ones(2, 3))


def test_policy_loss_builds_from_a_config():
    loss = instantiate(
        {
            "_component_": "tunesmith.modules.losses.PolicyLoss",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "aggregation": "seq_mean_token_mean",
        }
    )
    assert (loss.clip_low, loss.clip_high, loss.aggregation) == (0.2, 0.28, "seq_mean_token_mean")


# -- GSPO ----------------------------------------------------------------------------------


def _gspo_inputs():
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor(
        [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]],
        dtype=torch.bool,
    )
    lp = -torch.rand(5, 5, generator=g, dtype=torch.float64) * 3
    noise = torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.01
    noise = noise * mask
    # each row's mean log-ratio set on purpose; clip range 3e-4 / 4e-4:
    # row 0 inside, row 1 above (A > 0: cut), row 2 below (A > 0: kept), row 3 above (A < 0:
    # kept), row 4 below (A < 0: cut)
    target = torch.tensor([1e-4, 2e-3, -2e-3, 2e-3, -2e-3], dtype=torch.float64)
    lengths = mask.sum(-1)
    noise = noise - (noise.sum(-1) / lengths - target)[:, None] * mask
    old = torch.where(mask, lp - noise, torch.tensor(INF, dtype=torch.float64))
    adv = torch.tensor([1.0, 1.0, 0.5, -1.0, -2.0], dtype=torch.float64)
    return lp.requires_grad_(True), old, adv, mask


def test_gspo_equals_the_sequence_level_formula():
    lp, old, adv, mask = _gspo_inputs()
    loss_fn = PolicyLoss(
        clip_low=3e-4, clip_high=4e-4, ratio="sequence", aggregation="seq_mean_token_mean"
    )
    out = loss_fn(lp, old, adv, mask)
    out.loss.backward()
    grad, lp.grad = lp.grad.clone(), None

    # GSPO directly: s_i = exp(mean_t(lp - old)), loss = sum_i -min(s_i A_i, clip(s_i) A_i)
    lengths = mask.sum(-1)
    s = (torch.where(mask, lp - old, 0.0).sum(-1) / lengths).exp()
    direct = -torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    direct.sum().backward()
    torch.testing.assert_close(out.loss, direct.sum().detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-12, atol=1e-12)
    # rows 1 and 4 clipped (no gradient), the others not
    clipped = grad.abs().sum(-1) == 0
    assert clipped.tolist() == [False, True, False, False, True]
    assert out.metrics["clip_fraction"].item() == pytest.approx(2)
    assert out.metrics["ratio"].item() == pytest.approx(s.sum().item())
    assert loss_fn.units(mask) == 5


def test_gspo_with_per_token_advantages_equal_per_sequence_ones():
    lp, old, adv, mask = _gspo_inputs()
    loss_fn = PolicyLoss(
        clip_low=3e-4, clip_high=4e-4, ratio="sequence", aggregation="seq_mean_token_mean"
    )
    out = loss_fn(lp, old, adv, mask)
    out.loss.backward()
    grad, lp.grad = lp.grad.clone(), None
    out_tokens = loss_fn(lp, old, adv[:, None].expand(5, 5).clone(), mask)
    out_tokens.loss.backward()
    torch.testing.assert_close(out.loss, out_tokens.loss)
    torch.testing.assert_close(grad, lp.grad)


# -- KL ----------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    k1 = [0.0, -1.0, 0.5]
    k2 = [0.0, 0.5, 0.125]
    k3 = [0.0, math.exp(1) - 1 - 1, math.exp(-0.5) + 0.5 - 1]
    for kind, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        torch.testing.assert_close(kl_penalty(lp, ref, kind), torch.tensor(expected).double())
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_nonnegative_zero_at_equality_and_k1_k3_unbiased():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert (kl_penalty(a, a, "k3") == 0).all()
    # in expectation over tokens sampled from p, k1 and k3 give KL(p || q) exactly
    p = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    exact = (p.exp() * (p - q)).sum()
    for kind in ("k1", "k3"):
        expectation = (p.exp() * kl_penalty(p, q, kind)).sum()
        torch.testing.assert_close(expectation, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_kl_penalty_module_aggregates_like_the_policy_loss(mode):
    lp = torch.where(MASK, -VALUES.clamp(max=5) / 4, torch.tensor(INF)).requires_grad_(True)
    ref = torch.where(MASK, torch.tensor(-1.0), torch.tensor(-INF)).requires_grad_(True)
    kl = KLPenalty(coef=0.1, kind="k3", aggregation=mode, **_kwargs(mode))(lp, ref, MASK)
    d = [-1 + 1 / 4, -1 + 2 / 4, -1 + 3 / 4, -1 + 4 / 4]  # ref - lp on the trained tokens
    k3 = [math.exp(x) - x - 1 for x in d]
    expected = sum(k3) if mode != "seq_mean_token_mean" else sum(k3[:3]) / 3 + k3[3]
    assert kl.item() == pytest.approx(0.1 * expected)
    kl.backward()
    assert ref.grad is None and torch.isfinite(lp.grad).all()


# -- value loss --------------------------------------------------------------------------------


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0, 1.0, 5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 2.5, 0.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)  # the last is padding
    out = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: v 1 -> clipped to 0.7: max(1, 1.3²) = 1.69, clipped (no gradient)
    # token 1: v = old: 1, gradient v - R = -1
    # token 2: v 2 -> clipped to 2.3: max(4, 2.3²) = 5.29, clipped
    # token 3: v 1 -> clipped to 0.7: max(1, 0.49) = 1, gradient v - R = 1
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 1 + 5.29 + 1))
    assert out.metrics["value_clip_fraction"].item() == 2
    out.loss.backward()
    torch.testing.assert_close(
        values.grad, torch.tensor([[0.0, -1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    )
    unclipped = value_loss(values, old, returns, mask, clip=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (1 + 1 + 4 + 1))
    assert unclipped.metrics["value_clip_fraction"].item() == 0
    per_seq = ValueLoss(clip=0.2, aggregation="seq_mean_token_mean")(values, old, returns, mask)
    assert per_seq.loss.item() == pytest.approx(0.5 * (1.69 + 1 + 5.29 + 1) / 4)
    assert per_seq.metrics["value_clip_fraction"].item() == pytest.approx(2 / 4)


# -- entropy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_token_entropy_equals_the_full_softmax(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=dtype, requires_grad=True) * 2
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    entropy = token_entropy(hidden, weight, mask, chunk_size=chunk_size)
    p = torch.softmax((hidden @ weight.T).detach().double(), -1)
    full = (-(p * p.log()).sum(-1) * mask).to(dtype)
    assert entropy.dtype == dtype and not entropy.requires_grad
    torch.testing.assert_close(entropy, full, rtol=1e-5, atol=1e-5)
    assert (entropy[mask == 0] == 0).all()
    assert (token_entropy(hidden, weight, torch.zeros_like(mask)) == 0).all()
