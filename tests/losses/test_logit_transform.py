"""A model's logit transform (Granite's scale, Gemma 2's soft cap) inside the chunked head
paths: LinearCrossEntropyLoss (gradients in forward or recomputed, no grad), token_logprobs
(logits kept or recomputed), token_entropy and KDLoss (student and teacher each their own)
give the values and the hidden / weight gradients of the plain full-logits reference
``transform(hidden @ weight.T)`` computed by autograd, with one chunk or many, in float32 and
float64. The callers hand each model's transform over, and refuse a custom loss that would
drop it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import (
    IGNORE_INDEX,
    KDLoss,
    LinearCrossEntropyLoss,
    divergence,
    token_entropy,
    token_logprobs,
)
from tunesmith.rl.rollout import tempered_transform
from tunesmith.training.forward import head_transform, transform_kwargs
from tunesmith.training.objectives.token import token_loss

VOCAB, HIDDEN, TEACHER_HIDDEN = 23, 8, 6
TRANSFORMS = {
    "scale": LogitTransform(scale=0.3),
    "cap": LogitTransform(softcap=4.0),
    "scale+cap": LogitTransform(scale=1.7, softcap=5.0),
}
DTYPES = [torch.float32, torch.float64]
CHUNKS = [3, 64]  # many chunks (5 of the 14 trained rows), one chunk


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return (
        {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    )


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (2, 9), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, -1] = IGNORE_INDEX  # padding
    return {  # logits of std ~5: a cap of 4 or 5 bends most of them
        "hidden": (2 * torch.randn(2, 9, HIDDEN, generator=gen)).to(dtype),
        "weight": torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype),
        "teacher_hidden": (2 * torch.randn(2, 9, TEACHER_HIDDEN, generator=gen)).to(dtype),
        "teacher_weight": torch.randn(VOCAB, TEACHER_HIDDEN, generator=gen).to(dtype),
        "coeffs": torch.randn(2, 9, generator=gen).to(dtype),  # weights of the log-probs
        "labels": labels,
    }


def _grads(fn, hidden, weight):
    """``fn(hidden, weight) -> (value, objective)``: the value and the objective's hidden and
    weight gradients."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    value, objective = fn(hidden, weight)
    objective.backward()
    return value.detach(), hidden.grad, weight.grad


def _assert_same(got, expected, dtype):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **_tol(dtype))


def _full_logits(hidden, weight, transform):
    logits = hidden @ weight.T
    return logits if transform is None else transform(logits)


