"""Router statistics (expert load per layer, dropped tokens) against hand counts: from the
routing decision of any router, only in train mode, of real tokens only (padding left out),
once per forward even when activation checkpointing recomputes it, summarised and logged by
the Trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.models.conftest import randomize_
from tests.training.test_trainer import CTX, NextToken, config
from tunesmith.models import mixtral, zoo
from tunesmith.modules.moe import MoE
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.router_stats import (
    read_expert_loads,
    summarise_expert_loads,
    track_routing,
)
from tunesmith.training.trainer import LossOutput, Trainer


def hand_counts(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int) -> list[int]:
    """Tokens per expert of softmax top-k routing, one token at a time in plain Python."""
    counts = [0] * gate_weight.shape[0]
    for token in x.reshape(-1, x.shape[-1]).tolist():
        scores = [sum(a * b for a, b in zip(token, row)) for row in gate_weight.tolist()]
        for e in sorted(range(len(scores)), key=lambda e: -scores[e])[:top_k]:
            counts[e] += 1  # softmax keeps the order of the logits
    return counts


def hand_summary(layers: list[list[int]], dropped: int) -> dict[str, float]:
    """The statistics by their definitions, in plain Python."""
    shares = [[c / (sum(cs) / len(cs)) for c in cs] for cs in layers]
    cvs = [math.sqrt(sum((s - 1) ** 2 for s in ss) / len(ss)) for ss in shares]
    return {
        "moe_load_max": max(max(ss) for ss in shares),
        "moe_load_min": min(min(ss) for ss in shares),
        "moe_load_cv": sum(cvs) / len(cvs),
        "moe_dropped_tokens": float(dropped),
    }


def run(moe: MoE, x: torch.Tensor) -> None:
    """A forward of a lone MoE layer whose tokens are all real (as a decoder body marks them)."""
    moe.real_tokens = torch.ones(x.shape[0] * x.shape[1], dtype=torch.bool)
    moe(x)


def router_statistics(model: torch.nn.Module) -> dict[str, float]:
    return summarise_expert_loads(read_expert_loads(model))


def _assert_stats(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-12), key


def test_counts_of_softmax_top_k_equal_a_hand_count():
    torch.manual_seed(0)
    moe = MoE(8, 4, num_experts=5, top_k=2, norm_topk_prob=True).train()
    x = torch.randn(2, 7, 8)
    run(moe, x)
    run(moe, x[:, :3])  # counts add up over forwards
    moe(x)  # a forward whose tokens no body marked: not counted
    want = [a + b for a, b in zip(hand_counts(x, moe.gate.weight, 2),
                                  hand_counts(x[:, :3], moe.gate.weight, 2))]  # fmt: skip
    assert moe.routed_counts.tolist() == [*want, 0]  # then the dropped assignments
    assert sum(want) == 2 * (14 + 6)  # top-2 of 14 then 6 tokens
    _assert_stats(router_statistics(moe), hand_summary([want], 0))
    assert moe.routed_counts is None  # read and reset


class FixedRouter(MoE):
    """A router whose decision is not a top-k of its logits (as DeepSeek's biased sigmoid,
    Llama 4's top-1 or gpt-oss's are not a softmax top-k): token ``t`` goes to expert
    ``t % 3`` with weight 1, whatever the logits say."""

    def route(self, x):
        experts = (torch.arange(x.shape[0]) % 3)[:, None]
        return self.gate(x), torch.ones(x.shape[0], 1, dtype=x.dtype), experts


def test_counts_come_from_the_routing_decision_not_the_logits():
    moe = FixedRouter(8, 4, num_experts=4, top_k=1).train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[3] = 10.0  # the logits favour expert 3, which gets no token
    run(moe, torch.ones(1, 7, 8))
    assert moe.routed_counts.tolist() == [3, 2, 2, 0, 0]
    stats = router_statistics(moe)
    _assert_stats(stats, hand_summary([[3, 2, 2, 0]], 0))
    assert stats["moe_load_min"] == 0.0 and stats["moe_load_max"] == 3 / (7 / 4)


def test_eval_mode_counts_nothing():
    moe = MoE(8, 4, num_experts=3, top_k=1).eval()
    run(moe, torch.randn(1, 4, 8))
    assert moe.routed_counts is None and router_statistics(moe) == {}


def test_the_trainer_logs_the_step_routing_summed_over_micro_batches(tmp_path: Path):
    """One optimizer step of two micro-batches on a 2-layer Mixtral: the logged statistics are
    those of a hand count over both micro-batches' tokens at each layer's input."""
    model = randomize_(mixtral.mixtral_tiny(), seed=1)
    inputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].detach()))
    trainer = Trainer.from_config(config(tmp_path, max_steps=1), CTX, model=model,
                                  objective=NextToken(), source=None)  # fmt: skip
    model.train()
    model(torch.zeros(1, 3, dtype=torch.long))  # before the step: not this step's routing
    inputs[0].clear(), inputs[1].clear()
    gen = torch.Generator().manual_seed(3)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
               for ids in (torch.randint(0, 256, (2, 9), generator=gen) for _ in range(2))]  # fmt: skip
    gates = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    metrics = trainer.step(batches)
    top_k = model.spec.num_experts_per_tok
    layers = []
    for i, gate in enumerate(gates):
        assert len(inputs[i]) == 2  # one forward per micro-batch
        per_batch = [hand_counts(x, gate, top_k) for x in inputs[i]]
        layers.append([a + b for a, b in zip(*per_batch)])
        assert sum(layers[-1]) == 2 * 2 * 9 * top_k
    _assert_stats({k: v for k, v in metrics.items() if k.startswith("moe_")},
                  hand_summary(layers, 0))  # fmt: skip


def test_summary_of_layers_without_tokens_reports_only_drops():
    assert summarise_expert_loads({0: torch.tensor([0, 0, 0, 0, 2.0])}) == {
        "moe_dropped_tokens": 2.0
    }
    assert summarise_expert_loads({}) == {}


class MaskedNextToken(NextToken):
    """Next-token cross-entropy of rows with an ``attention_mask`` (padding: 0)."""

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1]
        keep = batch["attention_mask"][:, 1:].bool()
        return LossOutput(torch.nn.functional.cross_entropy(
            logits[keep], batch["input_ids"][:, 1:][keep], reduction="sum"))  # fmt: skip


def _step_loads(tmp_path: Path, batch: dict[str, torch.Tensor], checkpointed: bool):
    """One trainer step of a 2-layer Mixtral on ``batch``: (the step's expert loads per layer,
    its metrics, each layer's inputs of the step)."""
    model = randomize_(mixtral.mixtral_tiny(), seed=1)
    if checkpointed:
        apply_activation_checkpointing(model)
    inputs = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].detach()))
    trainer = Trainer.from_config(config(tmp_path, max_steps=1), CTX, model=model,
                                  objective=MaskedNextToken(), source=None)  # fmt: skip
    metrics = trainer.step([batch])
    return [load.tolist() for load in trainer.expert_loads.values()], metrics, inputs


