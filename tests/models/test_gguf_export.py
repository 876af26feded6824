"""GGUF export (issue #37): a tiny model of each exported family written as GGUF and read back by
transformers' own GGUF loader (``from_pretrained(folder, gguf_file=...)``, an independent
reader): the same logits as our model within the file type's rounding, the same tokens for the
same text and conversation, the chat template and special tokens kept; a sentencepiece-style (Gemma,
Llama 2) tokenizer as llama.cpp's SPM vocabulary; what the file could not say is refused by name; ``tunesmith export --format gguf`` merges a LoRA run first.

Tolerances (max |logit difference| over 2 x 24 random ids, logits of magnitude ~1): f32 1e-5,
f16 2e-3, bf16 2e-2, q8_0 2e-2 (int8 blocks of 32 with an f16 scale; Gemma 3's six layers 5e-2).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

from tests.data.tokenizer_factory import make_tokenizer_folder, tokenizer_json
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
from tunesmith.models.zoo import (
    gemma2,
    gemma3,
    glm4,
    granite,
    llama3,
    llama4,
    mistral,
    olmo2,
    olmo3,
    phi3,
    qwen2_5,
    qwen3,
    qwen3_moe,
    smollm3,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
GEMMA3_LAYERS = ("sliding_attention",) * 5 + ("full_attention",)
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2, "q8_0": 2e-2}
# Gemma 3 needs 6 layers (llama.cpp's fixed pattern) and scales its embeddings by sqrt(hidden):
# q8_0's rounding adds up to more there (measured 0.032)
WIDER = {("gemma3", "q8_0"): 5e-2}
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
    # Phi-4-mini's tokenizer (o200k split); the reader rotates whole heads and reads no LongRoPE
    "phi3": (phi3, "phi4", {"rope_scaling": None, "partial_rotary_factor": 1.0}),
    # the reader scales attention by its config class's query_pre_attn_scalar (256), llama.cpp
    # by 1/sqrt(head_dim): a head of 256 makes both the model's; a window of 4, softcaps on
    "gemma2": (gemma2, "llama3", {"head_dim": 256, "attention_multiplier": 1 / 16}),
    # Gemma 3 as llama.cpp's gemma3 computes it: five window layers (RoPE base 10000), one global
    "gemma3": (gemma3, "llama3", {"head_dim": 256, "attention_multiplier": 1 / 16,
                                  "num_hidden_layers": 6, "layer_types": GEMMA3_LAYERS}),
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
    assert gap < WIDER.get((family, outtype), TOLERANCE[outtype]), gap
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
        # llama4_tiny's NoPE layers and chunks of 3 (llama.cpp's: every 4th, 8192); more in
        # test_gguf_llama4.py
        (llama4, {}, r"llama4 does not compute nope_layers=\(2, 5\), attention_chunk_size=3"),
        (gemma2, {"attention_multiplier": 0.1}, r"compute attention_multiplier=0\.1"),
        (gemma2, {"layer_types": ("full_attention", "sliding_attention")}, "layer_types="),
        (smollm3, {}, r"nope_layers=\(1, 3\)"),  # llama.cpp's smollm3: every 4th layer, (3,)
        (gemma3, {}, "layer_types="),  # gemma3_tiny: a global layer every 3rd, llama.cpp's 6th
        (olmo3, {"layer_types": ("full_attention",) * 3 + ("sliding_attention",)},
         "layer_types="),  # llama.cpp's olmo2 window: the last of every 4 layers global
        (qwen3, {"hidden_act": "gelu"}, "qwen3 does not compute hidden_act='gelu'"),
        (qwen3_moe, {}, r"'mlp_only_layers': \(1,\)"),  # a dense layer: not llama.cpp's qwen3moe
        (mistral, {"sliding_window": 8}, "sliding_window 8"),
        (llama3, {"rope_scaling": YARN}, "rope_scaling 'yarn'"),  # written for Qwen only
        (qwen3, {"rope_scaling": {**YARN, "attention_factor": 2.0}},
         "llama.cpp computes attention_factor 1.13863"),  # 0.1 ln 4 + 1
        (qwen3, {"rope_scaling": {**YARN, "truncate": False}}, r"reads no \['truncate'\]"),
    ],
)  # fmt: skip
def test_what_the_file_cannot_say_is_refused_by_name(tmp_path, zoo, overrides, words):
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    folder = make_model_dir(tmp_path, family=zoo, **overrides)
    assert build_model(zoo.spec(name, **overrides))  # a model tunesmith trains
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left


def test_phi3s_longrope_factors_and_attention_factor_are_written(tmp_path):
    import gguf

    folder = make_model_dir(tmp_path, family=phi3)  # phi3_tiny: LongRoPE, factor 8 past 8
    spec = from_hf(folder).spec
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f16"))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    for kind in ("long", "short"):
        np.testing.assert_array_equal(
            stored[f"rope_factors_{kind}.weight"], spec.rope_scaling[f"{kind}_factor"]
        )
    fields = _fields(reader)
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(2**0.5)  # 1 + ln 8 / ln 8
    assert fields["phi3.rope.scaling.original_context_length"] == 8
    assert fields["phi3.rope.dimension_count"] == 8  # half of each 16-feature head


def test_qwens_yarn_is_written(tmp_path):
    import gguf

    folder = make_model_dir(tmp_path, family=qwen3, rope_scaling={**YARN, "beta_fast": 16})
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    fields = _fields(reader)
    assert fields["qwen3.rope.scaling.factor"] == 4.0
    assert fields["qwen3.rope.scaling.original_context_length"] == 128
    assert (
        fields["qwen3.rope.scaling.yarn_beta_fast"],
        fields["qwen3.rope.scaling.yarn_beta_slow"],
    ) == (16, 1)
    field = reader.fields["qwen3.rope.scaling.type"]
    assert bytes(field.parts[field.data[0]]).decode() == "yarn"


def test_gemma3s_linear_rope_scaling_is_written(tmp_path):
    import gguf

    overrides = {**FAMILIES["gemma3"][2], "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    folder = make_model_dir(tmp_path, family=gemma3, **overrides)
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    assert _fields(reader)["gemma3.rope.scaling.factor"] == 8.0
    field = reader.fields["gemma3.rope.scaling.type"]
    assert bytes(field.parts[field.data[0]]).decode() == "linear"
    assert _fields(reader)["gemma3.attention.sliding_window"] == 4


def test_gemma_27bs_attention_scale_is_llama_cpps_by_layer_count():
    from tunesmith.models.gguf_arches import ARCHES, unsupported

    for family, size, layers in ((gemma2, "gemma2_27b", 46), (gemma3, "gemma3_27b", 62)):
        spec = family.spec(size)  # attention 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
        assert spec.num_hidden_layers == layers
        assert spec.attention_multiplier != spec.head_dim**-0.5
        assert unsupported(spec, ARCHES[spec.model_type]) == []
        smaller = dataclasses.replace(spec, num_hidden_layers=layers - 2, layer_types=None,
                                      sliding_window=None)  # fmt: skip
        assert f"attention_multiplier={spec.attention_multiplier!r}" in unsupported(
            smaller, ARCHES[spec.model_type]
        )


LLAMA2_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
]}  # fmt: skip
SPM_TEXTS = [
    "Hello world 123, it's 2026!",
    "  two leading spaces\n\n\tand a tab",
    "ünïcödé 日本語 🙂 mixed",  # characters outside the vocabulary: <0xNN> byte pieces
    "<start_of_turn>user\nhi there<end_of_turn>\n",
]


def spm_merges(vocab: dict) -> list[list[str]]:
    """Every pair of pieces that joins into a piece, ranked by the joined piece's id: the
    merges transformers' converter writes for a sentencepiece BPE model."""
    pairs = {(t[:k], t[k:]) for t in vocab for k in range(1, len(t))}
    pairs = {(a, b) for a, b in pairs if a in vocab and b in vocab}
    return [[a, b] for a, b in sorted(pairs, key=lambda p: (vocab[p[0] + p[1]], vocab[p[0]]))]


