"""GLM-4.5 MoE (``glm4_moe``: DeepSeek-V3 routing beside plain GQA) against transformers.

Odd tiny configs, each written by transformers' ``save_pretrained`` (sharded) and loaded by
``from_hf``: fp32 logits, router logits and gradients equal to transformers', every config-only
feature shown to matter, save -> transformers loads with equal logits, greedy decoding with the
KV cache equal to transformers' for 20 tokens, multi-token-prediction layers skipped.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import transformers

from tests.models.conftest import read_safetensors_folder
from tests.models.hf_deepseek import hf_model
from tests.models.parity_checks import (
    ATOL,
    assert_gradients_match,
    assert_greedy_matches_transformers,
    assert_logits_and_router_logits_match,
    left_padded_batch,
    zero_correction_biases,
)
from tunesmith.models import build_model, from_hf, glm4_moe, spec_from_hf_config
from tunesmith.models.hf import save_hf_checkpoint

VOCAB = 131
BASE = {
    "vocab_size": VOCAB, "hidden_size": 40, "intermediate_size": 56, "moe_intermediate_size": 20,
    "num_hidden_layers": 3, "num_attention_heads": 5, "max_position_embeddings": 256,
    "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0, "tie_word_embeddings": False,
    "num_mtp_layers": 0,
}  # fmt: skip
CASES = {
    # 6 experts in 2 groups (1 kept), top-2, qk-norm, q/k/v biases, a third of each 12-wide
    # head rotated, 5 heads over 1 kv head, two shared experts, layer 0 dense.
    "groups_top2_qknorm": {
        "num_key_value_heads": 1, "head_dim": 12, "partial_rotary_factor": 1 / 3,
        "use_qk_norm": True, "attention_bias": True, "n_routed_experts": 6,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    # transformers' default half rotary, top-1 of 5, no qk-norm, no biases, no dense layer,
    # weights not renormalised.
    "top1_half_rotary_plain": {
        "num_key_value_heads": 5, "head_dim": 8, "use_qk_norm": False, "attention_bias": False,
        "n_routed_experts": 5, "num_experts_per_tok": 1, "n_shared_experts": 1,
        "first_k_dense_replace": 0, "routed_scaling_factor": 1.7, "norm_topk_prob": False},
    # Full rotary, top-3 of 7, two dense layers of four.
    "top3_full_rotary_dense2": {
        "num_hidden_layers": 4, "num_key_value_heads": 5, "head_dim": 10,
        "partial_rotary_factor": 1.0, "use_qk_norm": True, "attention_bias": True,
        "n_routed_experts": 7, "num_experts_per_tok": 3, "n_shared_experts": 1,
        "first_k_dense_replace": 2, "routed_scaling_factor": 1.3, "norm_topk_prob": True},
}  # fmt: skip


def hf_config(**fields) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model("glm4_moe", **{**BASE, **fields})


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf = hf_model(hf_config(**CASES[request.param]))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    return request.param, hf, from_hf(folder).eval(), folder


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch(VOCAB, seed)


def test_logits_and_router_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    assert_logits_and_router_logits_match(hf, ours, VOCAB)


def test_gradients_of_a_summed_loss_match_transformers(pair):
    _, hf, ours, _ = pair
    assert_gradients_match(hf, ours, VOCAB)


# Each config-only feature, changed in transformers (same weights), moves the logits.
ABLATIONS = {
    "groups_top2_qknorm": [
        {"use_qk_norm": False},
        {"attention_bias": False},
        {"partial_rotary_factor": 1.0},
        {"n_group": 1, "topk_group": 1},
        {"routed_scaling_factor": 1.0},
        {"norm_topk_prob": False},
        {"first_k_dense_replace": 0},
    ],
    "top1_half_rotary_plain": [
        {"partial_rotary_factor": 1.0},  # the default half is what transformers runs
        {"routed_scaling_factor": 1.0},
    ],
    "top3_full_rotary_dense2": [
        {"partial_rotary_factor": 0.5},
        {"first_k_dense_replace": 1},
    ],
}


def test_config_only_features_change_the_logits(pair):
    case, hf, ours, _ = pair
    ids, _ = _batch(seed=6)
    with torch.no_grad():
        mine = ours(ids)
        for change in ABLATIONS[case]:
            ablated = hf_model(hf_config(**{**CASES[case], **change}))
            ablated.load_state_dict(hf.state_dict(), strict=False)
            assert (ablated(ids).logits - mine).abs().max() > 100 * ATOL, change
        ablated = zero_correction_biases(copy.deepcopy(hf))  # the bias picks the experts
        assert (ablated(ids).logits - mine).abs().max() > 100 * ATOL


def test_save_loads_in_transformers_with_equal_logits(pair, tmp_path):
    _, hf, ours, _ = pair
    save_hf_checkpoint(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "glm4_moe"
    assert spec_from_hf_config(written) == ours.spec
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(back).__name__ == "Glm4MoeForCausalLM"
    ids, _ = _batch(seed=7)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < ATOL


def test_greedy_generation_with_kv_cache_matches_transformers(pair):
    _, hf, ours, _ = pair
    prompts = [[5, 17, 99, 3, 42], [8, 61, 7], [100, 2, 30, 44, 9, 12, 77]]
    assert_greedy_matches_transformers(hf, ours, prompts)


def test_multi_token_prediction_layers_are_skipped_with_a_message(tmp_path, caplog):
    case = CASES["groups_top2_qknorm"]
    hf = hf_model(hf_config(**case))
    with_mtp = hf_model(hf_config(**{**case, "num_hidden_layers": 4}), seed=1)
    state = hf.state_dict()
    # GLM-4.5 stores its MTP layer as layer num_hidden_layers (transformers ignores it too)
    state.update({k: v for k, v in with_mtp.state_dict().items() if ".layers.3." in k})
    hf.save_pretrained(tmp_path, state_dict=state)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "num_nextn_predict_layers": 1}))
    with caplog.at_level(logging.WARNING):
        ours = from_hf(tmp_path).eval()
    assert "multi-token-prediction" in caplog.text
    on_disk = read_safetensors_folder(tmp_path)
    skipped = sum(".layers.3." in k for k in on_disk)
    assert skipped > 17  # the MTP layer's per-expert tensors, as transformers wrote them
    assert f"{skipped} tensor(s) of the 1 multi-token-prediction" in caplog.text
    ids, _ = _batch(seed=9)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < ATOL


def test_the_tiny_size_round_trips_and_builds_every_piece():
    spec = glm4_moe.spec("glm4_moe_tiny")
    assert spec_from_hf_config(spec.to_hf_config()) == spec
    model = build_model(spec, device="meta")
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert type(model.model.layers[0].mlp).__name__ == "FeedForward"
    assert type(model.model.layers[1].mlp).__name__ == "DeepSeekMoE"
    assert model.model.rotary_emb.head_dim == spec.rotary_dim == 4


@pytest.mark.parametrize(
    ("size", "billions"), [("glm4_5", 355), ("glm4_5_air", 106)]
)  # published totals, without the multi-token-prediction layer
def test_real_sizes_match_model_card_parameter_counts(size, billions):
    model = getattr(glm4_moe, size)(device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert count / 1e9 == pytest.approx(billions, rel=0.01)
    assert model.spec.approx_parameters() == pytest.approx(count, rel=1e-3)