def test_padding_is_not_counted_and_checkpointing_counts_each_forward_once(tmp_path: Path):
    """A left-padded and a right-padded row: the loads are a hand count over the real tokens
    alone, and the same with every layer checkpointed (its forward recomputed in backward)."""
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[0, 0, 0] + [1] * 5, [1] * 6 + [0, 0]])  # 11 real tokens
    batch = {"input_ids": ids, "attention_mask": mask}
    loads, metrics, inputs = _step_loads(tmp_path / "plain", batch, checkpointed=False)
    model = randomize_(mixtral.mixtral_tiny(), seed=1)  # the gates before the update
    top_k = model.spec.num_experts_per_tok
    want = []
    for layer, (x,) in zip(model.model.layers, inputs, strict=True):
        counts = hand_counts(x[mask.bool()], layer.mlp.gate.weight, top_k)
        assert sum(counts) == 11 * top_k
        want.append(counts)
    assert loads == [[*counts, 0] for counts in want]
    _assert_stats({k: v for k, v in metrics.items() if k.startswith("moe_")},
                  hand_summary(want, 0))  # fmt: skip
    checkpointed, _, recomputed = _step_loads(tmp_path / "ckpt", batch, checkpointed=True)
    assert all(len(forwards) == 2 for forwards in recomputed)  # the backward ran it again
    assert checkpointed == loads


def _tiny_moe_models() -> list[str]:
    """Every shipped family's ``*_tiny`` size that has MoE layers."""
    return [f"{family}.{size}" for family, module in sorted(zoo.FAMILY_FILES.items())
            for size in module.SIZES if size.endswith("_tiny") and module.spec(size).is_moe]  # fmt: skip


@pytest.mark.parametrize("name", _tiny_moe_models())
def test_every_moe_family_counts_each_assignment_once(name):
    """Whatever the family's router (softmax top-k, biased sigmoid with groups, top-k then
    softmax, sigmoid top-1), each MoE layer counts every token's top-k assignments."""
    family, size = name.split(".")
    model = randomize_(getattr(zoo.FAMILY_FILES[family], size)(), seed=0).train()
    assert track_routing(model) > 0
    ids = torch.randint(
        0, model.spec.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)
    )
    model(ids)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    for moe in layers:
        assert moe.routed_counts[:-1].sum() == 2 * 7 * moe.top_k
        assert moe.routed_counts[-1] == 0 and (moe.routed_counts >= 0).all()
    assert router_statistics(model)["moe_dropped_tokens"] == 0
    assert router_statistics(model) == {}  # read and reset
