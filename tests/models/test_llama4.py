"""Llama 4 text (``llama4_text`` and ``llama4`` folders' language model) against transformers.

One odd tiny config: 6 layers, chunks of 3 (shorter than every test row), NoPE layers every
3rd, MoE every 2nd layer with 3 experts, llama3 RoPE scaling, a small ``floor_scale`` so the
NoPE layers' temperature changes within the rows. Nothing is downloaded.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.models.conftest import randomize_
from tunesmith.generation.generate import generate
from tunesmith.models import llama4
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.models.peft_io import load_peft_adapter, save_peft_adapter
from tunesmith.models.spec import spec_from_hf_config
from tunesmith.modules.chunked import chunk_document_ids
from tunesmith.modules.peft import apply_lora

TOL = 1e-4
_CONFIG = dict(
    vocab_size=128, hidden_size=48, intermediate_size=40, intermediate_size_mlp=80,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    num_local_experts=3, num_experts_per_tok=1, interleave_moe_layer_step=2,
    no_rope_layer_interval=3, attention_chunk_size=3, floor_scale=2, attn_scale=0.5,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 4},
)  # fmt: skip


def _hf_model(**changes) -> transformers.Llama4ForCausalLM:
    config = transformers.Llama4TextConfig(**{**_CONFIG, **changes})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, 0).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, its folder, our model loaded from it)."""
    hf = _hf_model()
    folder = tmp_path_factory.mktemp("llama4_text")
    hf.save_pretrained(folder)
    return hf, folder, from_hf(folder, dtype=torch.float32).eval()


