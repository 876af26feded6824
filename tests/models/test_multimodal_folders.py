"""A multimodal folder whose language model is a native family loads as that language model.

Gemma 3's 4B/12B/27B checkpoints are ``gemma3`` (``Gemma3ForConditionalGeneration``): a
SigLIP vision tower, a projector and a ``gemma3_text`` language model. ``from_hf`` loads the
language model (equal to transformers' logits on text), says that the other towers are left
out, and saves a text-only ``gemma3_text`` folder that transformers loads as a causal LM.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers

from tunesmith.models import UnsupportedModelError, spec_from_hf_config
from tunesmith.models.family import language_model_config
from tunesmith.models.hf import from_hf, save_hf_checkpoint

TEXT = {
    "vocab_size": 131, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4,
    "query_pre_attn_scalar": 20, "max_position_embeddings": 256, "pad_token_id": None,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory, hf_tiny):
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=130, boi_token_index=128, eoi_token_index=129,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf_tiny.randomize(transformers.Gemma3ForConditionalGeneration(config), seed=1).eval()
    folder = tmp_path_factory.mktemp("gemma3_multimodal")
    model.save_pretrained(folder)
    return folder, model


def test_the_language_model_of_a_multimodal_folder_equals_transformers(multimodal, caplog):
    folder, hf = multimodal
    with caplog.at_level(logging.WARNING, logger="tunesmith.models.hf"):
        ours = from_hf(folder).eval()
    assert ours.spec.model_type == "gemma3_text"
    assert "leaves the other towers out" in caplog.text and "vision_tower" in caplog.text
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max() < 1e-4


def test_it_saves_as_a_text_model_transformers_loads(multimodal, tmp_path):
    folder, hf = multimodal
    save_hf_checkpoint(from_hf(folder), tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == (
        "gemma3_text"
    )
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (text(ids).logits - hf(input_ids=ids).logits).abs().max() < 1e-4


def test_sizes_a_text_config_leaves_out_are_transformers_defaults():
    # Gemma 3 4B's config.json names neither its vocabulary nor its heads.
    config = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    spec = spec_from_hf_config(language_model_config(config)[0])
    assert (spec.vocab_size, spec.num_attention_heads, spec.num_key_value_heads) == (262208, 8, 4)
    assert spec.head_dim == 256 and spec.torch_dtype == "bfloat16"
    assert spec.rope_local_theta == 10000.0 and spec.rope_scaling["factor"] == 8.0


def test_a_text_config_of_another_family_is_refused():
    config = {"model_type": "gemma3", "text_config": {"model_type": "llama"}}
    with pytest.raises(UnsupportedModelError, match="'llama' is not 'gemma3_text'"):
        language_model_config(config)
