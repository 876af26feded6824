"""Each preference loss == its paper's formula, written out here on Python scalars with
``math``; a few numbers worked out by hand; gradients == finite differences (float64);
rewards are detached, the reference gets no gradient, and missing or bad inputs raise clear
errors."""

from __future__ import annotations

import math

import pytest
import torch

from tunesmith.modules.losses import (
    BradleyTerryLoss,
    CPOLoss,
    DPOLoss,
    HingeLoss,
    IPOLoss,
    ORPOLoss,
    PairLogps,
    PreferenceLossOutput,
    SimPOLoss,
)

# Hand-built pairs: (π_c, π_r, ref_c, ref_r, |y_c|, |y_r|). Policy ahead of the reference,
# behind it, tied, long and short responses, a near-certain chosen response.
PAIRS = [
    (-5.0, -7.0, -6.0, -6.0, 4, 5),
    (-12.0, -3.0, -10.0, -4.0, 9, 2),
    (-2.5, -2.5, -2.5, -2.5, 3, 3),
    (-40.0, -55.0, -42.0, -50.0, 30, 41),
    (-0.01, -8.0, -0.5, -7.0, 2, 6),
    (-1.0, -1.5, -0.8, -2.0, 1, 1),
]


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _batch(pairs=PAIRS, dtype=torch.float64, requires_grad=False):
    columns = list(zip(*pairs))
    pi_c, pi_r, ref_c, ref_r = (
        torch.tensor(c, dtype=dtype, requires_grad=requires_grad) for c in columns[:4]
    )
    len_c, len_r = (torch.tensor(c) for c in columns[4:])  # int token counts
    return PairLogps(pi_c, pi_r, len_c, len_r), PairLogps(
        ref_c.detach(), ref_r.detach(), len_c, len_r
    )


def _check(out: PreferenceLossOutput, expected: list[tuple[float, float, float]]) -> None:
    assert isinstance(out, PreferenceLossOutput)
    losses, chosen, rejected = (torch.tensor(c, dtype=torch.float64) for c in zip(*expected))
    torch.testing.assert_close(out.losses, losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, chosen, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.rejected_rewards, rejected, rtol=1e-12, atol=1e-12)


# -- the paper formulas, on scalars ------------------------------------------------------------


def dpo(pc, pr, rc, rr, beta, eps):
    h = (pc - rc) - (pr - rr)
    loss = -(1 - eps) * _logsigmoid(beta * h) - eps * _logsigmoid(-beta * h)
    return loss, beta * (pc - rc), beta * (pr - rr)


def ipo(pc, pr, rc, rr, lc, lr, beta, average):
    if average:
        pc, rc, pr, rr = pc / lc, rc / lc, pr / lr, rr / lr
    h = (pc - rc) - (pr - rr)
    return (h - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr)


def hinge(pc, pr, rc, rr, beta):
    h = (pc - rc) - (pr - rr)
    return max(0.0, 1 - beta * h), beta * (pc - rc), beta * (pr - rr)


def simpo(pc, pr, lc, lr, beta, gamma):
    loss = -_logsigmoid(beta / lc * pc - beta / lr * pr - gamma)
    return loss, beta * pc / lc, beta * pr / lr


def orpo(pc, pr, lc, lr, beta):
    def odds(avg):  # p / (1 - p), p the geometric-mean token probability
        p = math.exp(avg)
        return p / (1 - p)

    ratio = math.log(odds(pc / lc)) - math.log(odds(pr / lr))
    return -pc / lc - beta * _logsigmoid(ratio), beta * pc / lc, beta * pr / lr