def _ids(b: int = 2, s: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def test_spec_reads_the_config(pair):
    _, _, model = pair
    spec = model.spec
    assert spec.nope_layers == (2, 5) and spec.mlp_only_layers == (0, 2, 4)
    assert spec.layer_attention_chunk(0) == 3 and spec.layer_attention_chunk(2) is None
    assert (spec.intermediate_size, spec.moe_intermediate_size) == (80, 40)
    assert spec.rope_interleaved and spec.qk_l2_norm and spec.attn_temperature_tuning
    assert spec_from_hf_config(spec.to_hf_config()) == spec


def test_loaded_experts_are_tensors_of_their_own(pair):
    """Read from the fused ``gate_up_proj``, gate and up are contiguous and share no memory
    (an optimizer stepping views of one tensor would write into the wrong elements)."""
    experts = pair[2].model.layers[1].mlp.experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(experts, name).is_contiguous(), name
    assert experts.gate_proj.untyped_storage().data_ptr() != (
        experts.up_proj.untyped_storage().data_ptr()
    )


def test_logits_and_gradients_match_transformers(pair):
    hf, _, model = pair
    ids = _ids()
    ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < TOL
    ours.sum().backward()
    theirs.sum().backward()
    named = dict(hf.named_parameters())
    for name, param in model.named_parameters():
        hf_name = model.spec.checkpoint_renames.to_disk(name)
        if ".experts." in name:
            continue  # fused on the transformers side; compared below
        ref = named[hf_name].grad
        assert (param.grad - ref).abs().max() <= 1e-4 * ref.abs().max(), name
    experts = model.model.layers[1].mlp.experts
    ref = named["model.layers.1.feed_forward.experts.gate_up_proj"].grad
    gate = experts.gate_proj.grad.transpose(1, 2)
    assert (gate - ref[..., :40]).abs().max() <= 1e-4 * ref.abs().max()
    model.zero_grad()
    hf.zero_grad()


@pytest.mark.parametrize(
    "change",
    [
        {"attention_chunk_size": None},  # every layer global
        {"use_qk_norm": False},
        {"attn_temperature_tuning": False},
        {"no_rope_layers": [1] * 6},  # RoPE (and chunks) everywhere
    ],
    ids=["chunks", "qk_norm", "temperature", "nope_layers"],
)
def test_each_config_feature_matters(pair, change):
    hf, _, model = pair
    off = _hf_model(**change)
    off.load_state_dict(hf.state_dict())
    ids = _ids(s=14)
    with torch.no_grad():
        moved = (off(ids).logits - model(ids)).abs().max()
    assert moved > 100 * TOL


def test_save_loads_in_transformers(pair, tmp_path):
    hf, _, model = pair
    save_hf_checkpoint(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = _ids()
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < TOL
    on_disk = load_file(next((tmp_path / "out").glob("*.safetensors")))
    assert on_disk["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (3, 48, 80)


def test_llama4_folder_loads_its_language_model(pair, tmp_path):
    """A multimodal ``llama4`` folder: text_config + ``language_model.*`` tensors (the vision
    tower's tensors are left out)."""
    hf, folder, _ = pair
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
              "text_config": text, "vision_config": {}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {f"language_model.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    tensors["vision_model.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    model = from_hf(tmp_path, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < TOL


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "loop", "flex"])
def test_packed_rows_equal_separate_rows(pair, backend):
    """Two documents (7 and 5 tokens) and padding in one row: each document's chunks restart
    with its positions, nothing leaks across documents, on every backend."""
    _, _, model = pair
    a, b = _ids(1, 7, seed=2), _ids(1, 5, seed=3)
    packed = torch.cat([a, b, torch.zeros(1, 2, dtype=torch.long)], dim=1)
    docs = torch.tensor([[0] * 7 + [1] * 5 + [-1] * 2])
    positions = torch.tensor([list(range(7)) + list(range(5)) + [0, 1]])
    model.model.attention_backend = backend
    try:
        with torch.no_grad():
            out = model(packed, position_ids=positions, document_ids=docs)
            alone = torch.cat([model(a), model(b)], dim=1)
    finally:
        model.model.attention_backend = "auto"
    assert (out[:, :12] - alone).abs().max() < 1e-5


def test_context_parallel_ring_of_one_equals_plain(pair):
    """The ring backend takes chunks as finer documents (a one-rank ring, in process)."""
    _, _, model = pair
    ids = _ids()
    with torch.no_grad():
        ring = model(ids, cp_index=torch.arange(11).expand(2, -1))
        plain = model(ids)
    assert (ring - plain).abs().max() < 1e-5


def test_greedy_generation_matches_transformers_across_chunks(pair):
    """20 new tokens after a 4-token prompt cross six chunk edges, with a KV cache."""
    hf, _, model = pair
    prompt = _ids(1, 4, seed=4)
    config = transformers.GenerationConfig(
        max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        theirs = hf.generate(input_ids=prompt, generation_config=config)[0, 4:].tolist()
    ours = generate(model, prompt, max_new_tokens=20).sequences[0]
    assert len(theirs) == 20 and ours == theirs


def test_chunk_document_ids_keep_padding_and_split_documents():
    docs = chunk_document_ids(
        torch.tensor([[0, 0, 0, 0, 1, -1]]), torch.tensor([[0, 1, 2, 3, 0, 0]]), 3, batch_size=1
    )
    assert docs[0, 0] == docs[0, 2] != docs[0, 3] and docs[0, 5] == -1 and docs[0, 4] > docs[0, 3]


def test_shipped_sizes_build_on_meta():
    model = llama4.llama4_scout_17b_16e(device="meta")
    assert model.spec.approx_parameters() // 10**9 == 107
    assert model.model.layers[3].self_attn.query_scale is not None
    assert model.model.layers[0].attention_type == "chunked_attention"
    tiny = llama4.llama4_tiny()
    assert tiny(torch.randint(0, 256, (1, 7))).shape == (1, 7, 256)


def test_config_written_by_spec_loads_in_transformers():
    config = llama4.spec("llama4_tiny").to_hf_config()
    hf = transformers.Llama4TextConfig(**config)
    assert hf.layer_types[2] == "full_attention" and hf.moe_layers == [1, 3, 5]
    assert hf.no_rope_layers == [1, 1, 0, 1, 1, 0]


def test_peft_folder_loads_in_peft_with_equal_logits(pair, tmp_path):
    """LoRA on attention, dense and shared MLPs and the routed experts: peft reads the folder
    onto transformers' model (``feed_forward`` names, experts' ``target_parameters`` on
    ``[E, in, out]`` tensors) with our logits, and our loader reads it back."""
    _, folder, _ = pair
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    ours = apply_lora(from_hf(folder, dtype=torch.float32), target_modules=targets, rank=4, alpha=8)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    adapter = save_peft_adapter(ours.eval(), tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(_hf_model(), adapter).eval()
    back = load_peft_adapter(from_hf(folder, dtype=torch.float32), adapter).eval()
    ids = _ids()
    with torch.no_grad():
        expected = ours(ids)
        assert (theirs(ids).logits - expected).abs().max() < TOL
        assert (back(ids) - expected).abs().max() < TOL
        assert (_hf_model()(ids).logits - expected).abs().max() > 100 * TOL  # adapters matter


def test_left_padded_batch_generates_as_each_prompt_alone(pair):
    """Prompts of 4 and 7 tokens batched with left padding: each row's chunks and temperature
    count its own tokens, so it decodes as transformers decodes the prompt alone. (transformers'
    own left-padded rows differ: its temperature counts cache slots, padding included.)"""
    hf, _, model = pair
    prompts = [_ids(1, 4, seed=5)[0].tolist(), _ids(1, 7, seed=6)[0].tolist()]
    config = transformers.GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        alone = [
            hf.generate(input_ids=torch.tensor([p]), generation_config=config)[0, len(p) :]
            for p in prompts
        ]
    assert generate(model, prompts, max_new_tokens=12).sequences == [a.tolist() for a in alone]
