"""GGUF export (issue #37): a tiny model of each exported family written as GGUF and read back by
transformers' own GGUF loader (``from_pretrained(folder, gguf_file=...)``, an independent
reader): the same logits as our model within the file type's rounding, the same tokens for the
same text and conversation, the chat template and special tokens kept; what the file could not
say is refused by name; ``tunesmith export --format gguf`` merges a LoRA run first.

Tolerances (max |logit difference| over 2 x 24 random ids, logits of magnitude ~1): f32 1e-5,
f16 2e-3, bf16 2e-2, q8_0 2e-2 (int8 blocks of 32 with an f16 scale).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli.main import main
from tunesmith.data import Tokenizer
from tunesmith.models import build_model
from tunesmith.models.export import export_merged
from tunesmith.models.gguf_export import (
    GGUFExportError,
    export_gguf,
    interleave_rope_rows,
    llama3_rope_factors,
)
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.models.zoo import gemma2, llama3, mistral, qwen2_5, qwen3, qwen3_moe

TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2, "q8_0": 2e-2}
# family -> (zoo module, tokenizer family, spec overrides): transformers' GGUF reader takes
# Qwen3's head_dim from its config class (128) and reads no RoPE scaling, so those are set here
FAMILIES = {
    "llama": (llama3, "llama3", {"rope_scaling": None}),
    "qwen2": (qwen2_5, "qwen2_5", {}),
    "qwen3": (qwen3, "qwen3", {"head_dim": 128}),
    # its reader also takes moe_intermediate_size from the config class (768); every layer
    # sparse with renormalised top-k weights, as llama.cpp's qwen3moe (and real checkpoints)
    "qwen3_moe": (qwen3_moe, "qwen3", {"head_dim": 128, "moe_intermediate_size": 768,
                                       "mlp_only_layers": (), "norm_topk_prob": True}),
}  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "add 12 and 30, please!"},
    {"role": "assistant", "content": "12 + 30 = 42"},
]


def _model_dir(root, family: str):
    zoo, tokenizer_family, overrides = FAMILIES[family]
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", tokenizer_family)
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    spec = zoo.spec(f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny", vocab_size=vocab, **overrides)
    return save_hf_checkpoint(build_model(spec), root / "model", source_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: _model_dir(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def _read_back(path):
    """transformers' model and tokenizer of the GGUF file ``path``."""
    kwargs = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kwargs
    )
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)


# bf16 and q8_0 round enough to move a token's router scores across a top-k tie, which sends
# it to another expert: the mixture of experts is compared where rounding is far below that
# (f32, f16); benchmarks/results/gguf_export.md measures all four
READ_BACK = [(f, t) for f in sorted(FAMILIES) for t in sorted(TOLERANCE)
             if f != "qwen3_moe" or t in ("f32", "f16")]  # fmt: skip


