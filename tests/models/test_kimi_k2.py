"""Kimi K2 folders (``model_type`` ``kimi_k2``, a ``DeepseekV3ForCausalLM`` with DeepSeek-V3's
config keys and a remote-code tiktoken tokenizer), on a crafted folder: read as deepseek_v3 with
transformers' DeepSeek-V3 logits, saved back as ``kimi_k2``, the tokenizer refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_deepseek import CASES, VOCAB, hf_config, hf_model
from tunesmith.data.tokenizer import Tokenizer, tokenizer_folder_problem
from tunesmith.models import from_hf, spec_from_hf_config
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.transformers_backend import choose_backend

# What Kimi K2's config.json has beyond transformers' DeepSeek-V3 keys (its remote code's).
KIMI_KEYS = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "TikTokenTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(transformers' DeepSeek-V3 model, the same weights in a Kimi K2 folder)."""
    model_type, fields = CASES["v3_qlora_interleave_groups"]
    hf = hf_model(hf_config(model_type, **fields))
    folder = tmp_path_factory.mktemp("kimi_k2")
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **KIMI_KEYS}))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (folder / "tiktoken.model").write_text("")
    return hf, folder


def test_a_kimi_k2_folder_loads_as_deepseek_v3_and_saves_back_as_kimi_k2(kimi, tmp_path):
    hf, folder = kimi
    assert choose_backend(json.loads((folder / "config.json").read_text())).backend == "native"
    ours = from_hf(folder).eval()
    assert ours.spec.model_type == "kimi_k2" and ours.spec.moe_routing.method == "noaux_tc"
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max() < 1e-4
    save_hf_checkpoint(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (
        "kimi_k2",
        ["DeepseekV3ForCausalLM"],
    )
    assert spec_from_hf_config(written) == ours.spec
    back = from_hf(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(ids) - expected).abs().max() < 1e-4


def test_its_remote_code_tokenizer_is_refused_by_name(kimi):
    _, folder = kimi
    problem = tokenizer_folder_problem(folder)
    assert "TikTokenTokenizer (tokenization_kimi.TikTokenTokenizer)" in problem
    assert "remote code" in problem
    with pytest.raises(FileNotFoundError, match="TikTokenTokenizer"):
        Tokenizer.from_pretrained(folder)
