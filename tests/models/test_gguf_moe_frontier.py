"""GGUF export of the frontier mixtures of experts (issue #37) without llama.cpp: DeepSeek-V2/V3
as llama.cpp's ``deepseek2`` (multi-head latent attention with ``kv_b_proj`` split into
``attn_k_b``/``attn_v_b``, DeepSeek routing, shared experts, leading dense layers): every tensor
under llama.cpp's name with its values, and the metadata keys the architecture reads, read back
with the ``gguf`` package; what llama.cpp would compute differently is refused by name.
``test_gguf_llama_cpp.py`` (marker ``llama_cpp``) runs the files in llama.cpp itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.models.test_gguf_export import _fields
from tests.recipes.sft_world import make_model_dir
from tunesmith.data import Tokenizer
from tunesmith.models import build_model
from tunesmith.models.gguf_export import GGUFExportError, export_gguf
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.models.zoo import deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, olmo3
from tunesmith.modules.gpt_oss_experts import ClampedExperts
from tunesmith.modules.moe import stacked_state
from tunesmith.modules.routers import DeepSeekRouting

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
ATTENTION = {"self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
LOW_RANK_QUERY = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                  "self_attn.q_b_proj": "attn_q_b"}  # fmt: skip
DENSE = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
SPARSE = {"mlp.gate.weight": "ffn_gate_inp.weight",
          "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
          "mlp.experts.gate_proj": "ffn_gate_exps.weight",
          "mlp.experts.up_proj": "ffn_up_exps.weight",
          "mlp.experts.down_proj": "ffn_down_exps.weight",
          "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}  # fmt: skip


def _model_dir(root, zoo, **overrides):
    """A tiny model of ``zoo`` with the suite's tokenizer; V3's router bias (zero when built)
    set to distinct values, so that the file must carry it."""
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5")
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    model = build_model(zoo.spec(name, vocab_size=vocab, **overrides))
    for key, buffer in model.named_buffers():
        if key.endswith("e_score_correction_bias"):
            buffer.copy_(torch.linspace(-0.3, 0.3, buffer.numel()))
    return save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)


def _expected(model) -> dict[str, torch.Tensor]:
    """llama.cpp's name -> the tensor it should hold, from our model's state dict."""
    with stacked_state(model):
        state = model.state_dict()
    spec, mla = model.spec, model.spec.mla
    want = {"token_embd.weight": state["model.embed_tokens.weight"],
            "output_norm.weight": state["model.norm.weight"],
            "output.weight": state["lm_head.weight"]}  # fmt: skip
    query = LOW_RANK_QUERY if mla.q_lora_rank else {"self_attn.q_proj": "attn_q"}
    for layer in range(spec.num_hidden_layers):
        ours = f"model.layers.{layer}"
        names = {**ATTENTION, **query, **(DENSE if layer in spec.mlp_only_layers else {})}
        for key, name in names.items():
            want[f"blk.{layer}.{name}.weight"] = state[f"{ours}.{key}.weight"]
        if layer not in spec.mlp_only_layers:
            for key, name in SPARSE.items():
                if f"{ours}.{key}" in state:
                    want[f"blk.{layer}.{name}"] = state[f"{ours}.{key}"]
        # kv_b: per head, the key rows then the value rows, over the latent
        kv_b = state[f"{ours}.self_attn.kv_b_proj.weight"]
        heads = kv_b.reshape(spec.num_attention_heads, -1, mla.kv_lora_rank)
        want[f"blk.{layer}.attn_k_b.weight"] = heads[:, : mla.qk_nope_head_dim].transpose(1, 2)
        want[f"blk.{layer}.attn_v_b.weight"] = heads[:, mla.qk_nope_head_dim :]
    return want


@pytest.mark.parametrize(
    ("zoo", "overrides"),
    [(deepseek_v2, {}), (deepseek_v3, {"rope_scaling": YARN})],
    ids=["deepseek_v2", "deepseek_v3"],
)
def test_deepseek_files_hold_llama_cpps_tensors_and_keys(tmp_path, zoo, overrides):
    import gguf

    folder = _model_dir(tmp_path, zoo, **overrides)
    model = from_hf(folder, dtype=torch.float32)
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = _expected(model)
    assert sorted(stored) == sorted(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)

    spec, fields = model.spec, _fields(reader)
    mla, routing = spec.mla, spec.moe_routing
    expected = {
        "attention.head_count_kv": 1,  # one KV head: the latent and the rotary key
        "attention.key_length": mla.kv_lora_rank + mla.qk_rope_head_dim,
        "attention.value_length": mla.kv_lora_rank,
        "attention.key_length_mla": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        "attention.value_length_mla": mla.v_head_dim,
        "attention.q_lora_rank": mla.q_lora_rank or 0,
        "attention.kv_lora_rank": mla.kv_lora_rank,
        "rope.dimension_count": mla.qk_rope_head_dim,
        "leading_dense_block_count": len(spec.mlp_only_layers),
        "expert_count": spec.num_experts,
        "expert_used_count": spec.num_experts_per_tok,
        "expert_shared_count": routing.n_shared_experts,
        "expert_feed_forward_length": spec.moe_intermediate_size,
        "expert_weights_scale": routing.routed_scaling_factor,
        "expert_weights_norm": zoo is deepseek_v3,  # V2's router never renormalises
        "expert_gating_func": 2 if zoo is deepseek_v3 else 1,  # sigmoid, softmax
        "expert_group_count": routing.n_group,
        "expert_group_used_count": routing.topk_group,
    }
    if overrides:
        expected["rope.scaling.yarn_log_multiplier"] = 0.1 * 0.707
        expected["rope.scaling.factor"] = 40.0
    got = {key: fields[f"deepseek2.{key}"] for key in expected}
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("zoo", "overrides", "words"),
    [
        (deepseek_v2, {"moe_routing": DeepSeekRouting("group_limited_greedy", 5, 2, 1.0, 1)},
         "topk_method='group_limited_greedy' with n_group=5"),
        (deepseek_v3, {"attention_bias": True}, "attention_bias=True"),
        (deepseek_v3, {"rope_interleaved": False}, "rope_interleaved=False"),
        (deepseek_v3, {"rope_scaling": {**YARN, "mscale": 1.0}}, "mscale=1.0, mscale_all_dim=0.707"),
    ],
)  # fmt: skip
def test_what_llama_cpps_deepseek2_computes_otherwise_is_refused(tmp_path, zoo, overrides, words):
    folder = make_model_dir(tmp_path, family=zoo, **overrides)
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


# GLM-4.5 (llama.cpp's glm4moe) and gpt-oss: llama.cpp's name of every tensor (per layer; the
# dense layer 0 of GLM-4.5 has ffn_gate/up/down instead of the sparse ones)
GLM4_MOE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "post_attention_norm"}  # fmt: skip
GPT_OSS = {**{k: v for k, v in GLM4_MOE.items() if "norm" not in k or "layernorm" in k},
           "self_attn.sinks": "attn_sinks", "mlp.gate": "ffn_gate_inp",
           "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
           "mlp.experts.down_proj": "ffn_down_exps"}  # fmt: skip
TRUNCATED_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _names(model, table: dict[str, str]) -> dict[str, torch.Tensor]:
    """llama.cpp's name -> tensor for ``table``'s layer keys (weights, biases, sinks) plus the
    DeepSeek-routed sparse layers' (:data:`SPARSE`) and dense layers' tensors."""
    with stacked_state(model):
        state = model.state_dict()
    spec = model.spec
    want = {"token_embd.weight": state["model.embed_tokens.weight"],
            "output_norm.weight": state["model.norm.weight"],
            "output.weight": state["lm_head.weight"]}  # fmt: skip
    for layer in range(spec.num_hidden_layers):
        ours = f"model.layers.{layer}"
        names = dict(table)
        if spec.moe_routing is not None:
            names.update(DENSE if layer in spec.mlp_only_layers else {})
            if layer not in spec.mlp_only_layers:
                for key, name in SPARSE.items():
                    want[f"blk.{layer}.{name}"] = state[f"{ours}.{key}"]
        for key, name in names.items():
            for suffix, tail in ((".weight", ".weight"), (".bias", ".bias"), ("", ".weight"),
                                 ("_bias", ".bias")):  # fmt: skip
                if f"{ours}.{key}{suffix}" in state:
                    want[f"blk.{layer}.{name}{tail}"] = state[f"{ours}.{key}{suffix}"]
    return want


@pytest.mark.parametrize(
    ("zoo", "overrides", "table", "keys"),
    [
        (glm4_moe, {}, GLM4_MOE, {"glm4moe.rope.dimension_count": 4,
                                  "glm4moe.leading_dense_block_count": 1,
                                  "glm4moe.expert_shared_count": 2,
                                  "glm4moe.expert_gating_func": 2,
                                  "glm4moe.expert_weights_norm": True,
                                  "glm4moe.expert_group_count": 2,
                                  "glm4moe.expert_group_used_count": 1}),
        (gpt_oss, {"rope_scaling": TRUNCATED_YARN}, GPT_OSS,
         {"gpt-oss.attention.sliding_window": 4, "gpt-oss.expert_count": 5,
          "gpt-oss.expert_used_count": 3, "gpt-oss.expert_feed_forward_length": 40,
          "gpt-oss.rope.scaling.factor": 4.0,
          "gpt-oss.rope.scaling.original_context_length": 128}),
    ],
    ids=["glm4_moe", "gpt_oss"],
)  # fmt: skip
def test_glm4_moe_and_gpt_oss_files_hold_llama_cpps_tensors_and_keys(
    tmp_path, zoo, overrides, table, keys
):
    import gguf

    folder = _model_dir(tmp_path, zoo, **overrides)
    model = from_hf(folder, dtype=torch.float32)
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f16"))
    stored = {t.name: t for t in reader.tensors}
    want = _names(model, table)
    assert sorted(stored) == sorted(want)
    for name, tensor in want.items():
        data = np.asarray(stored[name].data, dtype=np.float32)
        if tensor.ndim == 1 or name.endswith(".bias"):  # norms, biases, sinks: exact f32
            assert stored[name].tensor_type == gguf.GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(data, tensor.numpy(), err_msg=name)
        else:
            np.testing.assert_allclose(data, tensor.numpy(), atol=1e-3, err_msg=name)
    fields = _fields(reader)
    assert {key: fields[key] for key in keys} == pytest.approx(keys)


@pytest.mark.parametrize(
    ("zoo", "overrides", "words"),
    [  # llama.cpp's YaRN truncates the correction range: gpt-oss's own (truncate false) is not it
        (gpt_oss, {}, r"reads no \['truncate'\]"),
        (gpt_oss, {"rope_scaling": TRUNCATED_YARN,
                   "clamped_experts": ClampedExperts(swiglu_alpha=1.702, swiglu_limit=5.0)},
         "swiglu_limit=5.0"),
        (gpt_oss, {"rope_scaling": TRUNCATED_YARN, "layer_types": ("full_attention",
                   "sliding_attention", "full_attention")},
         "layer_types="),  # llama.cpp's gpt-oss: the window on the first of every two layers
        (glm4_moe, {"rope_scaling": TRUNCATED_YARN}, "rope_scaling 'yarn' is not supported"),
    ],
)  # fmt: skip
def test_what_llama_cpps_glm4moe_and_gpt_oss_compute_otherwise_is_refused(
    tmp_path, zoo, overrides, words
):
    folder = make_model_dir(tmp_path, family=zoo, **overrides)
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")


OLMO_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
             "attention_factor": 1.2079441541679836}  # fmt: skip


def test_olmo3s_yarn_is_written_for_its_global_layers_only(tmp_path):
    """OLMo 3's YaRN (its window layers rotating plainly, ``rope_local_theta`` the same base) is
    llama.cpp's olmo2 YaRN; window layers of another base are refused."""
    import gguf

    theta = olmo3.spec("olmo3_tiny").rope_theta
    folder = make_model_dir(tmp_path / "a", family=olmo3, rope_scaling=OLMO_YARN,
                            rope_local_theta=theta)  # fmt: skip
    fields = _fields(gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32")))
    assert (fields["olmo2.rope.scaling.factor"], fields["olmo2.rope.freq_base"]) == (8.0, theta)
    assert fields["olmo2.rope.scaling.original_context_length"] == 16
    assert fields["olmo2.attention.sliding_window"] == 4
    other = make_model_dir(tmp_path / "b", family=olmo3, rope_scaling=OLMO_YARN,
                           rope_local_theta=theta / 2)  # fmt: skip
    with pytest.raises(GGUFExportError, match=f"rope_local_theta={theta / 2!r}"):
        export_gguf(other, tmp_path / "b.gguf")


def test_a_kimi_k2_folder_exports_as_deepseek2(tmp_path):
    import json

    import gguf

    folder = _model_dir(tmp_path, deepseek_v3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    assert reader.fields["general.architecture"].contents() == "deepseek2"
    assert "blk.1.attn_k_b.weight" in {t.name for t in reader.tensors}
