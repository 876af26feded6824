"""ModelSpec <-> config.json, size tables against published configs and parameter counts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tunesmith.models import (
    ModelSpec,
    UnsupportedModelError,
    build_model,
    llama3,
    mistral,
    qwen2_5,
    qwen3,
    qwen3_moe,
    spec_from_hf_config,
)

FAMILY_MODULES = (llama3, qwen2_5, qwen3, qwen3_moe, mistral)
ALL_SIZES = [(fam, name) for fam in FAMILY_MODULES for name in fam.SIZES]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral"])
def test_config_json_builds_same_names_and_shapes_as_transformers(model_type, hf_tiny, tmp_path):
    overrides = {"tie_word_embeddings": True} if model_type in ("qwen2", "qwen3") else {}
    hf_tiny.write_checkpoint(tmp_path, model_type, **overrides)
    config = json.loads((tmp_path / "config.json").read_text())
    model = build_model(spec_from_hf_config(config), device="meta")
    on_disk = {k: tuple(v.shape) for k, v in hf_tiny.read_safetensors(tmp_path).items()}
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == on_disk


# Published config.json files (as written by transformers 4.x), verbatim in the fields we read.
PUBLISHED = {
    ("llama3", "llama3_1_8b"): {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    ("llama3", "llama3_2_3b"): {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 24,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    ("qwen2_5", "qwen2_5_0_5b"): {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    },
    ("qwen3", "qwen3_4b"): {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 0.000001, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": False, "use_sliding_window": False, "vocab_size": 151936,
    },
    ("qwen3_moe", "qwen3_30b_a3b"): {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    ("mistral", "mistral_7b_v0_3"): {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 32768,
    },
}  # fmt: skip


@pytest.mark.parametrize("key", list(PUBLISHED), ids=[name for _, name in PUBLISHED])
def test_size_tables_equal_published_configs(key):
    family = {m.__name__.rsplit(".", 1)[-1]: m for m in FAMILY_MODULES}[key[0]]
    assert spec_from_hf_config(PUBLISHED[key]) == family.spec(key[1])


def test_transformers5_style_config_reads_the_same():
    """transformers 5 writes ``rope_parameters`` and ``num_local_experts`` instead."""
    legacy = PUBLISHED[("qwen3_moe", "qwen3_30b_a3b")]
    new = {
        k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling", "num_experts")
    }
    new.update(
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        num_local_experts=128,
        dtype="bfloat16",
    )
    assert spec_from_hf_config(new) == spec_from_hf_config(legacy)
    llama = PUBLISHED[("llama3", "llama3_1_8b")]
    new = {k: v for k, v in llama.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**llama["rope_scaling"], "rope_theta": 500000.0}
    assert spec_from_hf_config(new) == spec_from_hf_config(llama)


@pytest.mark.parametrize(("family", "name"), ALL_SIZES, ids=[n for _, n in ALL_SIZES])
def test_to_hf_config_round_trips(family, name):
    spec = family.spec(name)
    config = json.loads(json.dumps(spec.to_hf_config()))  # must be plain JSON
    assert spec_from_hf_config(config) == spec


@pytest.mark.parametrize(
    "factory",
    [
        llama3.llama3_tiny,
        qwen2_5.qwen2_5_tiny,
        qwen3.qwen3_tiny,
        qwen3_moe.qwen3_moe_tiny,
        mistral.mistral_tiny,
    ],
    ids=lambda f: f.__name__,
)
def test_transformers_loads_our_config_and_weights(factory, hf_tiny, tmp_path):
    ours = hf_tiny.randomize(factory(), seed=3).eval()
    (tmp_path / "config.json").write_text(json.dumps(ours.spec.to_hf_config()))
    save_file(
        {k: v.contiguous() for k, v in ours.state_dict().items()}, tmp_path / "model.safetensors"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def _tiny_config(**changes):
    base = qwen3.spec("qwen3_tiny").to_hf_config()
    return {**base, **changes}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_type": "gpt2"}, "gpt2"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "relu2"}, "relu2"),
        ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused_by_name(changes, named):
    with pytest.raises(UnsupportedModelError, match=named):
        spec_from_hf_config(_tiny_config(**changes))


def test_supported_sliding_windows():
    everywhere = _tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert spec_from_hf_config(everywhere).sliding_window == 4
    unused = _tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert spec_from_hf_config(unused).sliding_window is None
    mixed = spec_from_hf_config(
        _tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    )
    assert mixed.layer_types == ("full_attention", "sliding_attention")
    assert [mixed.layer_sliding_window(i) for i in range(2)] == [None, 4]
    assert spec_from_hf_config(mixed.to_hf_config()) == mixed  # written back as it was read
    mistral_v01 = mistral.spec("mistral_tiny").to_hf_config()
    del mistral_v01["sliding_window"]  # transformers' MistralConfig default applies
    assert spec_from_hf_config(mistral_v01).sliding_window == 4096


def test_bad_specs_fail_clearly():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelSpec("gpt2", 10, 8, 8, 1, 2, 1, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        qwen3.spec("qwen3_tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="lacks required key"):
        spec_from_hf_config({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ValueError, match="low_freq_factor"):
        llama3.spec("llama3_tiny", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(KeyError, match="qwen3_0_6b"):
        qwen3.spec("qwen3_7b")


# --- parameter counts ----------------------------------------------------------------------


def _dense_count(
    vocab, hidden, inter, layers, heads, kv_heads, head_dim, *, tied, qkv_bias=False, qk_norm=False
):
    """Parameters of a Llama-style decoder from its published dimensions."""
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    if qkv_bias:
        attn += head_dim * (heads + 2 * kv_heads)
    if qk_norm:
        attn += 2 * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def test_parameter_counts_follow_the_published_dimensions():
    qwen3_06b = _dense_count(151936, 1024, 3072, 28, 16, 8, 128, tied=True, qk_norm=True)
    llama32_1b = _dense_count(128256, 2048, 8192, 16, 32, 8, 64, tied=True)
    qwen25_05b = _dense_count(151936, 896, 4864, 24, 14, 2, 64, tied=True, qkv_bias=True)
    assert qwen3_06b == pytest.approx(596e6, rel=0.005)
    assert llama32_1b == pytest.approx(1.236e9, rel=0.005)
    for model, expected in [
        (qwen3.qwen3_0_6b(device="meta"), qwen3_06b),
        (llama3.llama3_2_1b(device="meta"), llama32_1b),
        (qwen2_5.qwen2_5_0_5b(device="meta"), qwen25_05b),
    ]:
        assert all(p.is_meta for p in model.parameters())
        assert sum(p.numel() for p in model.parameters()) == expected


# Headline sizes from the model cards, in billions of parameters.
HEADLINE = {
    "llama3_1_8b": 8.03, "llama3_1_70b": 70.6, "llama3_1_405b": 406, "llama3_2_1b": 1.24,
    "llama3_2_3b": 3.21, "llama3_3_70b": 70.6, "qwen2_5_0_5b": 0.49, "qwen2_5_1_5b": 1.54,
    "qwen2_5_3b": 3.09, "qwen2_5_7b": 7.61, "qwen2_5_14b": 14.7, "qwen2_5_32b": 32.5,
    "qwen2_5_72b": 72.7, "qwen3_0_6b": 0.6, "qwen3_1_7b": 1.7, "qwen3_4b": 4.0, "qwen3_8b": 8.2,
    "qwen3_14b": 14.8, "qwen3_32b": 32.8, "qwen3_30b_a3b": 30.5, "qwen3_235b_a22b": 235,
    "mistral_7b_v0_3": 7.25, "mistral_nemo_12b": 12.2,
}  # fmt: skip


def _spec_count(spec: ModelSpec) -> int:
    """Parameter count from spec fields, with MoE layers counted expert by expert."""
    total = _dense_count(
        spec.vocab_size,
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_hidden_layers,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
        tied=spec.tie_word_embeddings,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
    )
    for i in range(spec.num_hidden_layers):
        if spec.is_moe_layer(i):
            total -= 3 * spec.hidden_size * spec.intermediate_size
            total += spec.num_experts * (
                3 * spec.hidden_size * spec.moe_intermediate_size + spec.hidden_size
            )
    return total


@pytest.mark.parametrize(
    ("family", "name"),
    [fs for fs in ALL_SIZES if fs[1] in HEADLINE],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_real_sizes_match_model_card_parameter_counts(family, name):
    count = _spec_count(family.spec(name))
    assert count / 1e9 == pytest.approx(HEADLINE[name], rel=0.02)


@pytest.mark.parametrize("name", ["llama3_1_8b", "qwen3_8b", "qwen2_5_7b", "mistral_nemo_12b"])
def test_meta_builds_of_real_sizes_hold_no_memory(name):
    family = (
        {"l": llama3, "q": qwen3, "m": mistral}[name[0]]
        if not name.startswith("qwen2")
        else qwen2_5
    )
    model = getattr(family, name)(device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == _spec_count(model.spec)
