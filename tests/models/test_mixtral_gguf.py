"""Mixtral's GGUF export: llama.cpp's ``llama`` architecture with stacked experts
(``ffn_gate_exps`` ...). transformers' GGUF reader reads no Mixtral, so the file is checked
tensor by tensor here (``gguf.GGUFReader``) and, under the ``llama_cpp`` marker (``make
test-llama-cpp``), by llama.cpp itself computing our logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data import Tokenizer
from tunesmith.models import build_model, mixtral
from tunesmith.models.gguf_export import GGUFExportError, export_gguf
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.modules.moe import stacked_state

CONVERSATION = [
    {"role": "user", "content": "add 12 and 30, please!"},
    {"role": "assistant", "content": "12 + 30 = 42"},
]


def _model_dir(root, **overrides):
    """mixtral_tiny (5 experts, top-3) without its window, which llama.cpp's llama lacks."""
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", "llama3")
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    spec = mixtral.spec("mixtral_tiny", **{"vocab_size": vocab, "sliding_window": None,
                                           **overrides})  # fmt: skip
    return save_hf_checkpoint(build_model(spec), root / "model", source_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("mixtral"))


def test_the_file_holds_llamas_keys_and_the_stacked_experts(folder, tmp_path):
    import gguf

    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    for key, value in (("llama.expert_count", 5), ("llama.expert_used_count", 3)):
        assert int(reader.fields[key].parts[-1][0]) == value, key
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    with stacked_state(model := from_hf(folder, dtype=torch.float32)):
        state = model.state_dict()
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp."
        for ours, theirs in (("experts.gate_proj", "ffn_gate_exps"), ("experts.up_proj",
                             "ffn_up_exps"), ("experts.down_proj", "ffn_down_exps"),
                             ("gate.weight", "ffn_gate_inp")):  # fmt: skip
            got = tensors[f"blk.{layer}.{theirs}.weight"]
            np.testing.assert_array_equal(got, state[prefix + ours].numpy(), err_msg=theirs)


def test_a_sliding_window_is_refused_by_name(tmp_path):
    windowed = _model_dir(tmp_path, sliding_window=8)
    with pytest.raises(GGUFExportError, match="sliding_window 8"):
        export_gguf(windowed, tmp_path / "m.gguf")


@pytest.mark.llama_cpp
def test_llama_cpp_computes_our_logits(folder, tmp_path):
    from tests.models.test_gguf_llama_cpp import TOLERANCE, llama_cpp_logits

    path = export_gguf(folder, tmp_path / "model.gguf", outtype="f16")
    ids, _ = Tokenizer.from_pretrained(folder).tokenize_conversation(CONVERSATION)
    with torch.no_grad():
        want = from_hf(folder, dtype=torch.float32)(torch.tensor([ids]))[0].numpy()
    got = llama_cpp_logits(path, ids)
    assert got.shape == want.shape
    gap = np.abs(got - want).max() / want.std()
    assert 0 < gap < TOLERANCE["f16"], gap
