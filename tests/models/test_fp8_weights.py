"""Block-scaled FP8 folders (DeepSeek-V3's ``weight_scale_inv``) dequantized on load, and
multi-token-prediction layers skipped: on a crafted folder, our weights equal transformers' own
dequantization (FineGrainedFP8, which dequantizes on a machine without a GPU); partial edge
blocks (which transformers refuses) equal the formula computed independently in float64."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tunesmith.models import from_hf
from tunesmith.models.fp8_weights import dequantize_block_fp8
from tunesmith.models.safetensors_io import CheckpointError, DerivedTensor, load_into_module
from tunesmith.models.spec import UnsupportedModelError

BLOCK = (8, 8)
FP8_MAX = 448.0


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as FP8 blocks and their float32 ``scale_inv`` (block amax / 448)."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // 8, 8, cols // 8, 8)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale.float()


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A DeepSeek-V3 folder whose projections are FP8 with 8 x 8 blocks, plus one MTP layer."""
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128,
        num_mtp_layers=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("fp8")
    hf.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            out[name], out[name + "_scale_inv"] = _quantize(tensor)
        else:
            out[name] = tensor
    out["model.layers.2.eh_proj.weight"] = torch.randn(32, 64)  # the MTP layer: never loaded
    out["model.layers.2.enorm.weight"] = torch.ones(32)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((folder / "config.json").read_text())
    written["num_nextn_predict_layers"] = 1
    written["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(written))
    return folder


def test_fp8_folder_loads_as_transformers_dequantizes_it(fp8_folder, caplog):
    with caplog.at_level(logging.WARNING):
        ours = from_hf(fp8_folder, dtype=torch.float32).eval()
    assert "multi-token-prediction" in caplog.text and "1 multi-token" in caplog.text
    assert "dequantized on load" in caplog.text
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        fp8_folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    mine = ours.state_dict()
    checked = 0
    for name, tensor in theirs.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for i in range(tensor.shape[0]):
                assert torch.equal(mine[f"{base}{i}.gate_proj.weight"], gate[i])
                assert torch.equal(mine[f"{base}{i}.up_proj.weight"], up[i])
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for i in range(tensor.shape[0]):
                assert torch.equal(mine[f"{base}{i}.down_proj.weight"], tensor[i])
        else:
            assert torch.equal(mine[name], tensor), name
        checked += 1
    assert checked == len(theirs.state_dict())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4
    # The FP8 numbers themselves were read (not the unquantized values they came from).
    raw = load_file(fp8_folder / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    assert raw[name].dtype == torch.float8_e4m3fn
    expected = raw[name].float() * raw[name + "_scale_inv"].repeat_interleave(
        8, 0
    ).repeat_interleave(8, 1)
    assert torch.equal(mine[name], expected)


def test_partial_edge_blocks_equal_the_float64_formula():
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(20, 13, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.1
    got = dequantize_block_fp8(weight, scale, BLOCK)
    expected = torch.empty(20, 13, dtype=torch.float64)
    for r in range(20):
        for c in range(13):
            expected[r, c] = float(weight[r, c].float()) * float(scale[r // 8, c // 8])
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"needs a scale of shape \[3, 2\]"):
        dequantize_block_fp8(weight, scale[:2], BLOCK)


def test_fp8_weight_without_its_scale_is_named(fp8_folder, tmp_path):
    state = load_file(fp8_folder / "model.safetensors")
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    _copy_config(fp8_folder, tmp_path)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="o_proj.weight' has no"):
        from_hf(tmp_path, dtype=torch.float32)


def _copy_config(source, target) -> None:
    for name in ("config.json", "generation_config.json"):
        if (source / name).exists():
            (target / name).write_bytes((source / name).read_bytes())


def test_scales_in_another_shard_load_the_same_weights(fp8_folder, tmp_path):
    """Every scale in the second shard, its weight in the first: read across shards."""
    state = load_file(fp8_folder / "model.safetensors")
    shards = {"model-00001-of-00002.safetensors": [n for n in state if "_scale_inv" not in n],
              "model-00002-of-00002.safetensors": [n for n in state if "_scale_inv" in n]}  # fmt: skip
    for file, names in shards.items():
        save_file({n: state[n] for n in names}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in shards.items() for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _copy_config(fp8_folder, tmp_path)
    sharded = from_hf(tmp_path, dtype=torch.bfloat16).state_dict()
    single = from_hf(fp8_folder, dtype=torch.bfloat16).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[n], single[n]) for n in single)
    name = "model.layers.0.self_attn.o_proj.weight"
    scale = state[name + "_scale_inv"].repeat_interleave(8, 0).repeat_interleave(8, 1)
    assert torch.equal(sharded[name], (state[name].float() * scale).bfloat16())


def test_a_misshaped_scale_is_named_with_its_file(fp8_folder, tmp_path):
    state = load_file(fp8_folder / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    state[name + "_scale_inv"] = state[name + "_scale_inv"][:, :1].contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _copy_config(fp8_folder, tmp_path)
    rows, cols = state[name].shape
    with pytest.raises(UnsupportedModelError) as error:
        from_hf(tmp_path, dtype=torch.float32)
    assert str(error.value) == (
        f"{tmp_path / 'model.safetensors'}: '{name}_scale_inv' has shape [{rows // 8}, 1]; "
        f"FP8 tensor '{name}' [{rows}, {cols}] with block [8, 8] needs [{rows // 8}, {cols // 8}]"
    )


def test_other_quantized_folders_and_bad_blocks_are_refused(fp8_folder, tmp_path):
    config = json.loads((fp8_folder / "config.json").read_text())
    for quant, message in (
        ({"quant_method": "bitsandbytes"}, "pre-quantized checkpoints"),
        ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size=None"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        (tmp_path / "model.safetensors").write_bytes(b"")
        with pytest.raises((UnsupportedModelError, CheckpointError), match=message):
            from_hf(tmp_path, dtype=torch.float32)


def test_derived_tensors_read_their_inputs_and_conflicts_are_named(tmp_path):
    """The loader's general mechanism: a tensor computed from two stored ones in its load dtype;
    an input no file holds, an input read twice, or a computed name also stored is refused."""
    save_file(
        {"w": torch.full((2, 3), 3.0), "w_scale": torch.tensor(0.5), "b": torch.ones(2)},
        tmp_path / "model.safetensors",
    )
    module = torch.nn.Linear(3, 2, device="meta")

    def scaled(name="weight", inputs=("w", "w_scale")):
        return lambda infos: {name: DerivedTensor(inputs, (2, 3), _times)}

    renames = {"b": "bias"}.get
    load_into_module(
        module, tmp_path, dtype=torch.bfloat16, rename=lambda n: renames(n, n), derive=scaled()
    )
    assert module.weight.dtype == torch.bfloat16
    assert torch.equal(module.weight, torch.full((2, 3), 1.5, dtype=torch.bfloat16))
    for derive, message in (
        (scaled(inputs=("w", "gone")), "'weight' is computed from 'gone', which no file holds"),
        (lambda i: scaled()(i) | scaled("x")(i), "'w' is read for both 'weight' and 'x'"),
        (scaled(name="b"), "tensor 'b' is stored and also computed from"),
    ):
        with pytest.raises(CheckpointError, match=message):
            load_into_module(torch.nn.Linear(3, 2, device="meta"), tmp_path, derive=derive)


def _times(weight: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    return (weight * scale).to(dtype)
