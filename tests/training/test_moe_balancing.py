"""DeepSeek-V3's bias-based balancing: after each optimizer step every expert's correction bias
moves by the update rate against its load (counted by transformers' own router on the same
hidden states), outside the gradient, from the loads the router statistics count (padding
left out, activation checkpointing's recomputation counted once); through the SFT recipe it is
off unless configured."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.recipes.sft_world import checkpoints, make_counting_data, make_model_dir, run_sft
from tunesmith.config import ConfigError
from tunesmith.models.zoo import deepseek_v3, qwen3
from tunesmith.modules.routers import DeepSeekMoE, update_correction_bias
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.moe_balancing import BiasBalancing
from tunesmith.training.router_stats import read_expert_loads, track_routing

RATE = 0.01


def _hf_router(moe: DeepSeekMoE, spec) -> torch.nn.Module:
    """transformers' DeepSeek-V3 router with ``moe``'s weights and bias."""
    config = transformers.DeepseekV3Config(
        hidden_size=spec.hidden_size, n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, n_group=spec.moe_routing.n_group,
        topk_group=spec.moe_routing.topk_group, norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.moe_routing.routed_scaling_factor,
    )  # fmt: skip
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    router.weight.data.copy_(moe.gate.weight)
    router.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
    return router


def test_bias_moves_against_the_load_transformers_router_counts():
    torch.manual_seed(0)
    model = deepseek_v3.deepseek_v3_tiny(initializer_range=0.2)
    layers = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]
    assert track_routing(model) == len(layers) == 2
    inputs = {}
    for moe in layers:
        moe.register_forward_hook(lambda m, args, out: inputs.__setitem__(m, args[0].detach()))
    references = [_hf_router(moe, model.spec) for moe in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    model.train()
    model(ids).logsumexp(-1).sum().backward()
    optimizer.step()
    update_correction_bias(read_expert_loads(model), RATE)
    for moe, router in zip(layers, references, strict=True):
        chosen = router(inputs[moe])[2]
        load = torch.bincount(chosen.flatten(), minlength=moe.num_experts).float()
        expected = RATE * torch.sign(load.mean() - load)
        assert torch.equal(moe.gate.e_score_correction_bias, expected)
        assert expected.abs().sum() > 0  # an unbalanced router: the bias moved
        assert moe.gate.e_score_correction_bias.grad is None  # never a gradient
    model.eval()
    with torch.no_grad():
        model(ids)
    assert read_expert_loads(model) == {}  # read and reset; eval forwards do not count


def test_a_forward_recomputed_in_the_backward_is_counted_once():
    model = deepseek_v3.deepseek_v3_tiny().train()
    apply_activation_checkpointing(model)
    track_routing(model)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    model(ids).sum().backward()  # runs each layer's forward again
    for moe, load in read_expert_loads(model).items():
        assert int(load.sum()) == 2 * 7 * moe.top_k


def test_padding_and_packed_gaps_are_not_counted():
    model = deepseek_v3.deepseek_v3_tiny().train()
    top_k = model.spec.num_experts_per_tok
    track_routing(model)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1] * 6, [0, 0] + [1] * 4])  # 10 real tokens
    model(ids, attention_mask=mask)
    assert [int(load.sum()) for load in read_expert_loads(model).values()] == [10 * top_k] * 2
    docs = torch.tensor([[0, 0, 1, 1, 1, -1], [0] * 6])  # 11 real tokens
    model(ids, document_ids=docs)
    assert [int(load.sum()) for load in read_expert_loads(model).values()] == [11 * top_k] * 2


def test_settings_and_refusals():
    assert BiasBalancing.from_config({"moe_bias_balancing": None}) is None
    with pytest.raises(ConfigError, match="update_rate: must be a number > 0"):
        BiasBalancing.from_config({"moe_bias_balancing": {"update_rate": 0}})
    with pytest.raises(ConfigError, match="moe_bias_balancing.rate: is not a known key"):
        BiasBalancing.from_config({"moe_bias_balancing": {"rate": 0.1}})
    with pytest.raises(ConfigError, match="has none"):
        BiasBalancing().step_hook(qwen3.qwen3_tiny(device="meta"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("balancing")
    model_dir = make_model_dir(root, family=deepseek_v3, initializer_range=0.2)
    return root, model_dir, make_counting_data(root / "count.jsonl", rows=16)


def _biases(out) -> dict[str, torch.Tensor]:
    state = load_file(checkpoints(out)[-1] / "model.safetensors")
    return {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}


def test_recipe_updates_the_bias_once_per_step_only_when_configured(world, tmp_path):
    root, model_dir, data = world
    steps = ["max_steps=2", "batch_size=2", "gradient_accumulation_steps=2"]
    plain = _biases(run_sft(model_dir, data, tmp_path / "plain", *steps))
    assert all(torch.equal(b, torch.zeros_like(b)) for b in plain.values())  # off by default
    on = f"moe_bias_balancing.update_rate={RATE}"
    balanced = _biases(run_sft(model_dir, data, tmp_path / "on", *steps, on))
    assert balanced.keys() == plain.keys() and len(balanced) == 2
    for name, bias in balanced.items():
        steps_taken = bias / RATE  # two updates of +-RATE (or 0) each
        assert torch.allclose(steps_taken, steps_taken.round(), atol=1e-4)
        assert steps_taken.abs().max() <= 2 and bias.abs().sum() > 0, name
