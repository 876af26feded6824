"""MXFP4 gpt-oss checkpoints: our dequantization == transformers' own (its MXFP4 integration
dequantizes on CPU with ``Mxfp4Config(dequantize=True)``), on a crafted sharded folder."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations import mxfp4 as hf_mxfp4

from tests.models.conftest import randomize_
from tunesmith.models import from_hf, spec_from_hf_config
from tunesmith.models.family import UnsupportedModelError
from tunesmith.models.mxfp4_weights import (
    FP4_E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp4_folder,
    dequantized_source,
)

QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}  # fmt: skip
# hidden and intermediate multiples of 32 (one MXFP4 block); 3 experts, top-2.
CONFIG = {"vocab_size": 131, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_local_experts": 3, "num_experts_per_tok": 2, "sliding_window": 4,
          "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": None}  # fmt: skip


def _random_mxfp4(shape: tuple[int, ...], gen: torch.Generator):
    """Random blocks (every code) and scales around 2 ** 0 for values ``shape`` ``[..., n]``."""
    *lead, n = shape
    blocks = torch.randint(0, 256, (*lead, n // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 130, (*lead, n // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A gpt-oss folder as published: experts as ``*_blocks``/``*_scales`` (two shards)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(**CONFIG), dtype=torch.float32
    )
    state = randomize_(hf, 0).state_dict()
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = state.pop(name).shape  # [E, in, out]: stored [E, out, in / 32, 16]
        state[name + "_blocks"], state[name + "_scales"] = _random_mxfp4((experts, cols, rows), gen)
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, keys in shards.items():
        save_file(
            {k: state[k].contiguous() for k in keys}, folder / file, metadata={"format": "pt"}
        )
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {**hf.config.to_dict(), "quantization_config": QUANTIZATION}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, state


def test_fp4_values_from_the_format_equal_transformers_table():
    assert list(FP4_E2M1_VALUES) == hf_mxfp4.FP4_VALUES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_convert_moe_packed_tensors(dtype):
    blocks, scales = _random_mxfp4((3, 10, 96), torch.Generator().manual_seed(2))
    theirs = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


def test_from_hf_equals_transformers_dequantized_model(mxfp4_folder):
    folder, _ = mxfp4_folder
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager",
    ).eval()  # fmt: skip
    ours = from_hf(folder, dtype=torch.float32).eval()
    mine = ours.spec.checkpoint_renames.state_to_disk(ours.state_dict())
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    ids = torch.randint(1, 131, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4


def test_dequantized_folder_maps_every_tensor_and_plain_folders_pass(mxfp4_folder, tmp_path):
    folder, state = mxfp4_folder
    out = dequantize_mxfp4_folder(folder, tmp_path / "deq", dtype=torch.float32)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {n.removesuffix("_blocks") for n in state if not n.endswith("_scales")}
    assert set(weight_map) == expected
    with dequantized_source(out) as source:  # no MXFP4 config: the folder itself
        assert source == out


def test_a_blocks_tensor_without_scales_is_refused_by_name(tmp_path):
    blocks, _ = _random_mxfp4((2, 4, 32), torch.Generator().manual_seed(4))
    save_file(
        {"model.layers.0.mlp.experts.down_proj_blocks": blocks}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj"):
        dequantize_mxfp4_folder(tmp_path, tmp_path / "out")


def test_mxfp4_configs_are_read_other_quantizations_refused():
    config = {**transformers.GptOssConfig(**CONFIG).to_dict(), "quantization_config": QUANTIZATION}
    assert spec_from_hf_config(config).num_experts == 3
    config["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(UnsupportedModelError, match="gptq"):
        spec_from_hf_config(config)
