"""The MoE families through the SFT recipe on two ranks (torchrun's way) == one process: the
logged losses, grad norms and token counts at every step and the exported weights (the harness
of tests/recipes/test_sft_expert_parallel.py), under each family's layouts (:data:`FAMILIES`):

- Mixtral (6 experts, top-3, window 8; the load-balancing term weighs, coefficient 0.1):
  ``ep 2`` within ``dp_shard 2``; the ranks read the folder's original names
  (``block_sparse_moe.experts.{i}.w1``) through the distributed load and export under them.
- DeepSeek-V3 (multi-head latent attention, shared experts, group-limited sigmoid routing with
  a correction bias): ep 2 (3 of the 6 routed experts per rank, the rest FSDP2-sharded over
  dp_shard 2), FSDP2 alone (dp_shard 2) and tensor parallel (tp 2: each rank two of the four
  heads, the latents replicated). Bias-based balancing is on: the correction biases, updated
  from the expert loads summed over the ranks, end as the single process's (they are in the
  compared weights) and moved.
- GLM-4.5 (DeepSeek-V3's MoE layers beside grouped-query attention with q/k/v biases, qk-norm
  and partial rotary): ep 2 and tensor parallel (tp 2: two of the four heads and one of the two
  kv heads per rank), bias balancing on as for DeepSeek-V3.
- gpt-oss (4 experts; aux coefficient 0.1 so it weighs): FSDP2 (dp_shard 2), with expert
  parallel (2 of the 4 experts per rank, their biases split too), or tensor parallel (tp 2:
  the heads and their sinks split).

Llama 4's runs are in tests/recipes/test_sft_llama4.py, where one process's run is also the
reference of the resume and transformers-load tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.recipes.sft_world import (
    assert_same_as_single,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    run_sft,
    sft_overrides,
)
from tunesmith.models.zoo import deepseek_v3, glm4_moe, gpt_oss, mixtral

Weights = dict[str, torch.Tensor]


def _kept_mixtral_names(weights: Weights) -> None:
    """The export is under Mixtral's own names, not the MLP ones."""
    assert "model.layers.0.block_sparse_moe.experts.5.w2.weight" in weights
    assert not any(".mlp." in name for name in weights)


def _balanced_biases(weights: Weights) -> None:
    """Both MoE layers' correction biases moved: bias balancing ran."""
    biases = [w for k, w in weights.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)


@dataclass(frozen=True)
class Family:
    """A family's tiny folder (``make_model_dir`` arguments), its steps, the settings of every
    run, its layouts (name -> (the two ranks' settings, the accumulation of the one-process run
    they equal: one micro-batch per data-parallel rank)) and a check of the ranks' export."""

    module: ModuleType
    spec: dict
    steps: int
    layouts: dict[str, tuple[tuple[str, ...], int]]
    settings: tuple[str, ...] = ()
    check: Callable[[Weights], None] = field(default=lambda weights: None)


EP2 = ("parallelism.dp_shard=2", "parallelism.ep=2")
DP2 = ("parallelism.dp_shard=2",)
FAMILIES = {
    "mixtral": Family(
        mixtral, {"num_experts": 6, "router_aux_loss_coef": 0.1}, steps=3,
        layouts={"ep2_dp_shard2": (EP2, 2)}, check=_kept_mixtral_names,
    ),
    "deepseek_v3": Family(
        deepseek_v3,
        {"initializer_range": 0.1, "num_attention_heads": 4, "num_key_value_heads": 4},
        steps=5,
        layouts={"ep2_dp_shard2": (EP2, 2), "dp_shard2": (DP2, 2),
                 "tp2": (("parallelism.tp=2", "gradient_accumulation_steps=2"), 2)},
        settings=("moe_bias_balancing.update_rate=0.01",), check=_balanced_biases,
    ),
    "glm4_moe": Family(
        glm4_moe,
        {"initializer_range": 0.1, "num_attention_heads": 4, "num_key_value_heads": 2},
        steps=5,
        layouts={"ep2_dp_shard2": (EP2, 2),
                 "tp2": (("parallelism.tp=2", "gradient_accumulation_steps=2"), 2)},
        settings=("moe_bias_balancing.update_rate=0.01",), check=_balanced_biases,
    ),
    "gpt_oss": Family(
        gpt_oss, {"num_experts": 4, "router_aux_loss_coef": 0.1}, steps=5,  # ep 2 divides 4
        layouts={"dp_shard2": (DP2, 2), "ep2_dp_shard2": (EP2, 2),
                 "tp2": (("parallelism.dp_shard=1", "parallelism.tp=2"), 1)},
    ),
}  # fmt: skip
CASES = [(family, layout) for family, spec in FAMILIES.items() for layout in spec.layouts]


class Singles:
    """Each family's folder, counting data and one-process runs, made when first asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.worlds: dict[str, tuple[Path, Path]] = {}
        self.runs: dict[tuple[str, int], Path] = {}

    def world(self, name: str) -> tuple[Path, Path]:
        """(model folder, data) of family ``name``."""
        if name not in self.worlds:
            root = self.root / name
            model_dir = make_model_dir(root, family=FAMILIES[name].module, **FAMILIES[name].spec)
            self.worlds[name] = model_dir, make_counting_data(root / "count.jsonl", rows=24)
        return self.worlds[name]

    def run(self, name: str, accumulation: int) -> Path:
        """One process's run of family ``name``, batches of one sample, ``accumulation``
        micro-batches a step."""
        if (name, accumulation) not in self.runs:
            family = FAMILIES[name]
            self.runs[name, accumulation] = run_sft(
                *self.world(name), self.root / name / f"single{accumulation}", "batch_size=1",
                f"gradient_accumulation_steps={accumulation}", f"max_steps={family.steps}",
                *family.settings,
            )  # fmt: skip
        return self.runs[name, accumulation]


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> Singles:
    return Singles(tmp_path_factory.mktemp("moe_parallel"))


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_sft_on_two_ranks_equals_one_process(singles, tmp_path, name, layout):
    family = FAMILIES[name]
    settings, accumulation = family.layouts[layout]
    model_dir, data = singles.world(name)
    single = singles.run(name, accumulation)
    out = tmp_path / "ranks"
    overrides = sft_overrides(
        model_dir, data, out, "batch_size=1", f"max_steps={family.steps}", *settings,
        *family.settings,
    )  # fmt: skip
    launch_ranks(overrides, tmp_path, world_size=2, timeout=240)
    assert_same_as_single(model_dir, single, out, steps=family.steps, ranks=2)
    family.check(final_weights(out))