def cpo(pc, pr, lc, lr, loss_type, beta, eps, alpha, gamma):
    """CPO's Eq. 3 (``sigmoid``), its hinge/IPO forms and SimPO's margin, on summed
    (sigmoid, hinge) or length-averaged (ipo, simpo) log-probs, + α · the chosen's mean NLL."""
    c, r = (pc / lc, pr / lr) if loss_type in ("ipo", "simpo") else (pc, pr)
    if loss_type == "hinge":
        preference = max(0.0, 1 - beta * (c - r))
    elif loss_type == "ipo":
        preference = (c - r - 1 / (2 * beta)) ** 2
    else:
        z = beta * c - beta * r - (gamma if loss_type == "simpo" else 0.0)
        preference = -(1 - eps) * _logsigmoid(z) - eps * _logsigmoid(-z)
    return preference + alpha * (-pc / lc), beta * c, beta * r


# -- formulas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_matches_paper_formula(beta, eps):
    policy, reference = _batch()
    out = DPOLoss(beta=beta, label_smoothing=eps)(policy, reference)
    _check(out, [dpo(pc, pr, rc, rr, beta, eps) for pc, pr, rc, rr, _, _ in PAIRS])


def test_dpo_reference_free_uses_zero_reference():
    policy, reference = _batch()
    loss = DPOLoss(beta=0.3, label_smoothing=0.2, reference_free=True)
    assert loss.needs_reference is False and DPOLoss.needs_reference is True
    expected = [dpo(pc, pr, 0.0, 0.0, 0.3, 0.2) for pc, pr, *_ in PAIRS]
    _check(loss(policy), expected)
    _check(loss(policy, reference), expected)  # a reference is ignored


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("average", [True, False])
def test_ipo_matches_paper_formula(beta, average):
    policy, reference = _batch()
    out = IPOLoss(beta=beta, average_log_prob=average)(policy, reference)
    _check(out, [ipo(*pair, beta, average) for pair in PAIRS])


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_hinge_matches_rso_formula(beta):
    policy, reference = _batch()
    out = HingeLoss(beta=beta)(policy, reference)
    _check(out, [hinge(pc, pr, rc, rr, beta) for pc, pr, rc, rr, _, _ in PAIRS])


@pytest.mark.parametrize(("beta", "gamma"), [(2.0, 0.5), (2.5, 0.0), (10.0, 1.4), (0.5, 3.0)])
def test_simpo_matches_paper_formula(beta, gamma):
    policy, _ = _batch()
    out = SimPOLoss(beta=beta, gamma=gamma)(policy)
    _check(out, [simpo(pc, pr, lc, lr, beta, gamma) for pc, pr, _, _, lc, lr in PAIRS])


@pytest.mark.parametrize("beta", [0.1, 0.25, 1.0])
def test_orpo_matches_paper_formula(beta):
    policy, _ = _batch()
    out = ORPOLoss(beta=beta)(policy)
    _check(out, [orpo(pc, pr, lc, lr, beta) for pc, pr, _, _, lc, lr in PAIRS])


# (loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma): TRL's defaults, each loss type,
# label smoothing, no SFT term, a large SFT weight, no SimPO margin, a large one.
CPO_SETTINGS = [
    ("sigmoid", 0.1, 0.0, 1.0, 0.5),
    ("sigmoid", 0.5, 0.2, 0.0, 0.5),
    ("sigmoid", 2.0, 0.5, 3.0, 0.5),
    ("hinge", 0.1, 0.0, 1.0, 0.5),
    ("hinge", 0.5, 0.0, 0.5, 0.5),  # pair 0 sits on the kink: β·(l_c - l_r) = 1
    ("ipo", 0.1, 0.0, 1.0, 0.5),
    ("ipo", 2.0, 0.0, 0.0, 0.5),
    ("simpo", 2.0, 0.0, 1.0, 0.5),
    ("simpo", 2.5, 0.1, 0.0, 0.0),
    ("simpo", 0.5, 0.0, 2.0, 3.0),
]
# Edge pairs: enormous margins either way (logσ saturates), a zero-margin tie, a one-token
# response, a near-certain chosen response (NLL ~ 0).
CPO_EDGES = [
    (-1.0, -5000.0, 0.0, 0.0, 1, 7),
    (-5000.0, -1.0, 0.0, 0.0, 7, 1),
    (-3.0, -3.0, 0.0, 0.0, 3, 3),
    (-1e-9, -2.0, 0.0, 0.0, 1, 4),
]


