"""Context parallel on two gloo ranks == one device, for the attention kinds of every family.

Each rank keeps the zigzag halves of the rows (:func:`shard_batch`) and runs the model with
``cp_index`` (ring attention); the logits at its positions and the parameters' gradients
(summed over the ranks) must equal the unsplit model's, for: Gemma 2 (soft-capped scores in
every ring block, alternating windows, scaled queries), Gemma 3 (local RoPE), OLMo 3 (three
sliding layers to one global), Phi-3 (partial rotary), GLM-4 (interleaved rotary), SmolLM3
(NoPE layers) and DeepSeek-V3 (multi-head latent attention, routed experts); rows with padding and packed rows whose documents cross the split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gloo_world import run_on_ranks
from tests.models.conftest import randomize_
from tunesmith.models import build_model
from tunesmith.models.zoo import deepseek_v3, gemma2, gemma3, glm4, olmo3, phi3, smollm3
from tunesmith.training.parallel.context_parallel import install_context_parallel, shard_batch

CP = 2
SPECS = {
    "gemma2_softcap": lambda: gemma2.spec("gemma2_tiny", attn_logit_softcapping=1.0),
    "gemma3_local_rope": lambda: gemma3.spec("gemma3_tiny"),
    "olmo3_windows": lambda: olmo3.spec("olmo3_tiny"),
    "phi3_partial_rotary": lambda: phi3.spec("phi3_tiny", rope_scaling=None),
    "glm4_interleaved": lambda: glm4.spec("glm4_tiny"),
    "smollm3_nope": lambda: smollm3.spec("smollm3_tiny"),
    # q/k and values of other widths (padded to one inside the ring), experts
    "deepseek_v3_mla": lambda: deepseek_v3.spec("deepseek_v3_tiny"),
}


def _batch(kind: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 16), generator=gen)
    if kind == "padded":  # row 1 ends with 3 padding positions
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, -3:] = 0
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(16).repeat(2, 1),
        }
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 10 + [-1] * 3])
    starts = [torch.cat([torch.arange(6), torch.arange(10)]), torch.arange(16)]
    return {"input_ids": ids, "document_ids": docs, "position_ids": torch.stack(starts)}


def _compare(name: str, kind: str, rank: int) -> tuple[float, float]:
    reference = randomize_(build_model(SPECS[name]()), seed=0, std=0.2).double()  # caps bite
    split = build_model(SPECS[name]()).double()
    split.load_state_dict(reference.state_dict())
    install_context_parallel(split, None)
    batch = _batch(kind)
    inputs = {k: v for k, v in batch.items() if k != "input_ids"}
    full = reference(batch["input_ids"], **inputs)
    local = shard_batch(batch, cp_rank=rank, cp_size=CP)
    keep = local["cp_index"][0]
    real = batch.get("attention_mask", batch.get("document_ids", torch.zeros(1)) >= 0).bool()
    real_local = real[:, keep.clamp(max=15)] & (keep < 16)
    mine = split(local["input_ids"], **{k: v for k, v in local.items() if k != "input_ids"})
    expected = full[:, keep.clamp(max=15)]
    scale = expected[real_local].abs().max()
    logits_error = ((mine - expected)[real_local].abs().max() / scale).item()
    weights = torch.randn(full.shape, generator=torch.Generator().manual_seed(2), dtype=full.dtype)
    (full * weights * real[..., None]).sum().backward()
    (mine * weights[:, keep.clamp(max=15)] * real_local[..., None]).sum().backward()
    grad_error = 0.0
    for p, q in zip(reference.parameters(), split.parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad)
        scale = p.grad.abs().max().clamp(min=1e-30)
        grad_error = max(grad_error, ((grad - p.grad).abs().max() / scale).item())
    return logits_error, grad_error


def _worker(rank: int) -> dict:
    return {(n, k): _compare(n, k, rank) for n in SPECS for k in ("padded", "packed")}


@pytest.fixture(scope="module")
def cp_results():
    return run_on_ranks(_worker, CP)


@pytest.mark.parametrize("name", list(SPECS))
def test_context_parallel_equals_one_device(cp_results, name):
    for rank, results in enumerate(cp_results):
        for kind in ("padded", "packed"):
            logits_error, grad_error = results[(name, kind)]
            where = f"{name} {kind} rank {rank}"
            # float64 weights, but the norms (like transformers') and Gemma's capped softmax
            # compute in float32: agreement to ~1e-7, as the TP test's float32 bounds.
            assert logits_error < 2e-6, f"{where}: logits differ by {logits_error} (relative)"
            assert grad_error < 2e-5, f"{where}: gradients differ by {grad_error} (relative)"
