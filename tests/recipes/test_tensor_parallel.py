"""Tensor parallel (TP) trains like one process, in every recipe: the equivalence matrix of
issue #15.

Each parallel configuration runs a recipe on 2 (``tp2``) or 4 (``2 x 2`` meshes) local gloo
ranks, started as torchrun would, and must log the single process's losses, grad norms and
every other metric at each of :data:`STEPS` steps (rel 1e-5) and export the same weights (atol
1e-5; for LoRA the saved PEFT adapter):

- ``tp2`` (``sequence_parallel: false``: a replicated residual stream) and ``tp2_sp`` (the
  default, the stream sharded on the sequence);
- ``dp_shard2_tp2`` (FSDP2 over the TP-sharded parameters) and ``dp_replicate2_tp2`` (2
  replicas of a TP pair);
- ``tp2_chunked_loss``: the head's loss on the local vocabulary shard (loss parallel):
  ``LinearCrossEntropyLoss`` for ``sft``, several log-prob chunks for ``dpo``
  (``logprob_chunk_size``), several ``KDLoss`` chunks for ``kd``; ``reward_model`` has no
  vocabulary head (its score head sees the full hidden states), so it has no such row;
- ``tp2_lora`` (the recipe's LoRA config; ``kd`` and ``reward_model`` ship none, so their
  ``model`` is wrapped in ``apply_lora`` here);
- ``tp2_optimizer_in_backward`` (no grad norm is logged then, and nothing is clipped);
- ``tp2_activation_checkpointing``: compared with the plain single-process run (checkpointing
  changes no number).

``dpo`` trains against its frozen reference copy (TP-sharded like the policy), ``kd`` against
a frozen, wider teacher with an untied head (TP-sharded too). Every model has an odd
vocabulary (:data:`VOCAB`, more rows than the tokenizer's ids, split 329 + 328 over 2 ranks) and
GQA (4 query heads, 2 key/value heads: one kv head per rank).

The data-parallel ranks share a step's samples as in ``test_sft_distributed``: the single
process takes a batch of :data:`GLOBAL_BATCH`, each of ``dp`` data-parallel ranks
``GLOBAL_BATCH / dp`` (the TP ranks of one group see the same samples).

The default set runs the whole ``sft`` row, ``tp2_sp`` and the chunked loss of ``dpo``, ``kd``
and ``reward_model`` (which has none) and ``dp_shard2_tp2`` of ``dpo``; the rest is marked slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    noise_tolerance,
    read_metrics,
    recipe_overrides,
    run_recipe,
)

STEPS, GLOBAL_BATCH, TP = 3, 4, 2
VOCAB = 657
"""The models' vocabulary: odd (uneven vocabulary shards under tp 2) and larger than the
tiny tokenizer's 651 ids (padding rows no token reaches)."""
TEACHER = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False}  # fmt: skip
"""The KD teacher: wider than the student, GQA too, with its own (untied) ``lm_head``."""
RTOL, WEIGHTS_ATOL = 1e-5, 1e-5
METRIC_ATOL = 1e-6  # for metrics that are sums of near-zero values (DPO rewards at step 1)

LORA = {
    "_component_": "tunesmith.modules.peft.apply_lora",
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"],
    "rank": 4, "alpha": 8, "dropout": 0.0,
}  # fmt: skip
"""``apply_lora`` on every linear of the body (column- and row-wise layers alike), for the
recipes that ship no LoRA config."""


# -- the world ---------------------------------------------------------------------------------


