"""GKD's generalised Jensen-Shannon divergence (``kind="js"``, ``js_beta`` = the paper's and
TRL's ``beta``): on hand-built logits it equals the formula written out here in float64 and
TRL's ``GKDTrainer.generalized_jsd_loss`` (a test-only reference), for beta 0 (forward KL),
0.5, 1 (reverse KL) and in between, at a temperature; the chunked KDLoss gives the same sums
and gradients as the full logits, the ends included."""

from __future__ import annotations

import pytest
import torch
from trl.experimental.gkd import GKDTrainer

from tunesmith.modules.losses import IGNORE_INDEX, KDLoss, divergence

BETAS = (0.0, 0.3, 0.5, 1.0)
T = 2.0


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Three positions over a 5-token vocabulary, float64: student and teacher."""
    student = [[0.3, -1.2, 2.0, 0.0, 0.7], [5.0, -3.0, 0.1, 0.1, -0.4], [0.0, 0.0, 0.0, 0.0, 1.0]]
    teacher = [[1.1, 0.4, -0.5, 2.2, 0.0], [4.0, -2.0, 1.0, 0.0, 0.3], [-1.0, 3.0, 0.5, 0.0, 0.0]]
    return torch.tensor(student, dtype=torch.float64), torch.tensor(teacher, dtype=torch.float64)


def _formula(student: torch.Tensor, teacher: torch.Tensor, beta: float, t: float) -> torch.Tensor:
    """Per position, GKD's eq. 1 at temperature t: beta 0 KL(T || S), beta 1 KL(S || T), else
    beta KL(T || M) + (1 - beta) KL(S || M) with M = beta T + (1 - beta) S; times t²."""
    p_s, p_t = torch.softmax(student / t, -1), torch.softmax(teacher / t, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        value = kl(p_t, p_s)
    elif beta == 1:
        value = kl(p_s, p_t)
    else:
        m = beta * p_t + (1 - beta) * p_s
        value = beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)
    return value * t**2


@pytest.mark.parametrize("beta", BETAS)
def test_generalised_jsd_is_its_formula_and_trls(beta):
    student, teacher = _logits()
    got = divergence(student, teacher, "js", temperature=T, js_beta=beta)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _formula(student, teacher, beta, T), rtol=1e-12, atol=0)
    trl = GKDTrainer.generalized_jsd_loss(
        student[None], teacher[None], beta=beta, temperature=T, reduction="none"
    ).sum(-1)[0]  # TRL leaves out the T² of Hinton et al.
    torch.testing.assert_close(got, trl * T**2, rtol=1e-10, atol=1e-14)
    assert (got > 0.01).all()


def test_the_ends_are_the_kls_and_the_middle_is_neither():
    student, teacher = _logits()
    forward = divergence(student, teacher, "forward", temperature=T)
    reverse = divergence(student, teacher, "reverse", temperature=T)
    assert torch.equal(divergence(student, teacher, "js", temperature=T, js_beta=0.0), forward)
    assert torch.equal(divergence(student, teacher, "js", temperature=T, js_beta=1.0), reverse)
    middle = divergence(student, teacher, "js", temperature=T, js_beta=0.5)
    assert (middle < torch.minimum(forward, reverse)).all()


@pytest.mark.parametrize("beta", BETAS)
def test_chunked_kd_loss_equals_the_full_logits(beta):
    """KDLoss over hidden states in 3 chunks (checkpointed) == the divergence of the full
    logits summed over the trained positions: values and the student's gradients."""
    gen = torch.Generator().manual_seed(0)
    s_hidden = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    s_weight = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    t_hidden = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    t_weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, :2] = IGNORE_INDEX  # a prompt
    labels[1, -1] = IGNORE_INDEX  # padding

    loss = KDLoss(kind="js", js_beta=beta, temperature=T, num_chunks=3)
    kd, _ = loss(s_hidden, s_weight, t_hidden, t_weight, labels)
    grads = torch.autograd.grad(kd, (s_hidden, s_weight))

    full = divergence(s_hidden @ s_weight.T, t_hidden @ t_weight.T, "js", T, beta)
    expected = (full * (labels != IGNORE_INDEX)).sum()
    expected_grads = torch.autograd.grad(expected, (s_hidden, s_weight))
    torch.testing.assert_close(kd, expected, rtol=1e-12, atol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
