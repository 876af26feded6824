"""GGUF export of Llama 4 text models as llama.cpp's ``llama4`` without llama.cpp: every tensor
under llama.cpp's name with its values and the keys the architecture reads, read back with the
``gguf`` package; what llama.cpp's ``llama4`` fixes otherwise (chunks of 8192, a NoPE layer every
4th, the temperature's 8192 / 0.1, the qk-norm except at 128 experts, MoE layers every n-th) is
refused by name. ``test_gguf_llama_cpp.py`` (marker ``llama_cpp``) runs the files in llama.cpp,
on a short prompt and on one past the first chunk of 8192 positions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.models.test_gguf_export import _fields
from tests.recipes.sft_world import make_model_dir
from tunesmith.models.gguf_arches import ARCHES, unsupported
from tunesmith.models.gguf_export import GGUFExportError, export_gguf, llama3_rope_factors
from tunesmith.models.hf import from_hf
from tunesmith.models.zoo import llama4
from tunesmith.modules.moe import stacked_state

# Scout's RoPE scaling (llama.cpp reads it as rope_freqs)
SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
# llama4_tiny as llama.cpp's llama4 computes it: 4 layers, chunked RoPE layers 0-2, NoPE layer 3,
# the published chunk and temperature, MoE layers 1 and 3 (interleave_moe_layer_step 2)
LLAMA_CPP = {"num_hidden_layers": 4, "nope_layers": (3,), "mlp_only_layers": (0, 2),
             "layer_types": ("chunked_attention",) * 3 + ("full_attention",),
             "attention_chunk_size": 8192, "floor_scale": 8192.0, "attn_scale": 0.1,
             "max_position_embeddings": 16384, "rope_scaling": SCOUT_ROPE}  # fmt: skip
LAYER = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight",
         "input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight"}  # fmt: skip
DENSE = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
SPARSE = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.gate_proj": "ffn_gate_exps.weight",
          "mlp.experts.up_proj": "ffn_up_exps.weight",
          "mlp.experts.down_proj": "ffn_down_exps.weight",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}  # fmt: skip


def _expected(model) -> dict[str, torch.Tensor]:
    """llama.cpp's name -> the tensor it should hold, from our model's state dict."""
    with stacked_state(model):
        state = model.state_dict()
    spec = model.spec
    want = {"token_embd.weight": state["model.embed_tokens.weight"],
            "output_norm.weight": state["model.norm.weight"],
            "output.weight": state["lm_head.weight"],
            "rope_freqs.weight": llama3_rope_factors(spec)}  # fmt: skip
    for layer in range(spec.num_hidden_layers):
        table = {**LAYER, **(SPARSE if spec.is_moe_layer(layer) else DENSE)}
        for key, name in table.items():
            want[f"blk.{layer}.{name}"] = state[f"model.layers.{layer}.{key}"]
    return want


def test_a_llama4_file_holds_llama_cpps_tensors_and_keys(tmp_path):
    import gguf

    folder = make_model_dir(tmp_path, family=llama4, **LLAMA_CPP)
    model = from_hf(folder, dtype=torch.float32)
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = _expected(model)
    assert sorted(stored) == sorted(want)
    for name, tensor in want.items():  # q/k rows as they are: Llama 4 rotates interleaved pairs
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)
    fields = _fields(reader)
    assert reader.fields["general.architecture"].contents() == "llama4"
    keys = {"interleave_moe_layer_step": 2, "expert_count": 3, "expert_used_count": 1,
            "expert_feed_forward_length": 40, "feed_forward_length": 80, "block_count": 4,
            "rope.dimension_count": 12, "attention.head_count_kv": 2}  # fmt: skip
    assert {key: fields[f"llama4.{key}"] for key in keys} == keys
    # no window key: llama.cpp's llama4 then chunks by its own 8192 (a 0 would turn chunks off)
    assert "llama4.attention.sliding_window" not in fields


def test_the_published_llama4_configs_are_llama_cpps():
    arch = ARCHES["llama4_text"]
    assert unsupported(llama4.spec("llama4_scout_17b_16e"), arch) == []
    assert unsupported(llama4.spec("llama4_maverick_17b_128e"), arch) == []  # no qk-norm
    # llama.cpp's llama4 norms q/k unless it has 128 experts (Maverick, "17B-128E")
    other = llama4.spec("llama4_maverick_17b_128e", qk_l2_norm=True)
    assert unsupported(other, arch) == ["qk_l2_norm=True"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({}, "attention_chunk_size=3, floor_scale=2.0, attn_scale=0.5"),  # llama4_tiny's own
        ({"qk_l2_norm": False}, r"compute qk_l2_norm=False$"),  # 3 experts: llama.cpp norms
        ({"attn_temperature_tuning": False}, "attn_temperature_tuning=False"),
        ({"attn_scale": 0.2}, "attn_scale=0.2"),
        ({"attention_chunk_size": 4096}, "attention_chunk_size=4096"),
        ({"nope_layers": (2,)}, r"nope_layers=\(2,\)"),  # llama.cpp: NoPE on every 4th layer
        ({"layer_types": ("chunked_attention",) * 2 + ("full_attention",) * 2},
         "layer_types="),
        ({"mlp_only_layers": (0,)}, r"mlp_only_layers=\(0,\) \(MoE layers not every n-th\)"),
    ],
)  # fmt: skip
def test_what_llama_cpps_llama4_computes_otherwise_is_refused(tmp_path, overrides, words):
    settings = {**LLAMA_CPP, **overrides} if overrides else {}
    folder = make_model_dir(tmp_path, family=llama4, **settings)
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left


def test_a_model_type_without_a_llama_cpp_architecture_is_refused_by_name(tmp_path):
    folder = make_model_dir(tmp_path, family=llama4, **LLAMA_CPP)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    families = ("deepseek_v2, deepseek_v3, gemma2, gemma3_text, glm4, glm4_moe, gpt_oss, granite, "
                "kimi_k2, llama, llama4_text, mistral, mixtral, olmo2, olmo3, phi3, qwen2, qwen3, "
                "qwen3_moe, smollm3; 'mamba' is not supported yet")  # fmt: skip
    with pytest.raises(GGUFExportError, match=families):
        export_gguf(folder, tmp_path / "m.gguf")
