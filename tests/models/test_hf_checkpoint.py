"""HF checkpoints in and out: parity with transformers, sharding, dtypes, memory, errors, atomicity.

Every checkpoint here is a tiny random transformers model saved with ``save_pretrained`` into a
temporary folder; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.models.conftest import HF_FAMILIES, tiny_hf_config
from tunesmith.models import atomic, safetensors_io
from tunesmith.models import hf as hf_io
from tunesmith.models.builder import build_model
from tunesmith.models.hf import (
    CheckpointError,
    from_hf,
    load_hf_weights,
    save_hf_checkpoint,
    write_hf_checkpoint,
)
from tunesmith.models.safetensors_io import (
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    atomic_directory,
    parse_size,
    plan_shards,
)
from tunesmith.models.spec import ModelSpec, UnsupportedModelError

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
)
# Hand-written configs of the first families (other tests here rely on their sizes); every
# other family of HF_FAMILIES gets its tests/models/conftest.py config (features that set it
# apart switched on), so a family added there is covered by the parity tests below at once.
_OWN_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, head_dim=8),
}
FAMILIES = {f: _OWN_CONFIGS.get(f, partial(tiny_hf_config, f)) for f in HF_FAMILIES}


# ----------------------------------------------------------------------------- helpers


def _hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny transformers model with weights large enough for O(1) logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def _input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(_input_ids()).logits


def _our_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_input_ids())


def _load_with_transformers(folder: Path) -> tuple[transformers.PreTrainedModel, list[str]]:
    """transformers' model from ``folder`` and every warning its loggers emitted meanwhile."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True
        )
    finally:
        logger.removeHandler(handler)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info["error_msgs"] else {}
    )
    assert not problems, f"transformers loading {folder}: {problems}"
    return model.eval(), records


def _tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """family -> (folder saved by transformers, transformers' logits on ``_input_ids()``)."""
    root = tmp_path_factory.mktemp("hf")
    folders = {}
    for family in FAMILIES:
        model = _hf_model(family)
        model.save_pretrained(root / family)
        folders[family] = (root / family, _hf_logits(model))
    return folders


@pytest.fixture
def llama_dir(hf_folders, tmp_path: Path) -> Path:
    """A private copy of the llama folder, free to damage."""
    return Path(shutil.copytree(hf_folders["llama"][0], tmp_path / "llama"))


