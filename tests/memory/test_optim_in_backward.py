"""Optimizer in backward == ordinary optimizer step (same parameters after N steps), with LR
schedules, parameter groups, tied weights, save/resume (torch.save and the recipe's
distributed Checkpointer) and FSDP2 on two gloo ranks."""

from __future__ import annotations

import copy
import io
import warnings
from functools import partial

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tunesmith.config import ConfigError
from tunesmith.models import llama3
from tunesmith.modules.decoder import TransformerLM
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training import cosine_with_warmup
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward, check_compatible
from tunesmith.training.parallel.distributed import (
    DistributedContext,
    close_distributed,
    full_tensor,
    init_distributed,
)

ADAMW = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _batches(n, seed=0, vocab=256, shape=(2, 12)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=gen) for _ in range(n)]


def _loss(model, input_ids):
    labels = input_ids.roll(-1, dims=1)
    return CrossEntropyLoss()(model(input_ids), labels) / labels.numel()


def _train(model, optimizer, scheduler, batches, in_backward):
    lrs = []
    for input_ids in batches:
        _loss(model, input_ids).backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
    return lrs


def _schedule(optimizer):
    return cosine_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=6)


@pytest.mark.parametrize("tied", [False, True])
def test_same_parameters_as_ordinary_optimizer_with_cosine_schedule(tied):
    torch.manual_seed(0)
    reference = llama3.llama3_tiny(tie_word_embeddings=tied)
    model = copy.deepcopy(reference)
    ordinary = ADAMW(reference.parameters())
    in_backward = OptimizerInBackward(model.parameters(), ADAMW)
    assert len(in_backward.optimizers) == len(list(model.parameters()))

    batches = _batches(6)
    expected_lrs = _train(reference, ordinary, _schedule(ordinary), batches, False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lrs = _train(model, in_backward, _schedule(in_backward), batches, True)
    # the scheduler must not warn that it stepped before the optimizer
    assert not [w for w in record if "optimizer.step()" in str(w.message)]

    assert lrs == expected_lrs and lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-2)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
        assert p.grad is None
    assert not torch.equal(model.lm_head.weight, llama3.llama3_tiny().lm_head.weight)


