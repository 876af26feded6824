"""An adapted ``lm_head`` under a loss that owns the projection: ``head_weight(model)`` is the
weight the head multiplies by, so linear cross-entropy equals full-logits cross-entropy in value
and in every adapter gradient (before, the adapter on the head was silently left out)."""

from __future__ import annotations

import pytest
import torch

from tunesmith.models import build_model
from tunesmith.models.zoo import llama3
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.modules.peft.apply import apply_lora, trainable_parameters
from tunesmith.training.forward import head_weight


def _adapted(use_dora: bool, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(llama3.spec("llama3_tiny", vocab_size=97))
    apply_lora(
        model,
        target_modules=["q_proj", "lm_head"],
        rank=2,
        alpha=4,
        use_dora=use_dora,
        dropout=dropout,
    )
    for name, param in trainable_parameters(model).items():  # B != 0: the head moves
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_linear_ce_on_an_adapted_head_equals_full_logits(use_dora):
    model = _adapted(use_dora)
    ids = torch.randint(0, 97, (2, 9))
    labels = torch.randint(0, 97, (2, 9))
    labels[0, :3] = -100
    plain = CrossEntropyLoss()(model(ids), labels)
    plain.backward()
    expected = {n: p.grad.clone() for n, p in trainable_parameters(model).items()}
    model.zero_grad()
    hidden = model(ids, return_hidden_states=True)
    linear = LinearCrossEntropyLoss(num_chunks=2)(hidden, head_weight(model), labels)
    linear.backward()
    torch.testing.assert_close(linear, plain, rtol=1e-6, atol=1e-6)
    assert any("lm_head" in n for n in expected)
    for name, param in trainable_parameters(model).items():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=2e-6, msg=name)


def test_head_adapter_with_dropout_is_refused_by_a_loss_that_owns_the_head():
    model = _adapted(use_dora=False, dropout=0.1).train()
    with pytest.raises(ValueError, match="dropout 0.1 has no single weight"):
        head_weight(model)