def _reference_ce(x, transform):
    def fn(hidden, weight):
        logits = _full_logits(hidden, weight, transform)
        loss = F.cross_entropy(
            logits.flatten(0, -2), x["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss, loss * 0.5

    return fn


def _reference_logprobs(hidden, weight, labels, transform):
    log_p = torch.log_softmax(_full_logits(hidden, weight, transform), dim=-1)
    picked = log_p.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return picked * (labels != IGNORE_INDEX)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_linear_cross_entropy_equals_the_transformed_full_logits(
    name, grad_in_forward, chunk, dtype
):
    x, transform = _inputs(dtype), TRANSFORMS[name]
    loss_fn = LinearCrossEntropyLoss(chunk_size=chunk, grad_in_forward=grad_in_forward)

    def chunked(hidden, weight):
        loss = loss_fn(hidden, weight, x["labels"], transform=transform)
        return loss, loss * 0.5

    expected = _grads(_reference_ce(x, transform), x["hidden"], x["weight"])
    _assert_same(_grads(chunked, x["hidden"], x["weight"]), expected, dtype)
    with torch.no_grad():
        loss = loss_fn(x["hidden"], x["weight"], x["labels"], transform=transform)
    torch.testing.assert_close(loss, expected[0], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_token_logprobs_equal_the_transformed_full_logits(name, recompute, chunk, dtype):
    x, transform = _inputs(dtype), TRANSFORMS[name]

    def chunked(hidden, weight):
        logps = token_logprobs(
            hidden, weight, x["labels"], chunk_size=chunk, recompute=recompute, transform=transform
        )
        return logps, (logps * x["coeffs"]).sum()

    def reference(hidden, weight):
        logps = _reference_logprobs(hidden, weight, x["labels"], transform)
        return logps, (logps * x["coeffs"]).sum()

    expected = _grads(reference, x["hidden"], x["weight"])
    _assert_same(_grads(chunked, x["hidden"], x["weight"]), expected, dtype)
    with torch.no_grad():  # the autograd-free path
        logps = token_logprobs(
            x["hidden"], x["weight"], x["labels"], chunk_size=chunk, transform=transform
        )
    torch.testing.assert_close(logps, expected[0], **_tol(dtype))
    # the checkpointed autograd path (as a sharded weight takes it)
    from tunesmith.modules.losses.token import _checkpointed_chunks

    keep = (x["labels"] != IGNORE_INDEX).flatten().nonzero().squeeze(1)
    rows = x["hidden"].flatten(0, 1)[keep].clone().requires_grad_()
    targets = x["labels"].flatten()[keep]
    picked = _checkpointed_chunks(
        rows, x["weight"], targets, chunk, dtype, None, recompute, transform
    )
    torch.testing.assert_close(picked, expected[0].flatten()[keep], **_tol(dtype))
    (picked * x["coeffs"].flatten()[keep]).sum().backward()
    torch.testing.assert_close(rows.grad, expected[1].flatten(0, 1)[keep], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_token_entropy_equals_the_transformed_full_logits(name, chunk, dtype):
    x, transform = _inputs(dtype), TRANSFORMS[name]
    mask = x["labels"] != IGNORE_INDEX
    log_p = torch.log_softmax(_full_logits(x["hidden"], x["weight"], transform), dim=-1)
    expected = -(log_p.exp() * log_p).sum(-1) * mask
    got = token_entropy(x["hidden"], x["weight"], mask, chunk_size=chunk, transform=transform)
    torch.testing.assert_close(got, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(("kind", "temperature"), [("forward", 1.0), ("js", 2.0)])
def test_kd_loss_applies_each_models_transform(kind, temperature, chunk, dtype):
    x = _inputs(dtype)
    s_transform, t_transform = TRANSFORMS["scale+cap"], TRANSFORMS["scale"]
    loss_fn = KDLoss(kind=kind, temperature=temperature, chunk_size=chunk)
    teacher = (x["teacher_hidden"], x["teacher_weight"])

    def chunked(hidden, weight):
        kd, ce = loss_fn(
            hidden,
            weight,
            *teacher,
            x["labels"],
            student_transform=s_transform,
            teacher_transform=t_transform,
        )
        return torch.stack([kd, ce]), 0.7 * kd + 0.3 * ce

    def reference(hidden, weight):
        mask = x["labels"] != IGNORE_INDEX
        s_logits = _full_logits(hidden, weight, s_transform)[mask]
        t_logits = _full_logits(*teacher, t_transform)[mask]
        kd = divergence(s_logits, t_logits, kind, temperature).sum()
        ce = F.cross_entropy(s_logits, x["labels"][mask], reduction="sum")
        return torch.stack([kd, ce]), 0.7 * kd + 0.3 * ce

    expected = _grads(reference, x["hidden"], x["weight"])
    _assert_same(_grads(chunked, x["hidden"], x["weight"]), expected, dtype)
    plain = torch.stack(loss_fn(x["hidden"], x["weight"], *teacher, x["labels"]))
    assert (plain - expected[0]).abs().min() > 0.1  # both terms see the transforms


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_the_transform_matters(name):
    """Without the transform every value is far off (so the comparisons above can fail)."""
    x, transform = _inputs(torch.float64), TRANSFORMS[name]
    mask = x["labels"] != IGNORE_INDEX
    with_t = _grads(_reference_ce(x, transform), x["hidden"], x["weight"])
    without = _grads(_reference_ce(x, None), x["hidden"], x["weight"])
    assert (with_t[0] - without[0]).abs() > 1.0
    assert (with_t[1] - without[1]).abs().max() > 0.1
    assert (with_t[2] - without[2]).abs().max() > 0.1
    logps = _reference_logprobs(x["hidden"], x["weight"], x["labels"], transform)
    plain = _reference_logprobs(x["hidden"], x["weight"], x["labels"], None)
    assert (logps - plain)[mask].abs().max() > 0.5
    entropy = token_entropy(x["hidden"], x["weight"], mask, transform=transform)
    assert (entropy - token_entropy(x["hidden"], x["weight"], mask))[mask].abs().max() > 0.1


def test_an_identity_transform_is_none():
    x = _inputs(torch.float64)
    loss_fn = LinearCrossEntropyLoss(chunk_size=3)
    torch.testing.assert_close(
        loss_fn(x["hidden"], x["weight"], x["labels"], transform=LogitTransform()),
        loss_fn(x["hidden"], x["weight"], x["labels"]),
        rtol=0,
        atol=0,
    )


def test_head_transform_reads_the_model():
    model = nn.Module()
    assert head_transform(model) is None  # no attribute
    model.logit_transform = None
    assert head_transform(model) is None
    model.logit_transform = LogitTransform()  # changes nothing
    assert head_transform(model) is None
    model.logit_transform = TRANSFORMS["cap"]
    assert head_transform(model) is TRANSFORMS["cap"]


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_tempered_transform_gives_the_samplers_logits(name):
    """RL log-probs of ``h / T`` through the tempered transform are the sampler's
    ``log_softmax(transform(z) / T)``."""
    x, transform, temperature = _inputs(torch.float64), TRANSFORMS[name], 0.7
    model = nn.Module()
    model.logit_transform = transform
    got = token_logprobs(
        x["hidden"] / temperature,
        x["weight"],
        x["labels"],
        chunk_size=3,
        transform=tempered_transform(model, temperature),
    )
    log_p = torch.log_softmax(transform(x["hidden"] @ x["weight"].T) / temperature, dim=-1)
    expected = log_p.gather(-1, x["labels"].clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(
        got, expected * (x["labels"] != IGNORE_INDEX), rtol=1e-10, atol=1e-10
    )
    assert tempered_transform(nn.Module(), temperature) is None


class _CustomLoss(nn.Module):
    """A user's loss that owns the head but knows nothing of transforms."""

    needs_hidden_states = True

    def forward(self, hidden, weight, labels):
        return LinearCrossEntropyLoss()(hidden, weight, labels)


def test_callers_pass_the_transform_and_refuse_a_loss_without_it():
    from tunesmith.models import llama3

    model = llama3.llama3_tiny()
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "position_ids": torch.arange(4)[None],
        "labels": torch.tensor([[2, 3, 4, IGNORE_INDEX]]),
    }
    with torch.no_grad():
        plain, _ = token_loss(model, _CustomLoss(), batch)  # a plain model: works
        hidden = model(batch["input_ids"], position_ids=batch["position_ids"],
                       return_hidden_states=True)  # fmt: skip
        model.logit_transform = TRANSFORMS["scale+cap"]
        loss, _ = token_loss(model, LinearCrossEntropyLoss(), batch)
        expected = LinearCrossEntropyLoss()(
            hidden, model.lm_head.weight, batch["labels"], transform=TRANSFORMS["scale+cap"]
        )
        torch.testing.assert_close(loss, expected)
        assert abs(float(loss - plain)) > 1e-3
        with pytest.raises(TypeError, match=r"_CustomLoss takes no 'transform' keyword.*softcap"):
            token_loss(model, _CustomLoss(), batch)
    assert transform_kwargs(_CustomLoss(), transform=None) == {}
    assert transform_kwargs(lambda *a, **kw: 0, transform=TRANSFORMS["cap"]) == {
        "transform": TRANSFORMS["cap"]
    }