def spm_model_dir(root, zoo, *, llama2: bool = False, reverse: bool = False, **overrides):
    """A tiny model of ``zoo`` with the suite's Gemma tokenizer, its merges those of a converted
    sentencepiece model (``byte_fallback``, ``<0x00>``..``<0xFF>``, spaces as "▁"); with
    ``llama2`` Llama 2's normalizer (a "▁" prepended), with ``reverse`` the merges' ranks
    reversed (not in id order: the pieces' scores must follow the ranks)."""
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", "gemma")
    path = tokenizer_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    merges = spm_merges(data["model"]["vocab"])
    data["model"]["merges"] = merges[::-1] if reverse else merges
    if llama2:
        data["normalizer"], data["pre_tokenizer"] = LLAMA2_NORMALIZER, None
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    spec = zoo.spec(name, vocab_size=vocab, **overrides)
    return save_hf_checkpoint(build_model(spec), root / "model", source_dir=tokenizer_dir)


def test_a_gemma_sentencepiece_tokenizer_exports_as_llama_cpps_spm_vocabulary(tmp_path):
    import gguf

    folder = spm_model_dir(tmp_path, gemma2, **FAMILIES["gemma2"][2])
    path = export_gguf(folder, tmp_path / "model.gguf", outtype="f16")
    ours = Tokenizer.from_pretrained(folder)
    _, theirs = _read_back(path)
    for text in SPM_TEXTS:
        want = ours.encode(text, add_special_tokens=False)
        assert theirs(text, add_special_tokens=False)["input_ids"] == want, text
    assert any(ours.token_to_id("<0xF0>") in ours.encode(t) for t in SPM_TEXTS)  # 🙂 as bytes
    assert theirs("hi")["input_ids"] == ours.encode("hi")  # <bos> added by both

    fields = gguf.GGUFReader(path).fields
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    kinds = gguf.TokenType
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    scores = fields["tokenizer.ggml.scores"].contents()
    merged = [vocab[a + b] for a, b in spm_merges(vocab)]  # ids in merge order
    assert [scores[i] for i in dict.fromkeys(merged)] == sorted(scores, reverse=True)[
        : len(set(merged))
    ]
    assert max(scores[vocab[f"<0x{b:02X}>"]] for b in range(256)) < min(scores[i] for i in merged)
    assert [types[vocab[f"<0x{b:02X}>"]] for b in range(256)] == [kinds.BYTE] * 256
    assert types[vocab["<unk>"]] == kinds.UNKNOWN
    assert types[ours.token_to_id("<end_of_turn>")] == kinds.CONTROL
    assert types[vocab["▁the"]] == kinds.NORMAL
    assert fields["tokenizer.ggml.bos_token_id"].contents() == ours.token_to_id("<bos>")
    assert "tokenizer.ggml.merges" not in fields


