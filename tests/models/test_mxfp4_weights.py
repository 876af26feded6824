"""MXFP4 gpt-oss checkpoints: our dequantization == transformers' own (its MXFP4 integration
dequantizes on CPU with ``Mxfp4Config(dequantize=True)``), on a crafted sharded folder; loading
writes nothing to disk and dequantizes one expert at a time, straight into the load dtype."""

from __future__ import annotations

import json
import tempfile
from collections import Counter

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations import mxfp4 as hf_mxfp4

from tests.models.conftest import randomize_
from tunesmith.models import from_hf, mxfp4_weights, spec_from_hf_config
from tunesmith.models.family import UnsupportedModelError
from tunesmith.models.mxfp4_weights import FP4_E2M1_VALUES, dequantize_experts, dequantize_mxfp4
from tunesmith.models.safetensors_io import CheckpointError

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


def test_dequantize_experts_equals_transformers_layout():
    blocks, scales = _random_mxfp4((3, 10, 64), torch.Generator().manual_seed(5))
    theirs = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(dequantize_experts(blocks, scales, torch.bfloat16), theirs)


def test_loading_writes_nothing_and_dequantizes_expert_by_expert_in_the_load_dtype(
    mxfp4_folder, tmp_path, monkeypatch
):
    """Nothing is written: the temporary directory is a file (so creating anything in it, even
    briefly, fails) and the folder is unchanged; each dequantization call gets one expert's
    blocks (so float32 values exist for one expert at a time) and the model's expert tensors
    are the bfloat16 values themselves (equal to the float32 load, cast)."""
    folder, state = mxfp4_folder
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    not_a_dir = tmp_path / "tmpdir"
    not_a_dir.write_text("")
    monkeypatch.setenv("TMPDIR", str(not_a_dir))
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_dir))
    calls = []

    def per_expert(blocks, scales, dtype=torch.float32):
        calls.append((tuple(blocks.shape), dtype))
        return dequantize_mxfp4(blocks, scales, dtype)

    monkeypatch.setattr(mxfp4_weights, "dequantize_mxfp4", per_expert)
    ours = from_hf(folder, dtype=torch.bfloat16)
    with pytest.raises(NotADirectoryError):  # what a temporary copy would have met
        tempfile.mkdtemp()
    assert not_a_dir.read_text() == ""
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    quantized = [n for n in state if n.endswith("_blocks")]
    expected_calls = [
        ((rows, groups, 16), torch.bfloat16)
        for n in sorted(quantized)
        for _ in range(state[n].shape[0])
        for rows, groups in [state[n].shape[1:3]]
    ]
    assert Counter(calls) == Counter(expected_calls)  # in the loader's order
    mine = ours.spec.checkpoint_renames.state_to_disk(ours.state_dict())
    for name in quantized:
        base = name.removesuffix("_blocks")
        full = dequantize_mxfp4(state[name], state[base + "_scales"]).transpose(1, 2)
        assert mine[base].dtype == torch.bfloat16
        assert torch.equal(mine[base], full.to(torch.bfloat16)), base


def _broken_copy(mxfp4_folder, tmp_path, change) -> None:
    """``mxfp4_folder`` as one file, its tensors edited by ``change``, in ``tmp_path``."""
    folder, _ = mxfp4_folder
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    change(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s.pop("model.layers.1.mlp.experts.down_proj_scales"),
            r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks' has no "
            r"'model\.layers\.1\.mlp\.experts\.down_proj_scales'",
        ),
        (
            lambda s: s.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
            r"'model\.layers\.0\.mlp\.experts\.gate_up_proj_scales' has no '.*_blocks'",
        ),
        (
            lambda s: s.update(
                {"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(3, 64, 2).byte()}
            ),
            r"'model\.layers\.0\.mlp\.experts\.down_proj_blocks' and '.*_scales' "
            r"\(model\.safetensors\) have shapes \[3, 64, 1, 16\] and \[3, 64, 2\]",
        ),
    ],
    ids=["no scales", "no blocks", "mis-shaped scales"],
)
def test_missing_or_misshaped_blocks_and_scales_are_named(mxfp4_folder, tmp_path, change, message):
    _broken_copy(mxfp4_folder, tmp_path, change)
    with pytest.raises(CheckpointError, match=message) as error:
        from_hf(tmp_path, dtype=torch.float32)
    assert str(tmp_path / "model.safetensors") in str(error.value)


def test_mxfp4_configs_are_read_other_quantizations_refused():
    config = {**transformers.GptOssConfig(**CONFIG).to_dict(), "quantization_config": QUANTIZATION}
    assert spec_from_hf_config(config).num_experts == 3
    config["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(UnsupportedModelError, match="gptq"):
        spec_from_hf_config(config)
