"""The memory planner's estimate against the measured peak of real training steps (the CPU
allocator's peak, `AllocatedBytes`), for the memory switches one at a time and together; the
live-tensor counter itself; and the preflight step (measures, changes nothing)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from tunesmith.models import (
    gemma2,
    gemma3,
    glm4,
    granite,
    llama3,
    olmo2,
    olmo3,
    phi3,
    qwen3,
    smollm3,
)
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.modules.masks import document_causal_mask
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward
from tunesmith.training.memory.planner import estimate_memory, optimizer_kind
from tunesmith.training.memory.preflight import longest_batch, preflight
from tunesmith.training.memory.usage import AllocatedBytes, LiveTensorBytes, storage_bytes

# Activations dominate this one (4 layers, 4 x 64 tokens) ...
ACTIVATION_HEAVY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    num_hidden_layers=4,
)
# ... and weights, gradients and optimizer states this one (vocab 4096, 1 x 32 tokens).
PARAM_HEAVY = dict(
    hidden_size=128,
    intermediate_size=344,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
    num_hidden_layers=2,
)

CONFIGS = {
    "full": {},
    "packed": {"packed": True},
    "checkpoint_full": {"activation_checkpointing": "full"},
    "checkpoint_selective": {"activation_checkpointing": "selective"},
    "linear_ce": {"loss": "linear"},
    "optimizer_in_backward": {"optimizer_in_backward": True},
    "bf16_autocast": {"mixed_precision": "bf16"},
    "fused_adamw": {"optimizer": "adamw_fused"},
    "all_together": {"activation_checkpointing": "full", "loss": "linear",
                     "optimizer_in_backward": True},
}  # fmt: skip


def _build(dims, family=llama3, name="llama3_tiny"):
    torch.manual_seed(0)
    return getattr(family, name)(**dims)


def measured_peak(model, batch_size, seq_len, steps=2, **switches) -> int:
    """Weights plus the allocator's peak over ``steps`` AdamW training steps."""
    model = copy.deepcopy(model)
    if switches.get("activation_checkpointing"):
        apply_activation_checkpointing(model, mode=switches["activation_checkpointing"])
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    labels = ids.roll(-1, dims=1)
    labels[:, :2] = -100
    kwargs = {}
    if switches.get("packed"):
        docs = (torch.arange(seq_len) >= seq_len // 2).long().expand(batch_size, -1)
        kwargs["attention_mask"] = document_causal_mask(docs)
    linear = switches.get("loss") == "linear"
    loss_fn = LinearCrossEntropyLoss() if linear else CrossEntropyLoss()
    params = list(model.parameters())
    dtype = torch.bfloat16 if switches.get("mixed_precision") else None
    fused = switches.get("optimizer") == "adamw_fused"
    with AllocatedBytes() as mem:
        if switches.get("optimizer_in_backward"):
            opt = OptimizerInBackward(params, partial(torch.optim.AdamW, lr=1e-3, fused=fused))
        else:
            opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
        for _ in range(steps):
            with torch.autocast("cpu", dtype, enabled=dtype is not None):
                if linear:
                    hidden = model(ids, return_hidden_states=True, **kwargs)
                    loss = loss_fn(hidden, model.lm_head.weight, labels)
                else:
                    loss = loss_fn(model(ids, **kwargs), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return storage_bytes(params) + mem.peak


def _estimate(model, batch_size, seq_len, **switches):
    return estimate_memory(model, batch_size=batch_size, seq_len=seq_len, **switches).total


@pytest.fixture(scope="module")
def one_thread():
    """Module fixtures run before the suite's per-test single-thread fixture: set it here."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def activation_heavy(one_thread):
    model = _build(ACTIVATION_HEAVY)
    return {
        name: (measured_peak(model, 4, 64, **sw), _estimate(model, 4, 64, **sw))
        for name, sw in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def param_heavy(one_thread):
    model = _build(PARAM_HEAVY)
    names = ["full", "checkpoint_full", "optimizer_in_backward", "all_together", "fused_adamw"]
    return {
        n: (measured_peak(model, 1, 32, **CONFIGS[n]), _estimate(model, 1, 32, **CONFIGS[n]))
        for n in names
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_estimate_is_close_to_the_measured_peak(activation_heavy, name):
    measured, estimated = activation_heavy[name]
    assert 0.75 * measured <= estimated <= 1.25 * measured, (name, measured, estimated)


def test_estimate_orders_the_switches_like_the_measurement(activation_heavy, param_heavy):
    for results in (activation_heavy, param_heavy):
        by_measured = sorted(results, key=lambda n: results[n][0])
        by_estimate = sorted(results, key=lambda n: results[n][1])
        # only pairs the measurement tells apart by more than 5% must be in the same order
        for i, a in enumerate(by_measured):
            for b in by_measured[i + 1 :]:
                if results[b][0] > 1.05 * results[a][0]:
                    assert by_estimate.index(a) < by_estimate.index(b), (a, b, results)
    # the switches save memory where they should
    assert activation_heavy["checkpoint_full"][0] < 0.7 * activation_heavy["full"][0]
    assert activation_heavy["linear_ce"][0] < activation_heavy["full"][0]
    assert param_heavy["optimizer_in_backward"][0] < 0.95 * param_heavy["full"][0]
    assert param_heavy["fused_adamw"][0] < param_heavy["full"][0]  # no step scratch
    for name in ("full", "optimizer_in_backward", "all_together", "fused_adamw"):
        measured, estimated = param_heavy[name]
        assert 0.75 * measured <= estimated <= 1.25 * measured, (name, measured, estimated)


@pytest.mark.parametrize(
    ("family", "seq"),
    [(qwen3, 32), (gemma2, 128), (gemma3, 32), (olmo2, 32), (olmo3, 32), (granite, 32),
     (smollm3, 32), (phi3, 32), (glm4, 32)],
    ids=lambda x: getattr(x, "__name__", str(x)).rsplit(".", 1)[-1],
)  # fmt: skip
def test_estimate_covers_every_family(family, seq):
    """qk-norms, sandwich and post norms, Gemma 2's written-out soft-capped scores (longer
    rows: the s x s term dominates), fused-on-disk projections: within 25% of measured."""
    name = family.__name__.rsplit(".", 1)[-1]
    model = _build({}, family, f"{name}_tiny")
    measured, estimated = measured_peak(model, 2, seq), _estimate(model, 2, seq)
    assert 0.75 * measured <= estimated <= 1.25 * measured


def test_plan_terms_follow_the_configuration():
    model = _build(ACTIVATION_HEAVY)
    params = sum(p.numel() for p in model.parameters())
    plan = estimate_memory(model, batch_size=2, seq_len=16)
    assert plan.weights == 4 * params and plan.gradients == 4 * params
    assert plan.optimizer_states == 8 * params  # AdamW: two fp32 moments
    assert estimate_memory(model, batch_size=2, seq_len=16, optimizer="sgd").optimizer_states == 0
    eight_bit = estimate_memory(model, batch_size=2, seq_len=16, optimizer="adamw8bit")
    assert 2 * params <= eight_bit.optimizer_states < 2.1 * params
    sharded = estimate_memory(model, batch_size=2, seq_len=16, world_size=4)
    assert sharded.optimizer_states == plan.optimizer_states // 4
    longer = estimate_memory(model, batch_size=2, seq_len=32)
    assert longer.activations == 2 * plan.activations  # linear in tokens (no mask)
    vocab = model.spec.vocab_size
    chunked = {
        rows: estimate_memory(
            model, batch_size=2, seq_len=32, loss=LinearCrossEntropyLoss(chunk_size=rows)
        ).logits
        for rows in (8, 16, 64)
    }
    assert chunked[64] - chunked[16] == 4 * vocab * (64 - 16)  # one float32 chunk of logits
    # the default chunking: 8 chunks of the 64 rows (a small head: no minimum chunk size)
    assert estimate_memory(model, batch_size=2, seq_len=32, loss="linear").logits == chunked[8]
    for p in model.parameters():  # frozen base (LoRA-like): no gradients or states for it
        p.requires_grad_(False)
    frozen = estimate_memory(model, batch_size=2, seq_len=16)
    assert frozen.gradients == frozen.optimizer_states == 0
    table = plan.table()
    assert "activations" in table and "estimated peak" in table and "batch 2 x seq 16" in table


def test_optimizer_kinds_and_bad_input():
    assert optimizer_kind("torch.optim.AdamW") == "adamw"
    assert optimizer_kind("torch.optim.AdamW", {"fused": True}) == "adamw_fused"
    assert optimizer_kind("bitsandbytes.optim.AdamW8bit") == "adamw8bit"
    assert optimizer_kind("torchao.optim.AdamW4bit") == "adamw4bit"
    assert optimizer_kind("torch.optim.SGD", {"momentum": 0.9}) == "sgd_momentum"
    model = _build(ACTIVATION_HEAVY)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory(model, batch_size=1, seq_len=8, optimizer="lion")
    with pytest.raises(ValueError, match="full or selective"):
        estimate_memory(model, batch_size=1, seq_len=8, activation_checkpointing="some")
    with pytest.raises(ValueError, match="needs a model with a .spec"):
        estimate_memory(torch.nn.Linear(2, 2), batch_size=1, seq_len=8)


# -- the counter ---------------------------------------------------------------------------------


def test_live_tensor_counter_counts_new_storages_only():
    weight = torch.randn(1000)
    with LiveTensorBytes() as mem:
        view = weight[:10]
        weight.add_(1.0)
        transposed = weight[None].t()
        assert mem.peak == 0  # views and in-place results of older tensors are not new memory
        doubled = weight * 2
        assert mem.current == 4000
        del doubled
        assert mem.current == 0 and mem.peak == 4000
    assert view.shape == (10,) and transposed.shape == (1000, 1)


# -- preflight -----------------------------------------------------------------------------------


def test_longest_batch_takes_the_longest_items():
    items = [{"input_ids": [1] * n, "labels": [-100] * (n - 1) + [1]} for n in (3, 9, 5, 9, 2)]
    batch = longest_batch(items, 3, lambda b: [len(i["input_ids"]) for i in b])
    assert batch == [9, 9, 5]
    packs = [
        {"input_ids": [0] * 4, "labels": [-100] * 4, "document_ids": d}
        for d in ([0, 0, -1, -1], [0, 1, 1, 1], [0, -1, -1, -1])
    ]
    assert longest_batch(packs, 1, lambda b: b)[0]["document_ids"] == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="fewer than batch_size 9"):
        longest_batch(items, 9, list)
    pairs = [
        {
            "chosen_input_ids": [1] * c,
            "chosen_labels": [1] * c,
            "rejected_input_ids": [1] * r,
            "rejected_labels": [1] * r,
            "prompt_len": 1,
        }
        for c, r in ((2, 9), (6, 6), (3, 3))
    ]
    assert longest_batch(pairs, 1, lambda b: b)[0]["chosen_input_ids"] == [1] * 6  # 12 tokens


@pytest.mark.parametrize("free_grads", [False, True])
def test_preflight_measures_and_changes_nothing(free_grads):
    model = _build(PARAM_HEAVY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 4096, (1, 32))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    rng = torch.get_rng_state()

    def loss_fn(b):
        return CrossEntropyLoss()(torch.nn.functional.dropout(model(b["input_ids"])), b["labels"])

    report = preflight(model, batch, loss_fn, device="cpu", free_grads_in_backward=free_grads)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew numbers inside, not here
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert report.batch_shape == (1, 32)
    assert report.resident_bytes == storage_bytes([*model.parameters(), *model.buffers()])
    plan = estimate_memory(model, batch_size=1, seq_len=32, optimizer_in_backward=free_grads)
    # without optimizer states, the preflight peak is the weights plus the backward phase,
    # where all gradients exist at the end (unless each is dropped as it is complete)
    expected = plan.weights + max(plan.backward_peak, 0 if free_grads else plan.gradients)
    assert 0.75 * expected <= report.peak_bytes <= 1.25 * expected
    assert "measured" in report.summary(plan) and "estimated" in report.summary(plan)
