"""``token_accuracy``: the trained tokens whose label is the model's argmax, counted by both
token losses (``count_correct=True``; the chunked one inside its chunks, without full logits),
equals ``argmax(full logits) == labels`` counted the plain way over the positions not
``ignore_index``, for every chunking, with and without a gradient, with a logit transform;
counting changes neither the loss nor its gradients. In training the SFT objective reports it
as a share of the step's trained tokens over every data-parallel rank (2 gloo ranks with
different token counts report the share of the whole batch, not a mean of their shares)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.gloo_world import run_on_ranks
from tunesmith.models.builder import build_model
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import IGNORE_INDEX, CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.objectives import TokenCrossEntropy
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.trainer import Trainer

VOCAB, HIDDEN = 23, 8


def _world(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, a head, and labels that are the argmax at every third position, another
    token elsewhere, ``ignore_index`` on a prompt and on padding; and the full logits."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 11, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    logits = hidden @ weight.T
    best = logits.argmax(-1)
    positions = torch.arange(11).expand(3, 11)
    labels = torch.where(positions % 3 == 0, best, (best + 1) % VOCAB)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[2, -3:] = IGNORE_INDEX  # padding
    return hidden, weight, labels, logits


def _plain(logits: torch.Tensor, labels: torch.Tensor) -> int:
    trained = labels != IGNORE_INDEX
    return int(((logits.argmax(-1) == labels) & trained).sum())


def test_the_world_has_tokens_right_and_wrong():
    _, _, labels, logits = _world()
    trained = int((labels != IGNORE_INDEX).sum())
    assert 0 < _plain(logits, labels) < trained


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
@pytest.mark.parametrize("grad", [True, False])
def test_chunked_count_equals_the_full_logits_argmax(chunk_size, grad):
    hidden, weight, labels, logits = _world()
    hidden = hidden.clone().requires_grad_(grad)
    loss_fn = LinearCrossEntropyLoss(chunk_size=chunk_size)
    loss, correct = loss_fn(hidden, weight, labels, count_correct=True)
    assert correct.dtype == torch.int64 and not correct.requires_grad
    assert int(correct) == _plain(logits, labels)
    torch.testing.assert_close(loss, loss_fn(hidden, weight, labels))


def test_counting_leaves_the_loss_and_its_gradients_as_they_are():
    hidden, weight, labels, _ = _world(1)
    grads = []
    for count in (False, True):
        for grad_in_forward in (True, False):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss_fn = LinearCrossEntropyLoss(chunk_size=5, grad_in_forward=grad_in_forward)
            out = loss_fn(h, w, labels, count_correct=count)
            (out[0] if count else out).backward()
            grads.append((out[0] if count else out, h.grad, w.grad))
    for loss, grad_h, grad_w in grads[1:]:
        assert torch.equal(loss, grads[0][0])
        torch.testing.assert_close(grad_h, grads[0][1], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad_w, grads[0][2], rtol=1e-6, atol=1e-7)


def test_a_transformed_head_counts_the_transformed_argmax():
    hidden, weight, labels, logits = _world(2)
    capped = LogitTransform(scale=0.5, softcap=2.0)  # monotone: the argmax stays
    _, correct = LinearCrossEntropyLoss(chunk_size=4)(
        hidden, weight, labels, transform=capped, count_correct=True
    )
    assert int(correct) == _plain(capped(logits), labels)


def test_full_logits_loss_counts_the_same_and_a_batch_with_nothing_trained_counts_zero():
    hidden, weight, labels, logits = _world(3)
    loss, correct = CrossEntropyLoss()(logits, labels, count_correct=True)
    assert int(correct) == _plain(logits, labels)
    torch.testing.assert_close(loss, CrossEntropyLoss()(logits, labels))
    nothing = torch.full_like(labels, IGNORE_INDEX)
    _, none_right = LinearCrossEntropyLoss()(hidden, weight, nothing, count_correct=True)
    assert int(none_right) == 0


# -- the SFT objective on two data-parallel ranks -----------------------------------------------

SPEC = ModelSpec(
    model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
)  # fmt: skip
TRAINED = (10, 3)  # trained tokens of rank 0's and rank 1's batch: unequal on purpose


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(SPEC)


def _batches() -> list[dict[str, torch.Tensor]]:
    """Rank 0's and rank 1's batch: labels the model's argmax at every other trained position
    of rank 0's batch and at none of rank 1's."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 2, 12), generator=gen)
    with torch.no_grad():
        best = _model()(ids.flatten(0, 1), position_ids=torch.arange(12).expand(4, 12))
        best = best.argmax(-1).reshape(2, 2, 12)
    batches = []
    for rank, count in enumerate(TRAINED):
        labels = (best[rank] + 1) % VOCAB  # wrong everywhere ...
        if rank == 0:
            labels[:, ::2] = best[rank][:, ::2]  # ... but every other position of rank 0
        keep = torch.zeros(2 * 12, dtype=torch.bool)
        keep[torch.randperm(24, generator=gen)[:count]] = True
        labels = torch.where(keep.reshape(2, 12), labels, IGNORE_INDEX)
        batches.append({"input_ids": ids[rank], "labels": labels,
                        "position_ids": torch.arange(12).expand(2, 12)})  # fmt: skip
    return batches


def _trainer(out: Path, ctx: DistributedContext) -> Trainer:
    cfg = OmegaConf.create({
        "output_dir": str(out), "batch_size": 2, "max_steps": 1,
        "optimizer": {"_component_": "torch.optim.SGD", "lr": 0.0},
        "lr_scheduler": {"_component_": "tunesmith.training.cosine_with_warmup",
                         "num_warmup_steps": 0},
    })  # fmt: skip
    objective = TokenCrossEntropy(LinearCrossEntropyLoss(chunk_size=3))
    return Trainer.from_config(cfg, ctx, model=_model(), objective=objective)


def _rank(rank: int, out: str) -> float:
    ctx = DistributedContext(
        rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), mesh=None
    )
    return _trainer(Path(out) / str(rank), ctx).step([_batches()[rank]])["token_accuracy"]


def test_two_ranks_report_the_share_of_the_whole_batch(tmp_path):
    batches = _batches()
    assert [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches] == list(TRAINED)
    with torch.no_grad():
        model = _model()
        right = [
            _plain(model(b["input_ids"], position_ids=b["position_ids"]), b["labels"])
            for b in batches
        ]
    assert right[0] > 0 and right[1] == 0  # so a mean of the ranks' shares would differ
    expected = sum(right) / sum(TRAINED)
    ranks = run_on_ranks(_rank, 2, str(tmp_path))
    assert ranks == [pytest.approx(expected, rel=1e-12)] * 2
    ctx = DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None
    )
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    one = _trainer(tmp_path / "one", ctx).step([whole])["token_accuracy"]
    assert one == pytest.approx(expected, rel=1e-12)