def test_parameter_groups_keep_their_options():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(reference)

    def groups(m):
        return [
            {"params": [m[0].weight, m[2].weight], "weight_decay": 0.5},
            {"params": [m[0].bias, m[2].bias], "lr": 0.3},
        ]

    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.0)
    ordinary = sgd(groups(reference))
    in_backward = OptimizerInBackward(groups(model), sgd)
    assert [g["lr"] for g in in_backward.param_groups] == [0.1, 0.1, 0.3, 0.3]
    x = torch.randn(5, 8)
    for _ in range(4):
        reference(x).square().sum().backward()
        ordinary.step()
        ordinary.zero_grad()
        model(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_no_gradient_outlives_its_update():
    """A later hook on each parameter sees no gradient anywhere in the model: each one was
    freed right after its own update, while the backward pass was still running."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    OptimizerInBackward(model.parameters(), ADAMW)
    params = list(model.parameters())
    alive = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad is not None for q in params))
        )
    _loss(model, _batches(1)[0]).backward()
    assert len(alive) == len(params) and set(alive) == {0}


def test_frozen_parameters_are_left_alone():
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    bias = model.bias.detach().clone()
    opt = OptimizerInBackward(model.parameters(), partial(torch.optim.SGD, lr=0.1))
    assert len(opt.optimizers) == 1
    model(torch.randn(2, 4)).sum().backward()
    assert torch.equal(model.bias, bias)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        OptimizerInBackward([model.bias], partial(torch.optim.SGD, lr=0.1))


def test_remove_hooks_leaves_gradients_in_place():
    model = torch.nn.Linear(4, 3)
    opt = OptimizerInBackward(model.parameters(), partial(torch.optim.SGD, lr=0.1))
    opt.remove_hooks()
    before = model.weight.detach().clone()
    model(torch.randn(2, 4)).sum().backward()
    assert model.weight.grad is not None and torch.equal(model.weight, before)
    opt.step()  # the explicit step still works and uses the leftover gradients
    assert not torch.equal(model.weight, before)


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = llama3.llama3_tiny()
    opt = OptimizerInBackward(model.parameters(), ADAMW)
    return model, opt, _schedule(opt)


def test_state_dict_resume_equals_uninterrupted_run():
    batches = _batches(6)
    model, opt, sched = _fresh()
    _train(model, opt, sched, batches, True)

    first, first_opt, first_sched = _fresh()
    _train(first, first_opt, first_sched, batches[:3], True)
    buffer = io.BytesIO()
    torch.save(
        {
            "model": first.state_dict(),
            "optimizer": first_opt.state_dict(),
            "scheduler": first_sched.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert sorted(saved["optimizer"]["state"]) == list(range(len(first_opt.optimizers)))

    resumed, resumed_opt, resumed_sched = _fresh(seed=1)  # different init: all must load
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    resumed_sched.load_state_dict(saved["scheduler"])
    _train(resumed, resumed_opt, resumed_sched, batches[3:], True)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)

    control, control_opt, control_sched = _fresh(seed=1)  # without the optimizer state
    control.load_state_dict(saved["model"])
    control_sched.load_state_dict(saved["scheduler"])
    _train(control, control_opt, control_sched, batches[3:], True)
    assert not all(torch.equal(p, q) for p, q in zip(control.parameters(), model.parameters()))


def test_load_state_dict_rejects_a_mismatched_state():
    _, opt, _ = _fresh()
    other = ADAMW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="holds 21 parameters"):
        opt.load_state_dict(other.state_dict())


@pytest.fixture
def ctx():
    context = init_distributed("cpu")
    yield context
    close_distributed()


def test_distributed_checkpointer_resume_equals_uninterrupted_run(ctx, tmp_path):
    """The recipe's Checkpointer (get/set_optimizer_state_dict + dcp.save/load) takes the
    wrapper as it takes any optimizer; its state is keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    batches = _batches(6)
    model, opt, sched = _fresh()
    _train(model, opt, sched, batches, True)

    first, first_opt, first_sched = _fresh()
    _train(first, first_opt, first_sched, batches[:3], True)
    named = get_optimizer_state_dict(first, first_opt)
    assert set(named["state"]) == {name for name, _ in first.named_parameters()}
    checkpointer = Checkpointer(tmp_path, ctx)
    path = checkpointer.save(3, first, first_opt, {"scheduler": first_sched}, {"step": 3})

    resumed, resumed_opt, resumed_sched = _fresh(seed=1)
    checkpointer.load(path, resumed, resumed_opt, {"scheduler": resumed_sched})
    _train(resumed, resumed_opt, resumed_sched, batches[3:], True)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_check_compatible_names_every_offending_key():
    check_compatible(1, None)
    check_compatible(1, 0.0, on_nonfinite_loss="stop")
    with pytest.raises(ConfigError) as info:
        check_compatible(4, 1.0, on_nonfinite_loss="skip")
    message = str(info.value)
    for key in (
        "gradient_accumulation_steps: is 4",
        "max_grad_norm: is 1.0",
        "on_nonfinite_loss: is 'skip'",
    ):
        assert key in message
    assert [issue.path for issue in info.value.issues] == [
        "gradient_accumulation_steps",
        "max_grad_norm",
        "on_nonfinite_loss",
    ]


# -- FSDP2 on two gloo ranks ---------------------------------------------------------------------


class _HiddenStatesLM(TransformerLM):
    """The model with the forward a recipe needs for a loss that owns the projection: the
    root module's forward (so FSDP2 gathers the root's parameters) returning hidden states."""

    def forward(self, input_ids, *, hidden_only=False, **kwargs):
        return self.model(input_ids, **kwargs) if hidden_only else super().forward(input_ids)


def _train_linear_ce(model, optimizer, scheduler, batches):
    loss_fn = LinearCrossEntropyLoss(num_chunks=3)
    for input_ids in batches:
        labels = input_ids.roll(-1, dims=1)
        hidden = model(input_ids, hidden_only=True)
        # after the root's forward FSDP2 leaves its parameters gathered until backward
        (loss_fn(hidden, model.lm_head.weight, labels) / labels.numel()).backward()
        scheduler.step()


def _fsdp_worker(rank: int, world_size: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    batches = _batches(3, shape=(2 * world_size, 12))
    # each rank its half of the global batch; FSDP averages gradients over ranks
    local = [b[rank * 2 : rank * 2 + 2] for b in batches]
    ctx = DistributedContext(rank, world_size, rank, torch.device("cpu"), mesh)

    def build(seed=0, checkpointing=False):
        torch.manual_seed(seed)
        model = llama3.llama3_tiny()
        model.__class__ = _HiddenStatesLM
        if checkpointing:
            apply_activation_checkpointing(model, mode="selective")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    finals = {}
    for run in ("ordinary", "in_backward", "in_backward+linear_ce+checkpointing", "resumed"):
        model = build(seed=1 if run == "resumed" else 0, checkpointing="linear_ce" in run)
        if run == "ordinary":
            opt = ADAMW(model.parameters())
            _train(model, opt, _schedule(opt), local, False)
        else:
            opt = OptimizerInBackward(model.parameters(), ADAMW)
            sched = _schedule(opt)
            if run == "in_backward":  # checkpoint after step 2 (sharded optimizer state)
                _train(model, opt, sched, local[:2], True)
                checkpointer = Checkpointer(f"{out_dir}/checkpoints", ctx)
                path = checkpointer.save(2, model, opt, {"scheduler": sched}, {"step": 2})
                _train(model, opt, sched, local[2:], True)
            elif run == "resumed":
                checkpointer.load(path, model, opt, {"scheduler": sched})
                _train(model, opt, sched, local[2:], True)
            else:
                _train_linear_ce(model, opt, sched, local)
            assert all(p.grad is None for p in model.parameters())
        finals[run] = {n: full_tensor(p) for n, p in model.named_parameters()}
    return finals


def test_fsdp2_two_ranks_equals_ordinary_optimizer(tmp_path):
    """FSDP2 fires each sharded parameter's hook after its reduce-scatter: every rank updates
    its shard in backward, ending where the ordinary FSDP2 step ends (and where one process
    training on the whole batch ends). The same holds with the linear cross-entropy taking
    the root's gathered ``lm_head.weight`` (and selective activation checkpointing); and a
    sharded checkpoint resumes bit for bit."""
    finals = run_on_ranks(_fsdp_worker, 2, 2, str(tmp_path))[0]
    torch.manual_seed(0)
    single = llama3.llama3_tiny()
    opt = ADAMW(single.parameters())
    _train(single, opt, _schedule(opt), _batches(3, shape=(4, 12)), False)
    for name, p in single.named_parameters():
        ordinary = finals["ordinary"][name]
        torch.testing.assert_close(finals["in_backward"][name], ordinary, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            finals["in_backward+linear_ce+checkpointing"][name], ordinary, rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(ordinary, p.detach(), rtol=1e-4, atol=1e-5)
        assert torch.equal(finals["resumed"][name], finals["in_backward"][name])