def test_llama_2s_normalizer_writes_a_space_prefix(tmp_path):
    import gguf

    folder = spm_model_dir(tmp_path, llama3, llama2=True, rope_scaling=None)
    fields = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf")).fields
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is True
    assert fields["tokenizer.ggml.model"].contents() == "llama"


def _keep_trained_merges(data):
    data["model"]["merges"] = json.loads(tokenizer_json("gemma"))["model"]["merges"]


def _part_a_pieces_merges(data):  # one of "▁the"'s merges moved to the end
    merges = data["model"]["merges"]
    merges.append(merges.pop(max(i for i, (a, b) in enumerate(merges) if a + b == "▁the")))


def _metaspace(data):
    data["normalizer"] = None
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                             "split": False}  # fmt: skip


def _unigram(data):
    data["model"] = {
        "type": "Unigram",
        "unk_id": 3,
        "vocab": [[t, 0.0] for t in data["model"]["vocab"]],
    }


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_keep_trained_merges, "merges leave out pairs of pieces that form a piece"),
        (_part_a_pieces_merges, "the merges making '▁the' are not side by side"),
        (_metaspace, "normalizer null and pre-tokenizer .*Metaspace"),
        (_unigram, "this one is 'Unigram'"),
    ],
)
def test_a_sentencepiece_tokenizer_llama_cpp_would_read_otherwise_is_refused(
    tmp_path, change, words
):
    folder = spm_model_dir(tmp_path, gemma2)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(GGUFExportError, match=words):
        export_gguf(folder, tmp_path / "m.gguf")


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


