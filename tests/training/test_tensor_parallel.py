"""The tensor-parallel plan == one device, for every family, with and without sequence parallel.

Two gloo ranks shard a model with :func:`apply_tensor_parallel` and compare, against the same
model unsharded on each rank, the logits and every parameter's gradient (gathered from its
DTensor) for: odd vocabularies (uneven vocabulary shards), GQA, qk-norm (Qwen3), attention
biases (Qwen2.5), a sliding window (Mistral), a MoE body (replicated experts), tied and untied
heads; sequences that 2 does not divide (padded under SP and cut back), padded rows with a 2-D
attention mask, and packed rows (``document_ids``). The refusals (heads that do not divide,
NF4 weights) are checked in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gloo_world import run_on_ranks
from tunesmith.config import ConfigError
from tunesmith.models import build_model
from tunesmith.models.zoo import (
    deepseek_v2,
    deepseek_v3,
    gemma2,
    gemma3,
    glm4,
    granite,
    llama3,
    mistral,
    olmo2,
    phi3,
    qwen2_5,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tunesmith.modules.peft.apply import apply_lora
from tunesmith.training.parallel.distributed import ParallelDims
from tunesmith.training.parallel.tensor_parallel import apply_tensor_parallel, check_tp_shardable
from tunesmith.training.parallelize import check_model_fits

VOCAB = 259
SPECS = {
    "qwen3_tied_qk_norm": lambda: qwen3.spec("qwen3_tiny", vocab_size=VOCAB),
    "qwen2_5_bias": lambda: qwen2_5.spec("qwen2_5_tiny", vocab_size=VOCAB),
    "llama3_untied": lambda: llama3.spec("llama3_tiny", vocab_size=VOCAB),
    "mistral_window": lambda: mistral.spec("mistral_tiny", vocab_size=VOCAB, sliding_window=4),
    "qwen3_moe": lambda: qwen3_moe.spec("qwen3_moe_tiny", vocab_size=VOCAB),
    "gemma2_caps_sandwich": lambda: gemma2.spec("gemma2_tiny", vocab_size=VOCAB),
    "gemma3_local_rope": lambda: gemma3.spec("gemma3_tiny", vocab_size=VOCAB),
    "granite_multipliers": lambda: granite.spec("granite_tiny", vocab_size=VOCAB),
    "smollm3_nope": lambda: smollm3.spec("smollm3_tiny", vocab_size=VOCAB),
    "phi3_longrope_partial": lambda: phi3.spec("phi3_tiny", vocab_size=VOCAB),
    "glm4_interleaved_partial": lambda: glm4.spec("glm4_tiny", vocab_size=VOCAB),
    "olmo2_projection_qk_norm": lambda: olmo2.spec("olmo2_tiny", vocab_size=VOCAB),
    # Multi-head latent attention: heads split, latents (and their norms) replicated.
    "deepseek_v3_mla": lambda: deepseek_v3.spec(
        "deepseek_v3_tiny", vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=4
    ),
    "deepseek_v2_mla_plain_q": lambda: deepseek_v2.spec(
        "deepseek_v2_tiny", vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=4
    ),
}


def _inputs(kind: str, seq: int) -> tuple[torch.Tensor, dict]:
    ids = torch.randint(0, VOCAB, (2, seq))
    if kind == "plain":
        return ids, {}
    if kind == "padded":  # the second row ends with 3 padding positions
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, -3:] = 0
        return ids, {"attention_mask": mask}
    # packed: two documents in row 0, one and trailing padding in row 1
    docs = torch.tensor([[0] * 4 + [1] * (seq - 4), [0] * (seq - 2) + [-1, -1]])
    positions = torch.cat([torch.arange(4), torch.arange(seq - 4)])[None].repeat(2, 1)
    positions[1] = torch.arange(seq)
    return ids, {"document_ids": docs, "position_ids": positions}


def _compare(name: str, sequence_parallel: bool, kind: str, seq: int) -> tuple[float, float]:
    """(max logits difference, max relative gradient difference) of the TP model vs one device."""
    spec = SPECS[name]()
    torch.manual_seed(0)
    reference = build_model(spec)
    torch.manual_seed(0)
    sharded = build_model(spec)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    apply_tensor_parallel(sharded, mesh, sequence_parallel=sequence_parallel)
    torch.manual_seed(1)
    ids, kwargs = _inputs(kind, seq)
    expected, actual = reference(ids, **kwargs), sharded(ids, **kwargs)
    keep = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
    if "document_ids" in kwargs:
        keep = kwargs["document_ids"] >= 0
    logits_error = (expected - actual)[keep].abs().max().item()
    (expected[keep].square().mean()).backward()
    (actual[keep].square().mean()).backward()
    grad_error = 0.0
    pairs = zip(reference.named_parameters(), sharded.named_parameters(), strict=True)
    for (name_1, p), (name_2, q) in pairs:
        assert name_1 == name_2
        if p.grad is None:  # an expert no token was routed to
            assert q.grad is None, name_1
            continue
        grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        scale = p.grad.abs().max().clamp(min=1e-12)
        grad_error = max(grad_error, ((p.grad - grad).abs().max() / scale).item())
    return logits_error, grad_error


# Every input kind, with and without SP; the plan's input handling is shared, so the families
# whose difference is inside a layer take one odd-length SP case and one packed case.
ALL_CASES = [
    (sp, kind, seq)
    for sp in (False, True)
    for kind, seq in (("plain", 12), ("plain", 11), ("padded", 9), ("packed", 10))
]
LAYER_CASES = [(True, "padded", 9), (False, "packed", 10)]
FULL_MATRIX = ("qwen3_tied_qk_norm", "qwen2_5_bias", "llama3_untied", "mistral_window", "qwen3_moe")


def _cases(name: str) -> list[tuple[bool, str, int]]:
    return ALL_CASES if name in FULL_MATRIX else LAYER_CASES


def _worker(rank: int) -> dict:
    results = {}
    for name in SPECS:
        for sp, kind, seq in _cases(name):
            results[(name, sp, kind, seq)] = _compare(name, sp, kind, seq)
    return results


@pytest.fixture(scope="module")
def tp_results():
    return run_on_ranks(_worker, 2)[0]


@pytest.mark.parametrize("name", list(SPECS))
def test_tensor_parallel_equals_one_device(tp_results, name):
    cases = {k: v for k, v in tp_results.items() if k[0] == name}
    assert len(cases) == len(_cases(name))
    for (_, sp, kind, seq), (logits_error, grad_error) in cases.items():
        where = f"{name} sequence_parallel={sp} {kind} seq={seq}"
        assert logits_error < 2e-6, f"{where}: logits differ by {logits_error}"
        assert grad_error < 2e-5, f"{where}: gradients differ by {grad_error} (relative)"


def test_heads_that_do_not_divide_are_refused():
    spec = qwen2_5.spec("qwen2_5_tiny", num_key_value_heads=1)
    with pytest.raises(ConfigError, match="tp 2 does not divide num_key_value_heads 1"):
        check_model_fits(spec, ParallelDims(tp=2))


def test_nf4_weights_are_refused_by_name():
    model = build_model(qwen3.spec("qwen3_tiny"))
    apply_lora(model, rank=2, alpha=4, target_modules=["q_proj"], quantize_base=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: an NF4"):
        check_tp_shardable(model)