@dataclass
class Recipe:
    """How one recipe runs in this world: its data and the overrides every run of it (single
    process or TP) takes."""

    data: Path
    overrides: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Model folders (odd vocabulary, GQA), the data of each recipe, and a cache of the
    single-process reference runs (each computed once, when a test first needs it)."""
    root = tmp_path_factory.mktemp("tp")
    model_dir = make_model_dir(root / "student", seed=0, vocab_size=VOCAB)
    teacher = make_model_dir(root / "teacher", seed=1, vocab_size=VOCAB, **TEACHER)
    chat = make_counting_data(root / "count.jsonl", rows=24)
    pairs = make_preference_data(root / "add.jsonl", rows=16, seed=0, task="add")
    say = make_preference_data(root / "say.jsonl", rows=16, seed=0, task="say", system=None)
    lr = "optimizer.lr=1e-3"  # dpo and reward_model ship smaller steps: weights must move
    recipes = {
        "sft": Recipe(chat),
        "dpo": Recipe(pairs, [lr]),
        "kd": Recipe(chat, [f"teacher_dir={teacher}"]),
        "reward_model": Recipe(say, [lr]),
    }
    return {"root": root, "model_dir": model_dir, "recipes": recipes, "single": {}}


# -- the matrix --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    """One parallel configuration: its ranks, the overrides only the parallel run takes, and
    those both runs take (per recipe; None: the recipe has no such row)."""

    ranks: int
    parallel: tuple[str, ...]
    shared: dict[str, tuple[str, ...] | None] = field(default_factory=dict)

    def shared_for(self, recipe: str) -> tuple[str, ...] | None:
        return self.shared.get(recipe, ())


TP2 = ("parallelism.tp=2", "parallelism.dp_shard=1")
BASE_MODEL = {
    "kd": "{_component_: tunesmith.models.from_hf, path: '${model_dir}', dtype: float32}",
    "reward_model": "{_component_: tunesmith.models.reward_model_from_hf, "
    "path: '${model_dir}', num_labels: 1, dtype: float32}",
}
"""The shipped ``model`` of the recipes without a LoRA config, as an override value."""


def _lora_model(recipe: str) -> tuple[str]:
    """The override that wraps ``recipe``'s shipped ``model`` in ``apply_lora`` (:data:`LORA`)."""
    targets = ", ".join(LORA["target_modules"])
    return (
        f"model={{_component_: {LORA['_component_']}, model: {BASE_MODEL[recipe]}, "
        f"target_modules: [{targets}], rank: {LORA['rank']}, alpha: {LORA['alpha']}, "
        f"dropout: {LORA['dropout']}}}",
    )


CONFIGS: dict[str, Parallel] = {
    "tp2": Parallel(2, (*TP2, "parallelism.sequence_parallel=false")),
    "tp2_sp": Parallel(2, (*TP2, "parallelism.sequence_parallel=true")),
    "dp_shard2_tp2": Parallel(4, ("parallelism.tp=2", "parallelism.dp_shard=2")),
    "dp_replicate2_tp2": Parallel(
        4, ("parallelism.tp=2", "parallelism.dp_replicate=2", "parallelism.dp_shard=1")
    ),
    "tp2_chunked_loss": Parallel(
        2,
        TP2,
        {
            "sft": (
                "loss._component_=tunesmith.modules.losses.LinearCrossEntropyLoss",
                "loss.num_chunks=3",
            ),
            "dpo": ("logprob_chunk_size=7",),
            "kd": ("loss.num_chunks=3",),
            "reward_model": None,
        },
    ),
    "tp2_lora": Parallel(
        2,
        TP2,
        {
            "sft": ("config=tiny_lora",),
            "dpo": ("config=tiny_lora",),
            "kd": _lora_model("kd"),
            "reward_model": _lora_model("reward_model"),
        },
    ),
    "tp2_optimizer_in_backward": Parallel(
        2,
        TP2,
        {
            r: ("optimizer_in_backward=true", "max_grad_norm=null")
            for r in ("sft", "dpo", "kd", "reward_model")
        },
    ),
    "tp2_activation_checkpointing": Parallel(2, (*TP2, "activation_checkpointing={mode: full}")),
}
"""Every parallel configuration of the matrix, by test id."""

DEFAULT_SET = {
    "sft": set(CONFIGS),
    "dpo": {"tp2_sp", "dp_shard2_tp2", "tp2_chunked_loss"},
    "kd": {"tp2_sp", "tp2_chunked_loss"},
    "reward_model": {"tp2_sp"},
}
"""The cells run by default (CI); the others are marked slow. FSDP2 over TP-sharded parameters
runs by default for ``sft`` (a trained body) and ``dpo`` (a frozen copy beside it: the KD
teacher takes the same path); ``kd`` and ``reward_model`` run it in the slow tier."""


def _cells() -> list:
    """One ``(recipe, configuration)`` parameter per cell of the matrix (slow ones marked)."""
    cells = []
    for recipe in ("sft", "dpo", "kd", "reward_model"):
        for name, parallel in CONFIGS.items():
            if parallel.shared_for(recipe) is None:
                continue
            marks = [] if name in DEFAULT_SET[recipe] else [pytest.mark.slow]
            cells.append(pytest.param(recipe, name, marks=marks, id=f"{recipe}-{name}"))
    return cells


# -- running and comparing ---------------------------------------------------------------------


def _split_config(overrides: tuple[str, ...]) -> tuple[str, list[str]]:
    """The shipped config named by a ``config=NAME`` override (default ``tiny``) and the rest."""
    config = "tiny"
    rest = []
    for override in overrides:
        if override.startswith("config="):
            config = override.removeprefix("config=")
        else:
            rest.append(override)
    return config, rest


