"""Knowledge distillation: the divergences == their definitions written out here; KDLoss
(chunked, checkpointed, from hidden states) == the divergence and cross-entropy of the full
logits, values and gradients, for every kind and temperature; the teacher never gets a
gradient, may be bf16, and mismatched inputs raise clear errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tunesmith.modules.losses import IGNORE_INDEX, KD_KINDS, KDLoss, divergence
from tunesmith.training.memory.usage import LiveTensorBytes


def _inputs(b=2, s=7, h_s=6, h_t=10, vocab=17, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s_hidden = torch.randn(b, s, h_s, generator=gen, dtype=dtype).requires_grad_()
    s_weight = (torch.randn(vocab, h_s, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    t_hidden = torch.randn(b, s, h_t, generator=gen, dtype=dtype)
    t_weight = torch.randn(vocab, h_t, generator=gen, dtype=dtype) * 0.5
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    return s_hidden, s_weight, t_hidden, t_weight, labels


def _full(kind, temperature, s_hidden, s_weight, t_hidden, t_weight, labels):
    """Unchunked reference: full logits, divergence at every position, masked sum; CE."""
    s_logits, t_logits = s_hidden @ s_weight.T, t_hidden @ t_weight.T
    per_position = divergence(s_logits, t_logits, kind, temperature)
    kd = (per_position * (labels != IGNORE_INDEX)).sum()
    ce = F.cross_entropy(
        s_logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return kd, ce


def _values_and_grads(fn, s_hidden, s_weight, *rest):
    s_hidden.grad = s_weight.grad = None
    kd, ce = fn(s_hidden, s_weight, *rest)
    (kd + 0.37 * ce).backward()
    return kd.detach(), ce.detach(), s_hidden.grad.clone(), s_weight.grad.clone()


# -- divergence --------------------------------------------------------------------------------


def _probs(logits: list[float], temperature: float) -> list[float]:
    z = [math.exp(x / temperature) for x in logits]
    return [v / sum(z) for v in z]


def _kl_scalar(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("js_beta", [0.5, 0.2])
def test_divergences_match_their_definitions(temperature, js_beta):
    """Σ_v p log(p/q) on plain Python floats, for every kind, times T²."""
    student = [[0.3, -1.2, 2.0, 0.0, 0.7], [5.0, -3.0, 0.1, 0.1, -0.4]]
    teacher = [[1.1, 0.4, -0.5, 2.2, 0.0], [4.0, -2.0, 1.0, 0.0, 0.3]]
    got = {
        kind: divergence(
            torch.tensor(student, dtype=torch.float64),
            torch.tensor(teacher, dtype=torch.float64),
            kind,
            temperature,
            js_beta,
        )
        for kind in KD_KINDS
    }
    for i in range(2):
        p_s, p_t = _probs(student[i], temperature), _probs(teacher[i], temperature)
        m = [js_beta * t + (1 - js_beta) * s for t, s in zip(p_t, p_s)]
        forward, reverse = _kl_scalar(p_t, p_s), _kl_scalar(p_s, p_t)
        expected = {
            "forward": forward,
            "reverse": reverse,
            "symmetric": 0.5 * (forward + reverse),
            "js": js_beta * _kl_scalar(p_t, m) + (1 - js_beta) * _kl_scalar(p_s, m),
        }
        for kind in KD_KINDS:
            assert got[kind][i].item() == pytest.approx(expected[kind] * temperature**2, rel=1e-10)


def test_forward_kl_hand_checked():
    """Two-token vocabulary, T=1: p_T = (1/2, 1/2), p_S = σ(±log 3) = (3/4, 1/4):
    KL = ½ log(½ / ¾) + ½ log(½ / ¼) = ½ log(4/3) = 0.143841036."""
    student = torch.tensor([[math.log(3.0), 0.0]])
    teacher = torch.tensor([[0.0, 0.0]])
    assert divergence(student, teacher, "forward").item() == pytest.approx(0.1438410362, rel=1e-6)


@pytest.mark.parametrize("kind", KD_KINDS)
def test_divergences_nonnegative_and_zero_for_identical(kind):
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(64, 50, generator=gen) * 3, torch.randn(64, 50, generator=gen)
    for temperature in (1.0, 2.0):
        assert (divergence(student, teacher, kind, temperature) >= 0).all()
        same = divergence(student, student.clone(), kind, temperature)
        assert same.abs().max() < 1e-5
    assert divergence(student, teacher, kind).dtype == torch.float32


def test_js_bounded_by_log_two():
    """Nearly disjoint distributions push the JSD (β = ½, T = 1) up to, never past, log 2."""
    student = torch.full((3, 8), -30.0)
    teacher = torch.full((3, 8), -30.0)
    student[:, 0] = teacher[:, 1] = 30.0
    js = divergence(student.double(), teacher.double(), "js")
    assert (js <= math.log(2) + 1e-12).all() and (js > math.log(2) - 1e-6).all()
    random = divergence(torch.randn(100, 20) * 5, torch.randn(100, 20) * 5, "js")
    assert (random <= math.log(2)).all()


# -- KDLoss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KD_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_equals_full_logits(kind, temperature):
    inputs = _inputs()
    expected = _values_and_grads(lambda *a: _full(kind, temperature, *a), *inputs)
    for kwargs in ({"num_chunks": 1}, {"num_chunks": 3}, {"chunk_size": 1}, {"chunk_size": 100}):
        loss = KDLoss(kind=kind, temperature=temperature, **kwargs)
        got = _values_and_grads(loss, *inputs)
        assert got[0].dtype == got[1].dtype == torch.float64 and got[0].shape == ()
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_forward_kl_direct_formula():
    """Σ over trained positions of Σ_v p_T (log p_T - log p_S) · T², written out directly."""
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs()
    kd, _ = KDLoss(kind="forward", temperature=2.0, num_chunks=2)(
        s_hidden, s_weight, t_hidden, t_weight, labels
    )
    p_t = torch.softmax(t_hidden @ t_weight.T / 2.0, dim=-1)
    p_s = torch.softmax(s_hidden @ s_weight.T / 2.0, dim=-1)
    per_position = (p_t * (p_t.log() - p_s.log())).sum(-1) * 4.0
    torch.testing.assert_close(kd, per_position[labels != IGNORE_INDEX].sum())


def test_student_equal_to_teacher_gives_zero_divergence():
    s_hidden, s_weight, _, _, labels = _inputs()
    for kind in KD_KINDS:
        kd, ce = KDLoss(kind=kind, num_chunks=2)(
            s_hidden, s_weight, s_hidden.detach(), s_weight.detach(), labels
        )
        assert abs(kd.item()) < 1e-12 and ce.item() > 0


def test_gradcheck_float64():
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs(s=4, h_s=3, h_t=4, vocab=5)
    loss = KDLoss(kind="js", temperature=2.0, js_beta=0.3, chunk_size=2)

    def fn(h, w):
        kd, ce = loss(h, w, t_hidden, t_weight, labels)
        return kd + 0.5 * ce

    assert torch.autograd.gradcheck(fn, (s_hidden, s_weight))


def test_teacher_gets_no_gradient():
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs()
    t_hidden.requires_grad_()
    t_weight.requires_grad_()
    kd, ce = KDLoss(num_chunks=2)(s_hidden, s_weight, t_hidden, t_weight, labels)
    (kd + ce).backward()
    assert t_hidden.grad is None and t_weight.grad is None
    assert s_hidden.grad is not None and s_weight.grad is not None


def test_bf16_teacher_with_float32_student():
    """A bf16 teacher: the result is float32 and equals the divergence against the teacher's
    bf16 logits computed in float32."""
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs(dtype=torch.float32)
    t_hidden, t_weight = t_hidden.bfloat16(), t_weight.bfloat16()
    kd, ce = KDLoss(kind="reverse", temperature=2.0, num_chunks=3)(
        s_hidden, s_weight, t_hidden, t_weight, labels
    )
    assert kd.dtype == ce.dtype == torch.float32
    t_logits = (t_hidden @ t_weight.T).float()
    per_position = divergence(s_hidden @ s_weight.T, t_logits, "reverse", 2.0)
    torch.testing.assert_close(kd, per_position[labels != IGNORE_INDEX].sum())
    kd.backward()
    assert s_weight.grad.dtype == torch.float32


def test_under_autocast_projects_in_bf16_and_accumulates_in_float32():
    """float32 student and teacher under bf16 autocast: both projections run in bf16 (as the
    lm_head would), the sums are float32 and the float32 weight gets a float32 gradient."""
    inputs = _inputs(dtype=torch.float32, s=16, h_s=32, h_t=32, vocab=64)
    with torch.autocast("cpu", torch.bfloat16):
        got = _values_and_grads(KDLoss(kind="forward", num_chunks=3), *inputs)
    exact = _values_and_grads(KDLoss(kind="forward", num_chunks=3), *inputs)
    assert got[0].dtype == got[1].dtype == got[3].dtype == torch.float32
    for a, b in zip(got, exact):
        assert ((a - b).norm() / b.norm()).item() < 3e-2
    assert (got[1] - exact[1]).abs() > 1e-5  # and it really ran in bf16


def test_under_no_grad():
    inputs = _inputs()
    expected = _full("symmetric", 1.0, *inputs)
    with torch.no_grad():
        got = KDLoss(kind="symmetric", num_chunks=3)(*inputs)
    assert not got[0].requires_grad
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b.detach())


def test_nothing_trained_gives_zero_with_a_graph():
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    kd, ce, grad_hidden, grad_weight = _values_and_grads(
        KDLoss(), s_hidden, s_weight, t_hidden, t_weight, labels
    )
    assert kd.item() == ce.item() == 0.0
    assert not grad_hidden.any() and not grad_weight.any()


def test_bad_inputs_raise_clear_errors():
    s_hidden, s_weight, t_hidden, t_weight, labels = _inputs(vocab=17)
    loss = KDLoss()
    with pytest.raises(ValueError, match=r"student_weight \[17, 6\] vs teacher_weight \[16, 10\]"):
        loss(s_hidden, s_weight, t_hidden, t_weight[:16], labels)
    with pytest.raises(ValueError, match=r"teacher_hidden \[2, 6, 10\] and labels \[2, 7\]"):
        loss(s_hidden, s_weight, t_hidden[:, :-1], t_weight, labels)
    with pytest.raises(ValueError, match=r"teacher_weight must be \[vocab, hidden=10\]"):
        loss(s_hidden, s_weight, t_hidden, t_weight[:, :6], labels)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 17\)"):
        loss(s_hidden, s_weight, t_hidden, t_weight, labels.clamp(min=0) + 10)
    with pytest.raises(ValueError, match="kind must be one of"):
        KDLoss(kind="kl")
    with pytest.raises(ValueError, match="temperature"):
        KDLoss(temperature=0.0)
    with pytest.raises(ValueError, match="js_beta"):
        divergence(torch.zeros(2), torch.zeros(2), "js", js_beta=1.5)
    with pytest.raises(ValueError, match="num_chunks"):
        KDLoss(num_chunks=0)
    with pytest.raises(ValueError, match="recompute must be true, false or null, got 'yes'"):
        KDLoss(recompute="yes")
    with pytest.raises(ValueError, match=r"student logits \[2, 3\] and teacher logits \[2, 4\]"):
        divergence(torch.zeros(2, 3), torch.zeros(2, 4), "forward")


def test_peak_memory_scales_with_the_chunk():
    """Forward + backward on 1024 tokens x 4096 vocab: with several chunks nothing of logits
    size is kept between forward and backward and the peak shrinks with the chunk (one chunk
    of logits alive at a time); a single chunk (the whole logits, several [tokens, vocab]
    tensors) is kept by default, at the peak its recomputation would reach anyway."""
    tokens, vocab, h = 1024, 4096, 16
    gen = torch.Generator().manual_seed(0)
    s_hidden = torch.randn(1, tokens, h, generator=gen).requires_grad_()
    s_weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    t_hidden = torch.randn(1, tokens, h, generator=gen)
    t_weight = torch.randn(vocab, h, generator=gen)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    logits_bytes = tokens * vocab * 4

    def peak(num_chunks: int, recompute: bool | None = None) -> tuple[int, int]:
        s_hidden.grad = s_weight.grad = None
        loss = KDLoss(kind="js", num_chunks=num_chunks, recompute=recompute)
        with LiveTensorBytes() as mem:
            kd, ce = loss(s_hidden, s_weight, t_hidden, t_weight, labels)
            kept = mem.current
            (kd + ce).backward()
            del kd, ce
        return mem.peak, kept

    (one_peak, one_kept), (peak_16, kept_16), (peak_32, _) = peak(1), peak(16), peak(32)
    recomputed_peak, recomputed_kept = peak(1, recompute=True)
    assert one_peak > 4 * logits_bytes  # the unchunked computation really is big
    assert one_kept > 4 * logits_bytes  # one chunk: kept from forward to backward
    assert recomputed_kept < logits_bytes / 20 and kept_16 < logits_bytes / 20  # recomputed
    assert one_peak <= 1.05 * recomputed_peak  # keeping it costs no peak
    assert peak_16 < one_peak / 10
    assert peak_32 < 0.6 * peak_16
