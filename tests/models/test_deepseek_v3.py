"""DeepSeek-V3 / V2 (multi-head latent attention, DeepSeek routing) against transformers.

Odd tiny configs, each written by transformers' ``save_pretrained`` and loaded by ``from_hf``:
fp32 logits and gradients equal to transformers', every config-only feature shown to matter,
save -> transformers loads with equal logits, greedy decoding with the latent KV cache equal to
transformers' for 20 tokens, packed rows equal to separate rows.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.models.hf_deepseek import CASES, VOCAB, YARN, hf_config, hf_model
from tests.models.parity_checks import (
    ATOL,
    assert_gradients_match,
    assert_greedy_matches_transformers,
    assert_logits_and_router_logits_match,
    left_padded_batch,
    zero_correction_biases,
)
from tunesmith.models import build_model, deepseek_v2, deepseek_v3, from_hf, spec_from_hf_config
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.masks import document_position_ids
from tunesmith.training.memory.planner import activation_bytes_per_token, estimate_memory
from tunesmith.training.parallel.distributed import ParallelDims


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_type, fields = CASES[request.param]
    hf = hf_model(hf_config(model_type, **fields))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, from_hf(folder).eval(), folder


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch(VOCAB, seed)


def test_logits_and_router_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    assert_logits_and_router_logits_match(hf, ours, VOCAB)


def test_gradients_of_a_summed_loss_match_transformers(pair):
    _, hf, ours, _ = pair
    assert_gradients_match(hf, ours, VOCAB)


# Each config-only feature, turned off in transformers (same weights), moves the logits.
ABLATIONS = {
    "v3_qlora_interleave_groups": [
        {"rope_interleave": False},
        {"n_group": 1, "topk_group": 1},
        {"routed_scaling_factor": 1.0},
        {"norm_topk_prob": False},
        {"first_k_dense_replace": 0},
    ],
    "v3_plain_q_yarn_top1": [
        {"rope_parameters": {**YARN, "mscale_all_dim": 0.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ],
    "v2_greedy_bias": [{"routed_scaling_factor": 1.0}],
    "v2_group_limited": [{"topk_method": "greedy"}],
}


def test_config_only_features_change_the_logits(pair):
    case, hf, ours, _ = pair
    model_type, fields = CASES[case]
    ids, _ = _batch(seed=6)
    with torch.no_grad():
        mine = ours(ids)
        for change in ABLATIONS[case]:
            ablated = hf_model(hf_config(model_type, **{**fields, **change}))
            ablated.load_state_dict(hf.state_dict(), strict=False)
            gap = (ablated(ids).logits - mine).abs().max()
            assert gap > 100 * ATOL, change
        if model_type == "deepseek_v3":  # the correction bias picks the experts
            ablated = zero_correction_biases(copy.deepcopy(hf))
            assert (ablated(ids).logits - mine).abs().max() > 100 * ATOL


def test_save_loads_in_transformers_with_equal_logits(pair, tmp_path):
    _, hf, ours, folder = pair
    save_hf_checkpoint(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert spec_from_hf_config(written) == ours.spec
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids, _ = _batch(seed=7)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < ATOL


def test_greedy_generation_with_latent_cache_matches_transformers(pair):
    _, hf, ours, _ = pair
    prompts = [[5, 17, 99, 3, 42], [8, 61, 7], [100, 2, 30, 44, 9, 12, 77]]
    assert_greedy_matches_transformers(hf, ours, prompts)


def test_latent_cache_is_smaller_by_the_ratio_the_config_implies(pair, capsys):
    _, _, ours, _ = pair
    spec = ours.spec
    mla = spec.mla
    cache = ours.init_kv_cache(batch_size=2, max_seq_len=32)
    stored = sum(t.numel() for t in cache.k + cache.v)
    expanded = 2 * 32 * spec.num_hidden_layers * mla.expanded_width(spec.num_attention_heads)
    implied = mla.expanded_width(spec.num_attention_heads) / mla.latent_width
    print(f"latent cache {stored} numbers, expanded {expanded}: {expanded / stored:.2f}x")
    assert stored == 2 * 32 * spec.num_hidden_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert expanded / stored == pytest.approx(implied)
    real = deepseek_v3.spec("deepseek_v3_671b").mla
    assert real.expanded_width(128) / real.latent_width == pytest.approx(71.11, abs=0.01)


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "loop"])
def test_packed_rows_equal_separate_rows(pair, backend):
    _, _, ours, _ = pair
    gen = torch.Generator().manual_seed(8)
    a, b = (
        torch.randint(1, VOCAB, (1, 5), generator=gen),
        torch.randint(1, VOCAB, (1, 7), generator=gen),
    )
    docs = torch.tensor([[0] * 5 + [1] * 7])
    ours.model.attention_backend = backend
    try:
        with torch.no_grad():
            packed = ours(torch.cat([a, b], 1), document_ids=docs,
                          position_ids=document_position_ids(docs))  # fmt: skip
            assert (packed[:, :5] - ours(a)).abs().max() < 1e-5
            assert (packed[:, 5:] - ours(b)).abs().max() < 1e-5
    finally:
        ours.model.attention_backend = "auto"


def test_memory_plan_prices_latent_attention_and_shared_experts():
    spec = deepseek_v2.spec("deepseek_v2_lite")  # the shipped LoRA config's model
    sizes = {"act_bytes": 2, "residual_bytes": 4, "seq_len": 4096, "layer_idx": 1}
    mla = activation_bytes_per_token(spec, **sizes)
    generic = activation_bytes_per_token(spec.replace(mla=None, moe_routing=None), **sizes)
    # bf16: latents 2*2*576, expanded q/k/v/out 2*16*2*(192+128), minus GQA's 2*(32+32)*64,
    # plus the two shared experts' 4*2*1408*2
    assert mla - generic == 2304 + 20480 - 8192 + 22528
    model = build_model(spec, device="meta", dtype=torch.bfloat16)
    plan = estimate_memory(model, batch_size=1, seq_len=4096, mixed_precision="bf16",
                           loss="linear", packed=True, parallel=ParallelDims(dp_shard=8, ep=8))  # fmt: skip
    print(plan)
    # each rank keeps 8 of the 64 routed experts whole and an eighth of the rest
    experts = 26 * 64 * 3 * 2048 * 1408 * 2
    rest = spec.approx_parameters() * 2 - experts
    assert plan.weights == pytest.approx(experts / 8 + rest / 8, rel=0.02)


def test_sharded_folder_loads_and_a_fused_experts_folder_is_refused(tmp_path):
    model_type, fields = CASES["v3_qlora_interleave_groups"]
    hf = hf_model(hf_config(model_type, **fields))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    ids, _ = _batch(seed=9)
    with torch.no_grad():
        got = from_hf(tmp_path / "sharded").eval()(ids)
        assert (got - hf(ids).logits).abs().max() < ATOL
    # transformers' in-memory layout (fused gate_up_proj), which its save_pretrained never
    # writes: refused naming the per-expert tensors it lacks
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text(
        (tmp_path / "sharded" / "config.json").read_text()
    )
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight"):
        from_hf(tmp_path / "fused")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"hidden_act": "gelu"}, "SwiGLU only"),
        ({"n_group": 4}, r"n_group \(4\) must divide n_routed_experts \(6\)"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(change, message):
    config = deepseek_v3.spec("deepseek_v3_tiny").to_hf_config()
    with pytest.raises(ValueError, match=message):
        build_model(spec_from_hf_config({**config, **change}), device="meta")


@pytest.mark.parametrize(
    ("module", "size", "billions"),
    [(deepseek_v3, "deepseek_v3_671b", 671), (deepseek_v3, "moonlight_16b_a3b", 16.0),
     (deepseek_v2, "deepseek_v2_lite", 15.7)],
)  # fmt: skip
def test_real_sizes_match_model_card_parameter_counts(module, size, billions):
    model = getattr(module, size)(device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert count / 1e9 == pytest.approx(billions, rel=0.01)
    assert model.spec.approx_parameters() == pytest.approx(count, rel=1e-3)


def test_correction_bias_stays_float32_in_a_bfloat16_model(tmp_path):
    model_type, fields = CASES["v3_qlora_interleave_groups"]
    hf = hf_model(hf_config(model_type, **fields))
    hf.save_pretrained(tmp_path)
    on_disk = {k: v for k, v in hf.state_dict().items() if k.endswith("e_score_correction_bias")}
    assert any(not torch.equal(v.bfloat16().float(), v) for v in on_disk.values())
    ours = from_hf(tmp_path, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    state = ours.state_dict()
    for name, value in on_disk.items():  # read as stored, not rounded to bfloat16
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    ours.float().to(torch.bfloat16)
    assert all(ours.state_dict()[name].dtype == torch.float32 for name in on_disk)
    with torch.no_grad():
        assert ours(torch.tensor([[3, 5, 7]])).dtype == torch.bfloat16
