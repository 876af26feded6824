"""Tensor parallel of the transformers backend (transformers' own plan) == one process.

Two gloo ranks shard tiny transformers-built models with :func:`apply_tensor_parallel` (which
translates the class's ``tp_plan``) and compare, against the same model unsharded, the logits
and every parameter's gradient (gathered from its DTensor) of a loss on a padded batch:

- StarCoder 2: ``colwise`` / ``rowwise`` with biases (a replicated row-wise bias), layer norms
  with biases, a GELU MLP ``c_fc`` / ``c_proj``, a tied head; also with LoRA (non-zero ``B``)
  on every linear;
- Cohere 2: parallel attention and MLP on one norm, a logit scale, sliding and full layers,
  an untied head;
- Qwen 3 (built by transformers): per-head qk-norms, ``replicated_with_grad_allreduce``;
- Phi-3 (built by transformers): fused ``qkv_proj`` / ``gate_up_proj``,
  ``colwise_gather_output`` and ``rowwise_split_input``; also with LoRA on the fused ones.

Every vocabulary is odd (uneven vocabulary shards); both ranks are checked (the replicated
parameters' gradients must be whole on each). Refused on the ranks, each model left as it was,
with one line naming the model type: LFM2 (transformers' plan leaves its layers out), sequence
parallel, a style tunesmith does not run (Mixtral's ``packed_colwise`` experts), kv heads 2
does not divide (also refused by the config check, in this process).

The slow tier adds the LoRA models and Phi-3, and runs ``sft`` on a StarCoder 2 folder with
``parallelism.tp=2`` on 2 ranks and ``dp_shard=2`` x ``tp=2`` (FSDP2 over the TP shards) on 4:
each logs the single process's losses, grad norms and token counts, and saves its weights
(gathered from the DTensors by the checkpointer).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.gloo_world import run_on_ranks
from tests.models.transformers_world import ARCHITECTURES, make_transformers_model_dir
from tests.recipes.sft_world import (
    assert_same_as_single,
    launch_ranks,
    make_counting_data,
    recipe_overrides,
    run_sft,
)
from tunesmith.config import ConfigError
from tunesmith.models.transformers_backend import (
    TransformersSpec,
    build_transformers_model,
    tiny_config,
)
from tunesmith.modules.peft.apply import apply_lora
from tunesmith.training.parallel.distributed import ParallelDims
from tunesmith.training.parallel.tensor_parallel import TRANSFORMERS_STYLES, apply_tensor_parallel
from tunesmith.training.parallelize import check_model_fits

VOCAB = 131  # odd: vocabulary shards of 66 + 65
MODELS = {
    "starcoder2": ("starcoder2", {}),
    "starcoder2_lora": ("starcoder2", {}),
    "cohere2_untied": ("cohere2", {"tie_word_embeddings": False}),
    "qwen3_qk_norm": ("qwen3", {}),
    "phi3_fused": ("phi3", {}),
    "phi3_fused_lora": ("phi3", {}),
}
"""Test id -> (model_type, config overrides beyond the world's)."""
LORA_TARGETS = {
    "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
    "phi3": ["qkv_proj", "gate_up_proj"],  # colwise_gather_output (the split input's: refused)
}
"""Each LoRA model's adapted linears."""


def _model(name: str) -> nn.Module:
    model_type, overrides = MODELS[name]
    config = tiny_config(
        model_type, vocab_size=VOCAB, **{**ARCHITECTURES.get(model_type, {}), **overrides}
    )
    torch.manual_seed(0)
    model = build_transformers_model(config)
    if name.endswith("_lora"):
        apply_lora(model, rank=2, alpha=4, target_modules=LORA_TARGETS[model_type])
        with torch.no_grad():  # non-trivial adapters: every adapter gradient is exercised
            for param_name, param in model.named_parameters():
                if param_name.endswith("lora_B.weight"):
                    param.normal_(0, 0.2)
    return model


def _compare(name: str) -> tuple[float, float, int]:
    """(max logits difference, max relative gradient difference, sharded parameters) of the
    tp 2 model against one process on two rows of 12 tokens, the second ending in padding."""
    reference = _model(name)
    sharded = copy.deepcopy(reference)
    apply_tensor_parallel(sharded, dist.device_mesh.init_device_mesh("cpu", (2,)),
                          sequence_parallel=False)  # fmt: skip
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    expected, actual = reference(ids, attention_mask=mask), sharded(ids, attention_mask=mask)
    keep = mask.bool()
    logits_error = (expected - actual)[keep].abs().max().item()
    (expected[keep].square().mean()).backward()
    (actual[keep].square().mean()).backward()
    grad_error, dtensors = 0.0, 0
    pairs = zip(reference.named_parameters(), sharded.named_parameters(), strict=True)
    for (name_1, p), (name_2, q) in pairs:
        assert name_1 == name_2
        if not p.requires_grad:  # LoRA's frozen base
            continue
        dtensors += hasattr(q, "full_tensor")
        grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        scale = p.grad.abs().max().clamp(min=1e-12)
        grad_error = max(grad_error, ((p.grad - grad).abs().max() / scale).item())
    return logits_error, grad_error, dtensors


REFUSED = {
    "lfm2": ("lfm2", {}, False),
    "sequence_parallel": ("starcoder2", {}, True),
    "packed_colwise": ("starcoder2", {}, False),  # a style we do not run, put in its plan
    "kv_heads": ("starcoder2", {"num_key_value_heads": 1}, False),
}
"""Test id -> (model_type, config overrides, sequence parallel) of a refused sharding."""


def _refusal(name: str) -> tuple[str, bool]:
    """The message of a :data:`REFUSED` sharding's error, and whether it left the model as
    it was (no parameter sharded)."""
    model_type, overrides, sequence_parallel = REFUSED[name]
    config = tiny_config(model_type, **{**ARCHITECTURES.get(model_type, {}), **overrides})
    model = build_transformers_model(config)
    if name == "packed_colwise":  # transformers' MoE experts style (its plans change by version)
        hf = model.hf_model
        hf.tp_plan = {**hf.tp_plan, "model.layers.*.mlp.c_fc": "packed_colwise"}
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError) as refused:
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    untouched = not any(hasattr(p, "full_tensor") for p in model.parameters())
    return str(refused.value), untouched