@pytest.mark.parametrize(("family", "outtype"), READ_BACK)
def test_transformers_reads_back_the_same_model(folders, tmp_path, family, outtype):
    path = export_gguf(folders[family], tmp_path / "model.gguf", outtype=outtype)
    theirs, _ = _read_back(path)
    ours = from_hf(folders[family], dtype=torch.float32)
    ids = torch.randint(
        0, ours.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        gap = (theirs(ids).logits - ours(ids)).abs().max().item()
    assert gap < TOLERANCE[outtype], gap
    if outtype != "f32":  # the rounding is really there: the file is not float32
        assert gap > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_chat_template_and_special_tokens_survive(folders, tmp_path, family):
    folder = folders[family]
    _, theirs = _read_back(export_gguf(folder, tmp_path / "model.gguf", outtype="f16"))
    ours = Tokenizer.from_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert theirs.chat_template == config["chat_template"]
    assert theirs.eos_token == config["eos_token"]
    rendered = theirs.apply_chat_template(CONVERSATION, tokenize=False)
    ids, _ = ours.tokenize_conversation(CONVERSATION)
    assert theirs.encode(rendered, add_special_tokens=False) == ids
    text = "Hello world 123, it's 2026!\n\n  indented <|im_end|> done"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(
        text, add_special_tokens=False
    )


def test_llama_rows_are_interleaved_per_head_and_rope_factors_are_llama3s():
    rows = torch.arange(16.0).unsqueeze(1)  # two heads of 8 rows
    assert interleave_rope_rows(rows, heads=2).flatten().tolist() == [
        0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
    ]  # fmt: skip
    spec = llama3.spec("llama3_tiny")  # rope_scaling llama3, factor 8
    factors = llama3_rope_factors(spec)
    assert factors.shape == (spec.head_dim // 2,)
    assert factors[0].item() == 1.0  # the highest frequency is kept
    assert factors[-1].item() == pytest.approx(spec.rope_scaling["factor"])  # the lowest: / 8


def test_a_llama3_scaled_model_writes_rope_freqs(tmp_path):
    import gguf

    spec = llama3.spec("llama3_tiny", vocab_size=Tokenizer.from_pretrained(
        make_tokenizer_folder(tmp_path / "tok", "llama3")).vocab_size)  # fmt: skip
    folder = save_hf_checkpoint(build_model(spec), tmp_path / "m", source_dir=tmp_path / "tok")
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    stored = {t.name: t for t in reader.tensors}
    np.testing.assert_allclose(stored["rope_freqs.weight"].data, llama3_rope_factors(spec))


@pytest.mark.parametrize(
    ("zoo", "overrides", "words"),
    [
        (gemma2, {}, "supports model_type llama, mistral, mixtral, qwen2, qwen3, qwen3_moe; 'gemma2'"),
        (qwen3_moe, {}, r"'mlp_only_layers': \(1,\)"),  # a dense layer: not llama.cpp's qwen3moe
        (mistral, {"sliding_window": 8}, "sliding_window 8"),
        (qwen3, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 128}}, "'yarn'"),
    ],
)  # fmt: skip
def test_what_the_file_cannot_say_is_refused_by_name(tmp_path, zoo, overrides, words):
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    folder = make_model_dir(tmp_path, family=zoo, **overrides)
    assert build_model(zoo.spec(name, **overrides))  # a model tunesmith trains
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left


def test_a_link_planted_at_the_partial_file_is_not_written_through(folders, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / ".model.gguf.partial").symlink_to(victim)
    export_gguf(folders["qwen2"], tmp_path / "model.gguf", outtype="f16")
    assert victim.read_text() == "mine"
    assert (tmp_path / "model.gguf").is_file() and not (tmp_path / "model.gguf").is_symlink()


def test_export_command_merges_a_lora_run_into_a_gguf_file(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path / "base")
    data = make_counting_data(tmp_path / "d.jsonl", rows=8)
    run = run_sft(model_dir, data, tmp_path / "lora", "max_steps=1", config="tiny_lora")
    out = tmp_path / "gguf"
    assert main(["export", str(run), "--output-dir", str(out), "--format", "gguf",
                 "--outtype", "f32"]) == 0  # fmt: skip
    path = out / "lora-F32.gguf"
    assert f"to {path}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["lora-F32.gguf"]  # the merge folder gone
    merged = export_merged(run / "checkpoints" / "step_000001", tmp_path / "merged")
    theirs, _ = _read_back(path)
    ours = from_hf(merged, dtype=torch.float32)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-5, rtol=0)
    again = ["export", str(run), "--output-dir", str(out), "--format", "gguf", "--outtype", "f32"]
    assert main(again) == 1  # the file exists: --force replaces it
    assert "already exists: pass --force" in capsys.readouterr().err
    assert main([*again, "--force"]) == 0
    assert main([*again, "--force", "--dtype", "bf16"]) == 1  # a HF folder's setting
    assert "a GGUF file's weights take --outtype" in capsys.readouterr().err
    assert main(["export", str(run), "--output-dir", str(out / "hf"), "--outtype", "q8_0"]) == 1
    assert "add --format gguf" in capsys.readouterr().err