# transformers' GGUF reader reads no OLMo 2/3, Granite, GLM-4 or SmolLM3: their files are checked
# tensor by tensor against llama.cpp's names (written out here, per layer; a tuple is fused in
# that order) and their metadata keys; the llama_cpp-marked tests run them
LAYER_NAMES = {
    "olmo2": {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "post_attention_layernorm": "post_attention_norm",
              "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    "granite": {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    "smollm3": {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    "glm4": {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "input_layernorm": "attn_norm", "post_self_attn_layernorm": "post_attention_norm",
             "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm",
             ("mlp.gate_proj", "mlp.up_proj"): "ffn_up", "mlp.down_proj": "ffn_down"},
}  # fmt: skip
LAYER_NAMES["olmo3"] = LAYER_NAMES["olmo2"]  # llama.cpp's olmo2 with a window
ZOO = {"olmo2": (olmo2, {}), "granite": (granite, {}), "glm4": (glm4, {}),
       "smollm3": (smollm3, {"nope_layers": (3,)}), "olmo3": (olmo3, {})}  # fmt: skip
INTERLEAVED = ("granite", "smollm3")  # llama.cpp's "norm" RoPE: q/k rows reordered


def _fields(reader) -> dict:
    """``{key: value}`` of a GGUF file's scalar metadata."""
    out = {}
    for key, field in reader.fields.items():
        if len(field.data) == 1 and field.types and field.types[0].name != "STRING":
            out[key] = field.parts[field.data[0]][0].item()
    return out


@pytest.mark.parametrize("family", sorted(LAYER_NAMES))
def test_files_hold_llama_cpps_names_values_and_keys(tmp_path, family):
    import gguf

    zoo, overrides = ZOO[family]
    folder = make_model_dir(tmp_path, family=zoo, **overrides)
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", outtype="f32"))
    model = from_hf(folder, dtype=torch.float32)
    state, spec = model.state_dict(), model.spec
    embeddings = state["model.embed_tokens.weight"]
    want = {"token_embd.weight": embeddings, "output_norm.weight": state["model.norm.weight"],
            "output.weight": state.get("lm_head.weight", embeddings)}  # fmt: skip
    for layer in range(spec.num_hidden_layers):
        for ours, theirs in LAYER_NAMES[family].items():
            parts = (ours,) if isinstance(ours, str) else ours
            for suffix in ("weight", "bias"):
                keys = [f"model.layers.{layer}.{part}.{suffix}" for part in parts]
                if keys[0] in state:
                    want[f"blk.{layer}.{theirs}.{suffix}"] = torch.cat([state[k] for k in keys])
            if family in INTERLEAVED and ours in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = spec.num_attention_heads if "q_" in ours else spec.num_key_value_heads
                name = f"blk.{layer}.{theirs}.weight"
                want[name] = interleave_rope_rows(want[name], heads)
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert sorted(stored) == sorted(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)
    assert len(want) == 3 + spec.num_hidden_layers * (len(LAYER_NAMES[family]) + 3 * spec.qkv_bias)
    fields, arch = _fields(reader), {"olmo3": "olmo2"}.get(family, family)
    assert fields[f"{arch}.block_count"] == spec.num_hidden_layers
    assert fields[f"{arch}.rope.dimension_count"] == spec.rotary_dim
    assert fields[f"{arch}.attention.head_count_kv"] == spec.num_key_value_heads
    if family == "olmo3":  # olmo3_tiny: a window of 4 on three layers of every four
        assert fields["olmo2.attention.sliding_window"] == 4
    if family == "granite":  # granite_tiny sets every multiplier
        for key, value in (("embedding_scale", 3.0), ("residual_scale", 0.5),
                           ("attention.scale", 0.1), ("logit_scale", 4.0)):  # fmt: skip
            assert fields[f"granite.{key}"] == pytest.approx(value), key