def _worker(rank: int, names: list[str]) -> dict:
    return {name: _compare(name) if name in MODELS else _refusal(name) for name in names}


DEFAULT_MODELS = ["starcoder2", "cohere2_untied", "qwen3_qk_norm"]


@pytest.fixture(scope="module")
def tp_results() -> list[dict]:
    return run_on_ranks(_worker, 2, [*DEFAULT_MODELS, *REFUSED])


@pytest.fixture(scope="module")
def slow_tp_results() -> list[dict]:
    return run_on_ranks(_worker, 2, [m for m in MODELS if m not in DEFAULT_MODELS])


def _check(results: list[dict], name: str) -> None:
    for rank, result in enumerate(results):
        logits_error, grad_error, dtensors = result[name]
        assert dtensors > 0, f"{name}: no parameter was sharded"
        assert logits_error < 2e-6, f"{name} rank {rank}: logits differ by {logits_error}"
        assert grad_error < 2e-5, f"{name} rank {rank}: gradients differ by {grad_error} (rel)"


@pytest.mark.parametrize("name", DEFAULT_MODELS)
def test_transformers_plan_equals_one_process(tp_results, name):
    _check(tp_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in MODELS if m not in DEFAULT_MODELS])
def test_lora_and_fused_projections_equal_one_process(slow_tp_results, name):
    _check(slow_tp_results, name)


def test_what_it_cannot_run_is_refused_before_any_change(tp_results):
    expected = {
        "lfm2": "tensor parallel: transformers' plan for lfm2 leaves decoder layer "
        "'model.layers.0' out; use tp: 1",
        "sequence_parallel": "sequence parallel: the transformers backend (starcoder2) has "
        "none; set parallelism.sequence_parallel: false",
        "packed_colwise": "tensor parallel: transformers' plan for starcoder2: "
        "'model.layers.*.mlp.c_fc' is 'packed_colwise', which tunesmith does "
        f"not run (it runs {', '.join(TRANSFORMERS_STYLES)}); use tp: 1",
        "kv_heads": "tensor parallel: transformers' plan for starcoder2: tp 2 does not divide "
        "its num_key_value_heads",
    }
    for result in tp_results:
        assert {name: result[name] for name in REFUSED} == {
            name: (message, True) for name, message in expected.items()
        }


def test_heads_that_do_not_divide_are_refused_by_the_config_check():
    spec = TransformersSpec(tiny_config("starcoder2", num_key_value_heads=1).to_dict())
    with pytest.raises(ConfigError, match="tp 2 does not divide num_key_value_heads 1"):
        check_model_fits(spec, ParallelDims(tp=2))


# -- the sft recipe ----------------------------------------------------------------------------

STEPS, GLOBAL_BATCH = 3, 4
TP2 = ("parallelism.tp=2", "parallelism.sequence_parallel=false")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A StarCoder 2 folder, chat data, and the single-process run of 3 steps."""
    root = tmp_path_factory.mktemp("transformers_tp")
    model_dir = make_transformers_model_dir(root, "starcoder2")
    data = make_counting_data(root / "count.jsonl", rows=24)
    single = run_sft(model_dir, data, root / "single", f"batch_size={GLOBAL_BATCH}",
                     f"max_steps={STEPS}")  # fmt: skip
    return {"model_dir": model_dir, "data": data, "single": single}


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp_shard", [pytest.param(1, id="tp2"), pytest.param(2, id="dp_shard2_tp2")]
)
def test_sft_with_tp_equals_one_process(world, tmp_path, dp_shard):
    ranks = 2 * dp_shard
    overrides = recipe_overrides(
        world["model_dir"],
        world["data"],
        tmp_path / "out",
        f"batch_size={GLOBAL_BATCH // dp_shard}",
        f"max_steps={STEPS}",
        *TP2,
        f"parallelism.dp_shard={dp_shard}",
    )
    launch_ranks(overrides, tmp_path, world_size=ranks, timeout=60 * ranks)
    log = (tmp_path / "rank0.log").read_text()
    assert f"parallelism: ('dp_shard', 'tp') mesh of ({dp_shard}, 2) ranks" in log
    assert_same_as_single(
        world["model_dir"], world["single"], tmp_path / "out", steps=STEPS, ranks=ranks
    )
