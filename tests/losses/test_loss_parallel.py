"""Loss parallel: on 2 gloo ranks, with the lm_head weight a DTensor sharded over an odd
vocabulary (37 rows -> 19 + 18), LinearCrossEntropyLoss (gradients in forward or recomputed),
the tokens it counts right (``count_correct``), token_logprobs, token_entropy and KDLoss
(every kind; a teacher sharded alike or whole; and each with a soft-capped logit transform,
applied to each rank's columns) give the values of
the same functions on the plain full weight, the same on both ranks, with the full hidden
gradient on every rank and the weight gradient of each rank's shard (gathered here). A
replicated DTensor weight and a replicated DTensor hidden state work too; a vocabulary too
small to give each rank a row is refused on every rank.

One spawned world runs every case and saves what each rank got; the tests compare it with the
single-process computation done here."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import (
    IGNORE_INDEX,
    KD_KINDS,
    KDLoss,
    LinearCrossEntropyLoss,
    token_entropy,
    token_logprobs,
)

VOCAB, HIDDEN, TEACHER_HIDDEN, CHUNK = 37, 8, 6, 4
KD_CASES = [(kind, 2.0) for kind in KD_KINDS] + [("forward", 1.0), ("js", 1.0)]
CAPPED = LogitTransform(scale=1.7, softcap=3.0)  # applied to each rank's columns alone


def _inputs() -> dict[str, torch.Tensor]:
    """The same tensors on every rank and in the test process."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (2, 9), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    labels[0, 3], labels[0, 4], labels[1, 0], labels[1, 1] = 0, 18, 19, 36  # both shards' edges
    hidden = torch.randn(2, 9, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    labels[1, 2:6] = (hidden[1, 2:6] @ weight.T).argmax(-1)  # tokens the model gets right
    return {
        "hidden": hidden,
        "weight": weight,
        "teacher_hidden": torch.randn(2, 9, TEACHER_HIDDEN, generator=gen),
        "teacher_weight": torch.randn(VOCAB, TEACHER_HIDDEN, generator=gen),
        "labels": labels,
        "coeffs": torch.randn(2, 9, generator=gen),  # weights of the per-token log-probs
        "mask": labels != IGNORE_INDEX,
    }


@contextmanager
def _no_gather():
    """Any ``DTensor.full_tensor()`` (a gathered weight) fails inside."""
    from torch.distributed.tensor import DTensor

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a {list(self.placements)} DTensor was gathered")

    original, DTensor.full_tensor = DTensor.full_tensor, refuse
    try:
        yield
    finally:
        DTensor.full_tensor = original


def _run(fn, hidden, weight, wrap_hidden=None, wrap_weight=None, guard=None):
    """``fn(hidden, weight)`` returns ``(value, objective)``: -> ``value`` and the hidden and
    (full) weight gradients of ``objective`` (None when it is None: no gradient)."""
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone()
    if wrap_weight is not None:
        weight = wrap_weight(weight)
    weight.requires_grad_()
    with guard or _nothing():
        value, objective = fn(hidden if wrap_hidden is None else wrap_hidden(hidden), weight)
        if objective is None:
            return value, None, None
        objective.backward()
    grad_weight = weight.grad
    if guard is not None:  # the shard's own gradient, as a Shard(0) DTensor
        assert grad_weight.placements == weight.placements
        assert grad_weight.to_local().shape == weight.to_local().shape
    if hasattr(grad_weight, "full_tensor"):
        grad_weight = grad_weight.full_tensor()
    return value.detach(), hidden.grad, grad_weight


@contextmanager
def _nothing():
    yield


def _cases(x: dict[str, torch.Tensor], teacher_weight) -> dict[str, object]:
    """Every case, as ``name -> fn(hidden, weight) -> (value, objective)``; ``teacher_weight``
    turns the full teacher weight into what the case passes."""
    cases: dict[str, object] = {}
    for grad_in_forward in (True, False):
        loss_fn = LinearCrossEntropyLoss(chunk_size=CHUNK, grad_in_forward=grad_in_forward)

        def ce(hidden, weight, loss_fn=loss_fn):  # the loss and the tokens right
            loss, right = loss_fn(hidden, weight, x["labels"], count_correct=True)
            return torch.stack([loss, right.to(loss.dtype)]), loss * 0.5

        cases[f"ce_grad_in_forward={grad_in_forward}"] = ce

    def logprobs(hidden, weight):
        logps = token_logprobs(hidden, weight, x["labels"], chunk_size=CHUNK)
        return logps, (logps * x["coeffs"]).sum()

    def entropy(hidden, weight):
        return token_entropy(hidden, weight, x["mask"], chunk_size=CHUNK), None

    cases["logprobs"], cases["entropy"] = logprobs, entropy
    for kind, temperature in KD_CASES:
        loss_fn = KDLoss(kind=kind, temperature=temperature, chunk_size=CHUNK)

        def kd(hidden, weight, loss_fn=loss_fn):
            kd, ce = loss_fn(hidden, weight, x["teacher_hidden"], teacher_weight(), x["labels"])
            return torch.stack([kd, ce]), 0.7 * kd + 0.3 * ce

        cases[f"kd_{kind}_T={temperature}"] = kd

    def ce_capped(hidden, weight):
        loss, right = LinearCrossEntropyLoss(chunk_size=CHUNK)(
            hidden, weight, x["labels"], transform=CAPPED, count_correct=True
        )
        return torch.stack([loss, right.to(loss.dtype)]), loss * 0.5

    def logprobs_capped(hidden, weight):
        logps = token_logprobs(hidden, weight, x["labels"], chunk_size=CHUNK, transform=CAPPED)
        return logps, (logps * x["coeffs"]).sum()

    def entropy_capped(hidden, weight):
        return token_entropy(hidden, weight, x["mask"], chunk_size=CHUNK, transform=CAPPED), None

    def kd_capped(hidden, weight):
        kd, ce = KDLoss(kind="js", temperature=2.0, chunk_size=CHUNK)(
            hidden, weight, x["teacher_hidden"], teacher_weight(), x["labels"],
            student_transform=CAPPED, teacher_transform=LogitTransform(scale=0.5),
        )  # fmt: skip
        return torch.stack([kd, ce]), 0.7 * kd + 0.3 * ce

    cases.update(ce_capped=ce_capped, logprobs_capped=logprobs_capped)
    cases.update(entropy_capped=entropy_capped, kd_capped=kd_capped)
    return cases


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    x = _inputs()
    sharded = lambda w: distribute_tensor(w, mesh, [Shard(0)])  # noqa: E731
    replicated = lambda w: distribute_tensor(w, mesh, [Replicate()])  # noqa: E731
    teacher = sharded(x["teacher_weight"])
    results = {
        name: _run(fn, x["hidden"], x["weight"], wrap_weight=sharded, guard=_no_gather())
        for name, fn in _cases(x, lambda: teacher).items()
    }
    assert teacher.to_local().shape == (19 - rank, TEACHER_HIDDEN)  # uneven shards
    # a whole (plain) teacher head beside a sharded student
    whole = _cases(x, lambda: x["teacher_weight"])["kd_reverse_T=2.0"]
    results["kd_whole_teacher"] = _run(
        whole, x["hidden"], x["weight"], wrap_weight=sharded, guard=_no_gather()
    )
    # the hidden state as a replicated DTensor; a replicated weight
    ce = _cases(x, lambda: teacher)["ce_grad_in_forward=True"]
    as_dtensor = lambda h: DTensor.from_local(h, mesh, [Replicate()], run_check=False)  # noqa: E731
    results["ce_dtensor_hidden"] = _run(
        ce, x["hidden"], x["weight"], wrap_hidden=as_dtensor, wrap_weight=sharded
    )
    results["ce_replicated_weight"] = _run(ce, x["hidden"], x["weight"], wrap_weight=replicated)
    with torch.no_grad():
        loss = LinearCrossEntropyLoss(chunk_size=CHUNK)(
            x["hidden"], sharded(x["weight"]), x["labels"]
        )
    results["ce_no_grad"] = (loss, None, None)
    try:  # 1 row over 2 ranks: rank 1 would hold none
        token_logprobs(x["hidden"], sharded(x["weight"][:1]), x["labels"].clamp(max=0))
        results["error"] = ""
    except ValueError as error:
        results["error"] = str(error)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_worker, 2, 2)


