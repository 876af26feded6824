"""The memory planner on the transformers backend (a ``TransformersLM``): weights, gradients and
optimizer states are its parameters' bytes exactly; activations are estimated from the config
sizes as a generic llama-like layer, and the plan says so.

Measured as :mod:`tests.memory.test_memory_planner` measures the native families: the
activations are the bytes of the tensors a forward creates and keeps for backward
(``LiveTensorBytes`` after the forward, as in ``tests/memory/test_activations.py``), the step's
peak the weights plus the CPU allocator's peak over two AdamW training steps
(``AllocatedBytes``). The stated factors:

- StarCoder 2 (a plain GELU MLP ``c_fc``/``c_proj``, LayerNorms with bias): the generic layer's
  gated MLP keeps ``4*a*I`` per token where this one keeps ``2*a*I``, so the activation
  estimate is at least the measurement and at most twice it; the whole step within 0.5x-2x.
- Llama built by transformers (the layer the generic estimate describes): within 25% (the
  native families' band).
- Mixtral (routed experts: ``top_k`` experts' MLPs per token): within 0.5x-2x.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tunesmith.models.transformers_backend import (
    TransformersLM,
    TransformersSpec,
    build_transformers_model,
    tiny_config,
)
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory.planner import estimate_memory
from tunesmith.training.memory.usage import AllocatedBytes, LiveTensorBytes, storage_bytes

BASIS = (
    "activations (estimated from config sizes as a generic llama-like layer; transformers backend)"
)

# Activations dominate (4 layers, 4 x 64 tokens), as test_memory_planner's ACTIVATION_HEAVY.
SIZES = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, num_hidden_layers=4)  # fmt: skip
BATCH, SEQ = 4, 64

# model_type -> (config overrides, (low, high) bounds of estimate / measured activations)
CASES = {
    "starcoder2": ({}, (1.0, 2.0)),
    "llama": ({}, (0.75, 1.25)),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, (0.5, 2.0)),
}


def _model(model_type: str, **overrides) -> TransformersLM:
    torch.manual_seed(0)
    model = build_transformers_model(tiny_config(model_type, **overrides))
    assert isinstance(model, TransformersLM) and model.spec.backend == "transformers"
    return model.train()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def measured_activations(model: TransformersLM) -> int:
    """Bytes a forward creates and keeps for backward (and its hidden-state output)."""
    with LiveTensorBytes() as mem:
        hidden = model(_ids(model.spec.vocab_size), return_hidden_states=True)
        kept = mem.current
    assert hidden.requires_grad
    return kept


def measured_peak(model: TransformersLM, steps: int = 2) -> int:
    """Weights plus the allocator's peak over ``steps`` AdamW steps (linear cross-entropy)."""
    model = copy.deepcopy(model)
    ids = _ids(model.spec.vocab_size)
    labels = ids.roll(-1, dims=1)
    labels[:, :2] = -100
    params = list(model.parameters())
    with AllocatedBytes() as mem:
        opt = torch.optim.AdamW(params, lr=1e-3)
        for _ in range(steps):
            hidden = model(ids, return_hidden_states=True)
            LinearCrossEntropyLoss()(hidden, model.lm_head.weight, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return storage_bytes(params) + mem.peak


def test_weights_gradients_and_states_are_the_parameters_bytes():
    model = _model("starcoder2")
    params = dict(model.named_parameters())  # a tied head once
    assert any(n.endswith("bias") for n in params)  # StarCoder 2: biases, LayerNorms with bias
    total = sum(p.numel() * p.element_size() for p in params.values())
    assert total == 4 * model.spec.approx_parameters()
    plan = estimate_memory(model, batch_size=2, seq_len=16, optimizer="adamw")
    assert plan.weights == plan.gradients == total
    assert plan.optimizer_states == 2 * total  # AdamW: two moments of each parameter
    # a frozen part has no gradient nor state; weights are still all of it
    frozen = [p for n, p in params.items() if ".layers.0." in n]
    for p in frozen:
        p.requires_grad_(False)
    trainable = total - sum(p.numel() * p.element_size() for p in frozen)
    plan = estimate_memory(model, batch_size=2, seq_len=16, optimizer="adamw")
    assert plan.weights == total and plan.gradients == trainable < total
    assert plan.optimizer_states == 2 * trainable


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_activation_estimate_within_its_factor_of_measured(model_type):
    overrides, (low, high) = CASES[model_type]
    model = _model(model_type, **SIZES, **overrides)
    plan = estimate_memory(model, batch_size=BATCH, seq_len=SEQ, loss="linear")
    measured = measured_activations(model)
    assert low * measured <= plan.activations <= high * measured, (measured, plan.activations)
    peak = measured_peak(model)
    assert 0.5 * peak <= plan.total <= 2 * peak, (peak, plan.total)


def test_the_plan_states_its_basis():
    model = _model("starcoder2")
    table = estimate_memory(model, batch_size=2, seq_len=16).table()
    assert table.startswith("memory plan: batch 2 x seq 16")
    assert table.splitlines()[-1].strip() == BASIS
    # a model with routed experts is priced with its top-k experts' MLPs
    dense = _model("llama", **SIZES)
    moe = _model("mixtral", **SIZES, num_local_experts=4, num_experts_per_tok=2)
    per_layer = {
        m: estimate_memory(m, batch_size=1, seq_len=8).activations_per_token_layer
        for m in (dense, moe)
    }
    assert per_layer[moe] > 1.5 * per_layer[dense]


def test_missing_config_sizes_are_named():
    spec = TransformersSpec({"model_type": "custom", "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 4})  # fmt: skip
    model = _model("starcoder2")
    model.spec = spec
    with pytest.raises(ValueError, match="custom has no intermediate_size"):
        estimate_memory(model, batch_size=1, seq_len=8)