@pytest.fixture
def qwen2_dir(hf_folders, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_folders["qwen2"][0], tmp_path / "qwen2"))


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_logits_match_transformers(family: str, hf_folders) -> None:
    folder, expected = hf_folders[family]
    model = from_hf(folder)
    assert model.spec.model_type == family
    torch.testing.assert_close(_our_logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_loads_in_transformers(family: str, hf_folders, tmp_path: Path) -> None:
    folder, expected = hf_folders[family]
    out = save_hf_checkpoint(from_hf(folder), tmp_path / "out")
    # Same tensor names as transformers itself writes (a tied head is not stored).
    assert _tensor_names(out) == _tensor_names(folder)
    source = json.loads((folder / "config.json").read_text())
    assert ("lm_head.weight" in _tensor_names(out)) == (not source["tie_word_embeddings"])
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == (family, source["architectures"])
    reloaded, warnings = _load_with_transformers(out)
    assert warnings == []
    assert type(reloaded).__name__ == source["architectures"][0]
    assert torch.equal(_hf_logits(reloaded), _hf_logits(_load_with_transformers(folder)[0]))
    torch.testing.assert_close(_hf_logits(reloaded), expected, rtol=1e-5, atol=1e-5)


def test_sharded_save_loads_in_both(hf_folders, tmp_path: Path) -> None:
    folder, expected = hf_folders["qwen3_moe"]
    model = from_hf(folder)
    out = save_hf_checkpoint(model, tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert not (out / SAFE_WEIGHTS_NAME).exists()
    index = json.loads((out / SAFE_INDEX_NAME).read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            names = set(f.keys())
        assert names == {n for n, file in index["weight_map"].items() if file == shard.name}
        assert sum(state[n].nbytes for n in names) <= 20_000 or len(names) == 1
    torch.testing.assert_close(_our_logits(from_hf(out)), expected, rtol=1e-5, atol=1e-5)
    reloaded, _ = _load_with_transformers(out)
    torch.testing.assert_close(_hf_logits(reloaded), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_transformers_sharded_checkpoint_loads(family: str, tmp_path: Path) -> None:
    hf_model = _hf_model(family, seed=3)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 3
    model = from_hf(tmp_path / "hf")
    torch.testing.assert_close(_our_logits(model), _hf_logits(hf_model), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dtypes, init


def test_bf16_load_gives_bf16_params(hf_folders) -> None:
    folder, _ = hf_folders["qwen3"]
    model = from_hf(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # computed, never cast
    reference = load_file(str(folder / SAFE_WEIGHTS_NAME))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_dtype_defaults_to_config(hf_folders, tmp_path: Path) -> None:
    hf_model = _hf_model("llama").to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = from_hf(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32 = from_hf(tmp_path / "bf16", dtype="fp32")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


def test_save_in_bf16_writes_bf16(hf_folders, tmp_path: Path) -> None:
    folder, _ = hf_folders["qwen2"]
    out = save_hf_checkpoint(from_hf(folder), tmp_path / "bf16", dtype="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(out / SAFE_WEIGHTS_NAME), "pt") as f:
        names = f.keys()
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    reloaded, _ = _load_with_transformers(out)
    assert reloaded.dtype == torch.bfloat16


def test_load_weights_false_is_random_init_of_same_shapes(hf_folders, tmp_path: Path) -> None:
    folder, _ = hf_folders["qwen3_moe"]
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only / "config.json")
    random_model = from_hf(config_only, load_weights=False)
    loaded = from_hf(folder)
    random_state, loaded_state = random_model.state_dict(), loaded.state_dict()
    assert {k: v.shape for k, v in random_state.items()} == {
        k: v.shape for k, v in loaded_state.items()
    }
    for name, tensor in random_state.items():
        assert not tensor.is_meta
        if "norm" not in name:  # norms start at one in both
            assert not torch.equal(tensor, loaded_state[name]), name
    assert _our_logits(random_model).shape == (2, 12, VOCAB)


# ----------------------------------------------------------------------------- tied weights


def test_tied_checkpoint_with_and_without_lm_head(qwen2_dir: Path) -> None:
    assert "lm_head.weight" not in _tensor_names(qwen2_dir)
    model = from_hf(qwen2_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = load_file(str(qwen2_dir / SAFE_WEIGHTS_NAME))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(qwen2_dir / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    both = from_hf(qwen2_dir)
    assert both.lm_head.weight is both.model.embed_tokens.weight
    assert torch.equal(_our_logits(both), _our_logits(model))


def test_tied_checkpoint_with_different_lm_head_is_an_error(qwen2_dir: Path) -> None:
    state = load_file(str(qwen2_dir / SAFE_WEIGHTS_NAME))
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0
    save_file(state, str(qwen2_dir / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*differs.*model\.safetensors"):
        from_hf(qwen2_dir)


class _TiedPlain(torch.nn.Module):
    """A module without load hooks whose state dict lists both tied names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("stored", ["emb.weight", "head.weight", "both"])
def test_load_into_plain_module_reties(tmp_path: Path, stored: str) -> None:
    weight = torch.randn(10, 4)
    names = ["emb.weight", "head.weight"] if stored == "both" else [stored]
    tmp_path.joinpath("ckpt").mkdir()
    save_file({n: weight.clone() for n in names}, str(tmp_path / "ckpt" / SAFE_WEIGHTS_NAME))
    with torch.device("meta"):
        module = _TiedPlain()
    safetensors_io.load_into_module(module, tmp_path / "ckpt")
    assert module.head.weight is module.emb.weight
    assert torch.equal(module.emb.weight, weight)
    safetensors_io.assert_no_meta(module)


# ----------------------------------------------------------------------------- memory


def _file_mappings(paths: list[Path]) -> list[tuple[int, int]]:
    wanted = {str(p.resolve()) for p in paths}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in wanted:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_load_without_cast_keeps_the_file_mapping(hf_folders, tmp_path: Path) -> None:
    """No second copy: every parameter's bytes are the safetensors file's own mapping."""
    folder, _ = hf_folders["llama"]
    sharded = save_hf_checkpoint(from_hf(folder), tmp_path / "s", max_shard_size="20KB")
    model = from_hf(sharded)  # fp32 file, fp32 model, CPU: nothing to convert
    ranges = _file_mappings(sorted(sharded.glob("*.safetensors")))
    assert ranges
    for name, param in model.named_parameters():
        ptr = param.data_ptr()
        assert any(start <= ptr < end for start, end in ranges), f"{name} was copied"


_RSS_CHILD = textwrap.dedent(
    """
    import gc, glob, sys, torch
    from safetensors.torch import load_file
    from tunesmith.models.builder import build_model
    from tunesmith.models.hf import from_hf, spec_from_hf_folder

    def status_mb(field):  # VmRSS / VmHWM of this process (ru_maxrss survives exec: unusable)
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024

    def reset_peak():
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        return status_mb("VmRSS")

    def naive(folder):  # the obvious way: random-init a real model, read all shards, copy in
        model = build_model(spec_from_hf_folder(folder), dtype=torch.bfloat16)
        state = {}
        for path in sorted(glob.glob(folder + "/*.safetensors")):
            state.update(load_file(path))
        model.load_state_dict(state)
        return model

    folder = sys.argv[1]
    torch.empty(1, device="meta") + 1  # torch's one-time meta-kernel setup (~70 MB) first
    for name, load in [("ours", lambda: from_hf(folder, dtype=torch.bfloat16)), ("naive", lambda: naive(folder))]:
        before = reset_peak()
        model = load()
        print(name, status_mb("VmHWM") - before)
        del model
    """
)


@pytest.mark.slow  # two fresh interpreters and a 70 MB checkpoint: ~15 s on a busy 2-core box
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_is_model_plus_one_shard(tmp_path: Path) -> None:
    """Loading fp32 shards as bf16 peaks at the bf16 model + one fp32 shard (+ slack);
    the same measurement of a naive loader (whole state dict + initialised model) exceeds it."""
    spec = ModelSpec(
        model_type="llama",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
    )
    save_hf_checkpoint(build_model(spec), tmp_path / "ckpt", max_shard_size=6 * 2**20)
    n_params = sum(p.numel() for p in build_model(spec, device="meta").parameters())
    model_mb = n_params * 2 / 2**20  # bf16
    largest_shard = max(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))
    bound = model_mb + largest_shard / 2**20 + 12
    result = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    peaks = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines()}
    assert model_mb * 0.9 < peaks["ours"] < bound, (peaks, model_mb, bound)
    assert peaks["naive"] > bound, (peaks, bound)


# ----------------------------------------------------------------------------- read errors


def _rewrite(path: Path, change) -> None:
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(llama_dir: Path) -> None:
    _rewrite(llama_dir / SAFE_WEIGHTS_NAME, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj"):
        from_hf(llama_dir)


def test_unexpected_tensor_is_named_with_its_file(llama_dir: Path) -> None:
    _rewrite(
        llama_dir / SAFE_WEIGHTS_NAME,
        lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
    )
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.extra\.weight' in model\.safetensors"
    ):
        from_hf(llama_dir)


def test_wrong_shape_names_file_expected_and_got(llama_dir: Path) -> None:
    _rewrite(
        llama_dir / SAFE_WEIGHTS_NAME,
        lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 32)}),
    )
    with pytest.raises(CheckpointError) as err:
        from_hf(llama_dir)
    message = str(err.value)
    assert str(llama_dir / SAFE_WEIGHTS_NAME) in message
    assert "model.layers.0.self_attn.q_proj.weight" in message
    assert "[16, 32]" in message and "[32, 32]" in message


def test_missing_shard_is_named(hf_folders, tmp_path: Path) -> None:
    folder, _ = hf_folders["llama"]
    out = save_hf_checkpoint(from_hf(folder), tmp_path / "s", max_shard_size="20KB")
    victim = sorted(out.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{SAFE_INDEX_NAME}.*'{victim.name}'") as err:
        from_hf(out)
    assert isinstance(err.value, FileNotFoundError)


def test_index_pointing_to_wrong_shard_is_named(hf_folders, tmp_path: Path) -> None:
    folder, _ = hf_folders["llama"]
    out = save_hf_checkpoint(from_hf(folder), tmp_path / "s", max_shard_size="20KB")
    index = json.loads((out / SAFE_INDEX_NAME).read_text())
    name = "model.norm.weight"
    other = next(
        f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name]
    )
    index["weight_map"][name] = other
    (out / SAFE_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model\.norm\.weight.*{other}"):
        from_hf(out)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_is_named(llama_dir: Path, damage: str) -> None:
    path = llama_dir / SAFE_WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-100], "garbage": b"\x00" * 64, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"{path}.*not a valid safetensors file"):
        from_hf(llama_dir)


def test_missing_config_is_named(llama_dir: Path) -> None:
    (llama_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{llama_dir / 'config.json'} not found") as err:
        from_hf(llama_dir)
    assert isinstance(err.value, FileNotFoundError)


def test_unsupported_model_type_names_folder(llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=rf"{llama_dir}.*no_such_arch"):
        from_hf(llama_dir)


def test_weights_of_another_type_are_refused_not_drawn(llama_dir: Path) -> None:
    """gpt2 (the transformers backend) over Llama weights: transformers' loader would draw the
    missing tensors at random; refused naming them."""
    config = json.loads((llama_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gpt2 model: missing_keys \[.*'transformer\.h"):
        from_hf(llama_dir)


def test_no_weights_is_named(llama_dir: Path) -> None:
    (llama_dir / SAFE_WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match=rf"no weights found in {llama_dir}"):
        from_hf(llama_dir)
    (llama_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*only safetensors"):
        from_hf(llama_dir)


def test_load_hf_weights_into_existing_model(hf_folders) -> None:
    folder, expected = hf_folders["qwen3"]
    model = build_model(from_hf(folder, load_weights=False).spec)  # real, randomly initialised
    assert not torch.allclose(_our_logits(model), expected)
    load_hf_weights(model, folder)
    torch.testing.assert_close(_our_logits(model), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- save details


def test_save_rejects_state_dict_of_other_architecture(hf_folders, tmp_path: Path) -> None:
    model = from_hf(hf_folders["llama"][0])
    state = model.state_dict()
    state["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
    with pytest.raises(CheckpointError, match=r"unexpected.*lora_A"):
        save_hf_checkpoint(state, tmp_path / "x", spec=model.spec)
    state = model.state_dict()
    state["model.norm.weight"] = torch.ones(16)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\[16\].*\[32\]"):
        save_hf_checkpoint(state, tmp_path / "x", spec=model.spec)
    assert not (tmp_path / "x").exists()
    assert _leftovers(tmp_path, "x") == []


def test_save_plain_state_dict_with_tied_head(hf_folders, tmp_path: Path) -> None:
    """A gathered state dict may carry the tied head explicitly; it is dropped like HF does."""
    folder, expected = hf_folders["qwen2"]
    model = from_hf(folder)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    out = save_hf_checkpoint(state, tmp_path / "out", spec=model.spec)
    assert "lm_head.weight" not in _tensor_names(out)
    torch.testing.assert_close(_our_logits(from_hf(out)), expected, rtol=1e-5, atol=1e-5)


def _tiny_tokenizer_files(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        ["one two three four", "five six seven"] * 10,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )


def test_tokenizer_and_generation_config_are_copied(qwen2_dir: Path, tmp_path: Path) -> None:
    _tiny_tokenizer_files(qwen2_dir)
    generation = {"bos_token_id": 1, "eos_token_id": [2, 5], "temperature": 0.7}
    (qwen2_dir / "generation_config.json").write_text(json.dumps(generation))
    out = save_hf_checkpoint(from_hf(qwen2_dir), tmp_path / "out", source_dir=qwen2_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (qwen2_dir / name).read_bytes(), name
    assert json.loads((out / "generation_config.json").read_text()) == generation
    from tokenizers import Tokenizer

    expected_ids = Tokenizer.from_file(str(qwen2_dir / "tokenizer.json")).encode("one two").ids
    assert len(expected_ids) >= 2
    assert transformers.AutoTokenizer.from_pretrained(out)("one two")["input_ids"] == expected_ids


def test_generation_config_from_spec_or_argument(hf_folders, tmp_path: Path) -> None:
    model = from_hf(hf_folders["llama"][0])
    out = save_hf_checkpoint(model, tmp_path / "derived")
    derived = json.loads((out / "generation_config.json").read_text())
    assert derived["bos_token_id"] == 1 and derived["eos_token_id"] == 2
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    out = save_hf_checkpoint(model, tmp_path / "given", generation_config={"top_p": 0.5})
    assert json.loads((out / "generation_config.json").read_text()) == {"top_p": 0.5}


def test_save_into_its_own_source_folder(qwen2_dir: Path) -> None:
    _tiny_tokenizer_files(qwen2_dir)
    tokenizer_bytes = (qwen2_dir / "tokenizer.json").read_bytes()
    model = from_hf(qwen2_dir)  # its parameters are mappings of the file being replaced
    expected = _our_logits(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    save_hf_checkpoint(model, qwen2_dir, source_dir=qwen2_dir)
    assert (qwen2_dir / "tokenizer.json").read_bytes() == tokenizer_bytes
    reloaded = from_hf(qwen2_dir)
    assert torch.equal(reloaded.model.norm.weight, model.model.norm.weight)
    assert not torch.equal(_our_logits(reloaded), expected)
    assert _leftovers(qwen2_dir.parent, qwen2_dir.name) == []


# ----------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_failed_save_leaves_previous_checkpoint_intact(
    hf_folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    model = from_hf(hf_folders["llama"][0])
    out = save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_size="20KB")
    before = _digest(out)

    real_write = safetensors_io._write_shard
    calls = []

    def crash_after_first(tensors, path, metadata):
        if calls:
            raise OSError("disk full")
        calls.append(path)
        real_write(tensors, path, metadata)

    monkeypatch.setattr(safetensors_io, "_write_shard", crash_after_first)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(model, out, max_shard_size="20KB")
    assert len(calls) == 1
    assert _digest(out) == before
    assert _leftovers(tmp_path, "ckpt") == []

    monkeypatch.setattr(safetensors_io, "_write_shard", real_write)
    save_hf_checkpoint(model, out, max_shard_size="20KB")
    assert torch.equal(from_hf(out).model.norm.weight, model.model.norm.weight)
    assert _digest(out) != before
    assert _leftovers(tmp_path, "ckpt") == []


def test_atomic_directory_composes_with_extra_files(hf_folders, tmp_path: Path) -> None:
    """Training checkpoints add their own files inside the same atomic directory."""
    model = from_hf(hf_folders["llama"][0])
    with atomic_directory(tmp_path / "step_1") as tmp:
        write_hf_checkpoint(model, tmp)
        torch.save({"step": 1}, tmp / "training_state.pt")
        assert not (tmp_path / "step_1").exists()
    assert torch.load(tmp_path / "step_1" / "training_state.pt", weights_only=True) == {"step": 1}
    assert (tmp_path / "step_1" / SAFE_WEIGHTS_NAME).is_file()


def test_atomic_directory_honours_umask(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    with atomic_directory(tmp_path / "shared") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o777 & ~umask


def test_atomic_directory_refuses_to_replace_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    with (
        pytest.raises(CheckpointError, match="not a directory"),
        atomic_directory(tmp_path / "taken") as tmp,
    ):
        (tmp / "a").write_text("a")
    assert (tmp_path / "taken").read_text() == "x"
    assert _leftovers(tmp_path, "taken") == []


# ----------------------------------------------------------------------------- small units


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size("20KB") == 20_000
    assert parse_size(123) == 123
    for bad in ("5 parsecs", "", -1, 0, "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_shards_respects_the_limit_and_order() -> None:
    sizes = {"a": 3, "b": 3, "c": 3, "big": 50, "d": 1}
    assert plan_shards(sizes, 7) == [["a", "b"], ["c"], ["big"], ["d"]]
    assert plan_shards(sizes, 1000) == [["a", "b", "c", "big", "d"]]


def test_dtype_names() -> None:
    assert hf_io.resolve_dtype("bf16") is torch.bfloat16
    assert hf_io.resolve_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        hf_io.resolve_dtype("int4")