def _expected(name: str):
    x = _inputs()
    cases = _cases(x, lambda: x["teacher_weight"])
    base = {
        "kd_whole_teacher": "kd_reverse_T=2.0",
        "ce_dtensor_hidden": "ce_grad_in_forward=True",
        "ce_replicated_weight": "ce_grad_in_forward=True",
    }
    return _run(cases[base.get(name, name)], x["hidden"], x["weight"])


NAMES = [*_cases(_inputs(), lambda: None), "kd_whole_teacher", "ce_dtensor_hidden",
         "ce_replicated_weight"]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_sharded_vocabulary_equals_the_full_weight(ranks, name):
    value, grad_hidden, grad_weight = _expected(name)
    for rank in ranks:
        got_value, got_hidden, got_weight = rank[name]
        torch.testing.assert_close(got_value, value, rtol=1e-6, atol=1e-6)
        if grad_hidden is None:  # a metric: no gradient
            assert got_hidden is None and got_weight is None
            continue
        torch.testing.assert_close(got_hidden, grad_hidden, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_weight, grad_weight, rtol=1e-5, atol=1e-6)
    # the same on both ranks (each rank's hidden gradient is the full one, not its part)
    assert torch.equal(ranks[0][name][0], ranks[1][name][0])
    if grad_hidden is not None:
        assert torch.equal(ranks[0][name][1], ranks[1][name][1])


def test_the_values_are_not_trivial():
    """Entropies, log-probs and every KD kind differ from 0 and between kinds (so the
    comparisons above can fail); the hidden gradients do not vanish."""
    values = {name: _expected(name) for name in NAMES}
    assert (values["entropy"][0][_inputs()["mask"]] > 0.1).all()
    assert (values["logprobs"][0][_inputs()["mask"]] < 0).all()
    kd = [values[f"kd_{kind}_T=2.0"][0][0] for kind in KD_KINDS]
    assert len({round(float(v), 4) for v in kd}) == len(KD_KINDS) and min(kd) > 0
    for name in ("ce_grad_in_forward=True", "logprobs", "kd_js_T=2.0"):
        assert values[name][1].abs().sum() > 0.1
    x = _inputs()  # some of the trained tokens are right, so the sharded count can differ
    logits, trained = x["hidden"] @ x["weight"].T, x["mask"]
    right = int(((logits.argmax(-1) == x["labels"]) & trained).sum())
    assert values["ce_grad_in_forward=True"][0][1] == right > 0


def test_no_grad_loss_and_a_rankless_shard_is_refused(ranks):
    x = _inputs()
    full = LinearCrossEntropyLoss(chunk_size=CHUNK)(x["hidden"], x["weight"], x["labels"])
    for rank in ranks:
        torch.testing.assert_close(rank["ce_no_grad"][0], full, rtol=1e-6, atol=0)
        assert "vocabulary of 1 rows sharded over 2 ranks" in rank["error"]