@pytest.mark.parametrize("pairs", [PAIRS, CPO_EDGES], ids=["pairs", "edges"])
@pytest.mark.parametrize("setting", CPO_SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_cpo_matches_paper_formula(setting, pairs):
    loss_type, beta, eps, alpha, gamma = setting
    policy, reference = _batch(pairs)
    loss = CPOLoss(beta, loss_type, label_smoothing=eps, cpo_alpha=alpha, simpo_gamma=gamma)
    out = loss(policy, reference)  # a reference is ignored
    _check(out, [cpo(pc, pr, lc, lr, *setting) for pc, pr, _, _, lc, lr in pairs])
    nll = torch.tensor([-pc / lc for pc, _, _, _, lc, _ in pairs], dtype=torch.float64)
    torch.testing.assert_close(out.nll_loss, nll, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out.losses).all() and not out.nll_loss.requires_grad


def test_cpo_without_sft_term_is_reference_free_dpo_and_simpo():
    """``cpo_alpha = 0``: CPO's sigmoid loss is DPO with a zero reference, its simpo loss
    SimPO; the rewards agree too."""
    policy, _ = _batch()
    _check_same(
        CPOLoss(beta=0.3, label_smoothing=0.2, cpo_alpha=0.0)(policy),
        DPOLoss(beta=0.3, label_smoothing=0.2, reference_free=True)(policy),
    )
    _check_same(
        CPOLoss(beta=2.0, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.0)(policy),
        SimPOLoss(beta=2.0, gamma=0.7)(policy),
    )


def _check_same(a: PreferenceLossOutput, b: PreferenceLossOutput) -> None:
    for name in ("losses", "chosen_rewards", "rejected_rewards"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("margin", [0.0, 0.7])
def test_bradley_terry_matches_formula(margin):
    chosen = [1.5, -0.3, 2.0, 0.0, 7.0]
    rejected = [0.5, 0.4, 2.0, -3.0, -9.0]
    got = BradleyTerryLoss(margin=margin)(
        torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)
    )
    expected = [-_logsigmoid(c - r - margin) for c, r in zip(chosen, rejected)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_bradley_terry_per_pair_margin():
    chosen, rejected = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    got = BradleyTerryLoss()(chosen, rejected, margin=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(got, torch.full((2,), math.log1p(math.exp(-1.0))))


# -- numbers worked out by hand ----------------------------------------------------------------


def test_hand_checked_numbers():
    """Pair 0: π = (-5, -7), ref = (-6, -6), |y| = (4, 5), so h = 1 - (-1) = 2."""
    policy, reference = _batch(PAIRS[:1])
    # DPO β=0.1: -log σ(0.2) = log(1 + e^-0.2) = log 1.818730753 = 0.598138869
    assert DPOLoss(beta=0.1)(policy, reference).losses.item() == pytest.approx(0.5981388693)
    # cDPO ε=0.1: 0.9·0.598138869 + 0.1·log(1 + e^0.2) = 0.538324982 + 0.079813887
    assert DPOLoss(beta=0.1, label_smoothing=0.1)(policy, reference).losses.item() == (
        pytest.approx(0.5981388693 * 0.9 + 0.7981388693 * 0.1)
    )
    # IPO β=0.5, averaged: h = (-5/4 + 6/4) - (-7/5 + 6/5) = 0.25 + 0.2 = 0.45; (0.45 - 1)² = 0.3025
    assert IPOLoss(beta=0.5)(policy, reference).losses.item() == pytest.approx(0.3025)
    # hinge β=0.1: 1 - 0.2 = 0.8; β=1: relu(1 - 2) = 0
    assert HingeLoss(beta=0.1)(policy, reference).losses.item() == pytest.approx(0.8)
    assert HingeLoss(beta=1.0)(policy, reference).losses.item() == 0.0
    # SimPO β=2, γ=0.5: 2·(-1.25) - 2·(-1.4) - 0.5 = -0.2; -log σ(-0.2) = log(1 + e^0.2)
    out = SimPOLoss(beta=2.0, gamma=0.5)(policy)
    assert out.losses.item() == pytest.approx(0.7981388693)
    assert out.chosen_rewards.item() == pytest.approx(-2.5)
    # ORPO β=0.1: odds(-1.25) = 0.286505/0.713495 = 0.401551, odds(-1.4) = 0.246597/0.753403
    # = 0.327311; log ratio = log 1.226818 = 0.204430; -log σ(0.204430) = 0.596152
    # loss = 1.25 + 0.1 · 0.596152
    assert ORPOLoss(beta=0.1)(policy).losses.item() == pytest.approx(1.25 + 0.0596152, abs=1e-6)
    # CPO β=0.1, α=1: l_c - l_r = 2, -log σ(0.2) = 0.598138869, NLL_c = 5/4; rewards β·π
    out = CPOLoss(beta=0.1)(policy)
    assert out.losses.item() == pytest.approx(0.5981388693 + 1.25)
    assert out.chosen_rewards.item() == pytest.approx(-0.5)
    assert out.nll_loss.item() == pytest.approx(1.25)
    # CPO simpo β=2, γ=0.5, α=0: SimPO's -log σ(-0.2) above; ipo β=0.5: (0.15 - 1)² = 0.7225
    assert CPOLoss(2.0, "simpo", cpo_alpha=0.0)(policy).losses.item() == pytest.approx(0.7981388693)
    assert CPOLoss(0.5, "ipo", cpo_alpha=0.0)(policy).losses.item() == pytest.approx(0.7225)
    # Bradley-Terry: equal scores give log 2
    assert BradleyTerryLoss()(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(math.log(2))


# -- gradients ---------------------------------------------------------------------------------


LOSSES = [
    DPOLoss(beta=0.3),
    DPOLoss(beta=0.3, label_smoothing=0.2),
    DPOLoss(beta=0.3, reference_free=True),
    IPOLoss(beta=0.4),
    IPOLoss(beta=0.4, average_log_prob=False),
    HingeLoss(beta=0.05),  # every pair away from the kink (β·h = 1)
    SimPOLoss(beta=2.0, gamma=0.5),
    ORPOLoss(beta=0.2),
    CPOLoss(beta=0.3, label_smoothing=0.1),
    CPOLoss(beta=0.05, loss_type="hinge"),  # every pair away from the kink
    CPOLoss(beta=0.4, loss_type="ipo", cpo_alpha=0.5),
    CPOLoss(beta=2.0, loss_type="simpo", cpo_alpha=2.0, simpo_gamma=0.5),
]


@pytest.mark.parametrize("loss", LOSSES, ids=repr)
def test_gradients_match_finite_differences(loss):
    policy, reference = _batch()

    def losses(chosen, rejected):
        logps = PairLogps(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
        return loss(logps, reference).losses

    inputs = (policy.chosen.requires_grad_(), policy.rejected.requires_grad_())
    assert torch.autograd.gradcheck(losses, inputs)


def test_bradley_terry_gradients_match_finite_differences():
    chosen = torch.tensor([1.5, -0.3, 2.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.5, 0.4, -1.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(BradleyTerryLoss(margin=0.3), (chosen, rejected))


def test_rewards_detached_and_reference_gets_no_gradient():
    policy, reference = _batch(requires_grad=True)
    reference.chosen.requires_grad_()
    for loss in (DPOLoss(), IPOLoss(), HingeLoss(beta=0.01)):
        out = loss(policy, reference)
        assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
        out.losses.sum().backward()
        assert reference.chosen.grad is None
        assert policy.chosen.grad is not None and policy.chosen.grad.abs().sum() > 0
        policy.chosen.grad = None


def test_float32_inputs_give_float32_and_bf16_is_upcast():
    policy, reference = _batch(dtype=torch.bfloat16)
    out = DPOLoss()(policy, reference)
    assert out.losses.dtype == torch.float32
    policy, _ = _batch(dtype=torch.float32)
    assert SimPOLoss()(policy).losses.dtype == torch.float32


def test_orpo_is_finite_for_a_certain_response():
    """avg log-prob 0 (probability 1) would give infinite odds: it stays finite."""
    policy = PairLogps(
        torch.tensor([0.0, -1e-9]),
        torch.tensor([0.0, -3.0]),
        torch.tensor([3, 3]),
        torch.tensor([3, 3]),
    )
    out = ORPOLoss()(policy)
    assert torch.isfinite(out.losses).all()


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [DPOLoss(), IPOLoss(), HingeLoss()])
def test_missing_reference_is_a_clear_error(loss):
    policy, _ = _batch()
    assert loss.needs_reference is True
    with pytest.raises(ValueError, match=f"{type(loss).__name__} needs the reference"):
        loss(policy)


@pytest.mark.parametrize("loss", [SimPOLoss(), ORPOLoss(), CPOLoss()])
def test_reference_free_losses_need_no_reference(loss):
    assert loss.needs_reference is False
    policy, _ = _batch()
    assert loss(policy).losses.shape == (len(PAIRS),)


def test_bad_inputs_raise_clear_errors():
    policy, reference = _batch()
    zero_len = PairLogps(
        policy.chosen, policy.rejected, policy.chosen_tokens * 0, policy.rejected_tokens
    )
    with pytest.raises(ValueError, match=r"chosen_tokens must be > 0"):
        SimPOLoss()(zero_len)
    short = PairLogps(policy.chosen[:2], policy.rejected[:2], *reference.lengths())
    with pytest.raises(ValueError, match="same number of pairs"):
        DPOLoss()(policy, short)
    with pytest.raises(ValueError, match=r"chosen_tokens has shape \[6\], expected \[2\]"):
        ORPOLoss()(short)
    with pytest.raises(ValueError, match=r"must both be \[P\]"):
        DPOLoss()(PairLogps(policy.chosen, policy.rejected[:3], *policy.lengths()), reference)
    with pytest.raises(ValueError, match=r"chosen_scores \[2, 1\]"):
        BradleyTerryLoss()(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOLoss(label_smoothing=0.7)
    with pytest.raises(ValueError, match="beta must be > 0"):
        IPOLoss(beta=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, r"^beta must be > 0, got 0.0$"),
        ({"beta": -1.0, "loss_type": "simpo"}, r"^beta must be > 0, got -1.0$"),
        ({"loss_type": "kto"}, r"^loss_type must be one of sigmoid, hinge, ipo, simpo, got 'kto'$"),
        ({"cpo_alpha": -0.5}, r"^cpo_alpha must be >= 0, got -0.5$"),
        ({"label_smoothing": 0.6}, r"^label_smoothing must be in \[0, 0.5\], got 0.6$"),
        (
            {"label_smoothing": 0.1, "loss_type": "hinge"},
            r"^label_smoothing applies to loss_type sigmoid or simpo only, got "
            r"label_smoothing=0.1 with loss_type='hinge'$",
        ),
        ({"label_smoothing": 0.1, "loss_type": "ipo"}, r"loss_type='ipo'$"),
    ],
)
def test_cpo_refuses_bad_settings_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPOLoss(**kwargs)


def test_nll_loss_is_reported_by_the_losses_with_an_sft_term_only():
    policy, reference = _batch()
    nll = -policy.chosen / policy.chosen_tokens
    torch.testing.assert_close(ORPOLoss()(policy).nll_loss, nll)
    for loss in (DPOLoss(), IPOLoss(), HingeLoss()):
        assert loss(policy, reference).nll_loss is None
    assert SimPOLoss()(policy).nll_loss is None