def single_run(world: dict, recipe: str, shared: tuple[str, ...]) -> Path:
    """The single-process run of ``recipe`` with the ``shared`` overrides and a batch of
    :data:`GLOBAL_BATCH` (run once per module and cached)."""
    key = (recipe, shared)
    if key not in world["single"]:
        config, rest = _split_config(shared)
        spec = world["recipes"][recipe]
        out = world["root"] / f"single-{recipe}-{len(world['single'])}"
        run_recipe(
            recipe,
            config,
            world["model_dir"],
            spec.data,
            out,
            *spec.overrides,
            f"batch_size={GLOBAL_BATCH}",
            f"max_steps={STEPS}",
            *rest,
        )
        world["single"][key] = out
    return world["single"][key]


def parallel_run(world: dict, recipe: str, parallel: Parallel, out: Path, log_dir: Path) -> Path:
    """``recipe`` on ``parallel.ranks`` local ranks, each data-parallel rank with its share of
    the global batch."""
    config, rest = _split_config(parallel.shared_for(recipe))
    per_rank = GLOBAL_BATCH // (parallel.ranks // TP)
    spec = world["recipes"][recipe]
    overrides = recipe_overrides(
        world["model_dir"],
        spec.data,
        out,
        *spec.overrides,
        f"batch_size={per_rank}",
        f"max_steps={STEPS}",
        *rest,
        *parallel.parallel,
    )
    launch_ranks(
        overrides,
        log_dir,
        recipe=recipe,
        config=config,
        world_size=parallel.ranks,
        timeout=60 * parallel.ranks,
    )
    return out


def _compared(record: dict[str, float]) -> dict[str, float]:
    """The metrics of a logged record that must match: all but wall-clock times, throughput
    (``*_s``, ``tokens_per_s``) and the memory peak (each rank holds a share of the model)."""
    return {k: v for k, v in record.items() if k != "time" and not k.endswith(("_s", "_gb"))}


def assert_same_run(single: Path, parallel: Path) -> None:
    """``parallel`` logged ``single``'s metrics at every step (rel :data:`RTOL`) and exported
    its weights (atol :data:`WEIGHTS_ATOL`); a mismatch names the step and metric or tensor.

    Example::

        assert_same_run(root / "single", tmp_path / "tp2")
    """
    assert [p.name for p in checkpoints(parallel)] == [f"step_{STEPS:06d}"]
    logged_1, logged_2 = read_metrics(single), read_metrics(parallel)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step in logged_1:
        one, two = _compared(logged_1[step]), _compared(logged_2[step])
        assert one.keys() == two.keys(), f"step {step}: {sorted(one.keys() ^ two.keys())}"
        for key in one:
            assert two[key] == pytest.approx(one[key], rel=RTOL, abs=METRIC_ATOL), (
                f"{key} at step {step}: {two[key]} vs one process {one[key]}"
            )
    assert_same_weights(
        final_weights(parallel), final_weights(single), noise_tolerance(WEIGHTS_ATOL)
    )


def moved(run: Path, model_dir: Path) -> float:
    """How far a run moved its weights: the largest change of a base weight, or for an adapter
    the largest entry of a ``lora_B`` (zero at the start)."""
    weights = final_weights(run)
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    if lora_b:
        return max(w.abs().max().item() for w in lora_b)
    initial = checkpoint_weights(model_dir)
    return largest_change(weights, {k: v for k, v in initial.items() if k in weights})


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "config"), _cells())
def test_tensor_parallel_equals_one_process(world, recipe, config, tmp_path):
    parallel = CONFIGS[config]
    single = single_run(world, recipe, parallel.shared_for(recipe))
    out = parallel_run(world, recipe, parallel, tmp_path / "out", tmp_path)
    mesh = next(
        line
        for line in (tmp_path / "rank0.log").read_text().splitlines()
        if line.startswith("parallelism:")
    )
    assert "'tp') mesh of (" in mesh and ", 2) ranks" in mesh, mesh
    assert mesh.endswith(f", {parallel.ranks // TP} data-parallel"), mesh
    assert_same_run(single, out)
    logged = read_metrics(single)
    assert ("grad_norm" in logged[1]) is (config != "tp2_optimizer_in_backward")
    assert all(math.isfinite(r["loss"]) for r in logged.values())
    assert moved(single, world["model_dir"]) > 10 * WEIGHTS_ATOL  # the comparison tests much
