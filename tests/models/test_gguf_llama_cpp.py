"""llama.cpp itself reads our GGUF files (issue #37): a tiny random model of each family, with
the test suite's trained byte-level BPE tokenizer, exported as f16 and q8_0 and loaded by
``llama_cpp.Llama`` (llama-cpp-python, which builds llama.cpp from source): its logits on a
rendered conversation against ours in float32, its tokenizer's ids against ours, and the chat
template it reads (``tokenizer.chat_template``) rendering the same prompt.

Marked ``llama_cpp`` (not in ``make test``: building llama.cpp takes minutes);
``make test-llama-cpp`` installs the ``llama-cpp`` extra and runs it.

Tolerances: max |logit difference| over the prompt's positions, against the standard deviation
of our logits (so a shape's scale does not matter): f16 2%, q8_0 15%, Gemma 3 and OLMo 3 at
q8_0 30%, OLMo 2/3 with YaRN at q8_0 30%/40% (measured on these tiny models: f16 0.2-1.4%,
q8_0 4-13%, Gemma 3 and OLMo 3 21-24%, 46-layer Gemma 2 18%, OLMo 2/3 with YaRN 20%/28%).
llama.cpp runs with its defaults, as a user's would: its KV cache is f16, and its CPU matmuls
round the activations to the weights' type too (f16; q8_0: 8-bit blocks of 32 with a scale),
which transformers' reader (``test_gguf_export.py``) does not. The mixture of experts is
compared at f16 only: q8_0's
rounding moves a token's router scores across a top-k tie, which sends it to another expert
(a whole expert's difference at that position; ``benchmarks/results/gguf_export.md`` records
the measured values of every family and out type at a larger shape).

The frontier mixtures of experts (DeepSeek-V2/V3 as ``deepseek2``, GLM-4.5, gpt-oss) and OLMo 3's
YaRN are also compared where nothing rounds (an f32 file, llama.cpp's KV cache in f32) with
weights ten times larger, where routing and YaRN move the logits by several standard deviations:
below 1e-4 of the logits' standard deviation (measured 1e-5). Llama 4 (llama.cpp's ``llama4``)
is also run on 8300 tokens, past its first chunk of 8192 positions where its NoPE layer's
temperature rises: below 1e-3 std there (measured 1.4e-4).

Every model shape of the test suite's tiny families loads as is: llama.cpp refused none (head
dims 16 and 32, 2 to 6 layers, vocabularies of ~640). A family's settings that llama.cpp fixes
are set here to its values (SmolLM3's RoPE-free 4th layer, Gemma 3's six-layer pattern); the
tokenizers are byte-level BPE (Phi-4-mini's o200k split for Phi-3, Llama 3's for Gemma), and a
sentencepiece-style one (Gemma's; Llama 2's normalizer) on Gemma 2 and Llama at f16.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.models.test_gguf_export import SPM_TEXTS, spm_model_dir
from tests.models.test_gguf_llama4 import LLAMA_CPP as LLAMA4
from tunesmith.data import Tokenizer
from tunesmith.models import build_model
from tunesmith.models.gguf_export import export_gguf
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.models.zoo import (
    deepseek_v2,
    deepseek_v3,
    gemma2,
    gemma3,
    glm4,
    glm4_moe,
    gpt_oss,
    granite,
    llama3,
    llama4,
    olmo2,
    olmo3,
    phi3,
    qwen2_5,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tunesmith.modules.routers import DeepSeekRouting

pytestmark = pytest.mark.llama_cpp

TOLERANCE = {"f16": 0.02, "q8_0": 0.15}  # max |Δ logit| / std of our logits
# Gemma 3 at q8_0: six layers (llama.cpp's fixed pattern), embeddings scaled by sqrt(hidden):
# measured 0.21
# OLMo 3 at q8_0 (4 layers, a window of 4): measured 0.24; Gemma 2 of 46 layers: 0.18
# OLMo 2/3 with YaRN at q8_0 (its attention factor 1.21 scales the rounding): 0.20 and 0.28
WIDER = {("gemma3", "q8_0"): 0.3, ("olmo3", "q8_0"): 0.3, ("gemma2_27b", "q8_0"): 0.3,
         ("olmo2_yarn", "q8_0"): 0.3, ("olmo3_yarn", "q8_0"): 0.4}  # fmt: skip
OLMO_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
             "attention_factor": 1.2079441541679836}  # fmt: skip
OLMO_THETA = olmo3.spec("olmo3_tiny").rope_theta
TRUNCATED_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
# family -> (zoo module, tokenizer family, spec overrides); Llama keeps its llama3 RoPE scaling
# (llama.cpp reads rope_freqs); Qwen3-MoE with every layer sparse (llama.cpp's qwen3moe);
FAMILIES = {
    "llama": (llama3, "llama3", {}),
    "qwen2": (qwen2_5, "qwen2_5", {}),
    "qwen3": (qwen3, "qwen3", {}),
    # YaRN past an original context of 16 (the prompt is longer): llama.cpp's own attention
    # factor and correction range; without the scaling in the file its logits differ by ~2 std
    "qwen3_yarn": (qwen3, "qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16}}),
    "qwen3_moe": (qwen3_moe, "qwen3", {"mlp_only_layers": (), "norm_topk_prob": True}),
    # Phi-3 rotating half of each head with LongRoPE (Phi-4-mini's kind): llama.cpp takes the
    # long factors for a context past the original 8 positions, as we do for this prompt
    "phi3": (phi3, "phi4", {}),
    "olmo2": (olmo2, "olmo2", {}),
    "olmo3": (olmo3, "olmo2", {}),  # llama.cpp's olmo2 with a window of 4 on 3 layers of 4
    # OLMo 3's YaRN past 16 positions on its global layer only, the window layers rotating
    # plainly (as llama.cpp's olmo2 does with a window); OLMo 2's on every layer
    "olmo3_yarn": (olmo3, "olmo2", {"rope_scaling": OLMO_YARN, "rope_local_theta": OLMO_THETA}),
    "olmo2_yarn": (olmo2, "olmo2", {"rope_scaling": OLMO_YARN}),
    "granite": (granite, "llama3", {}),  # every multiplier set, embeddings tied
    "glm4": (glm4, "llama3", {}),  # interleaved RoPE on half of each head, q/k/v biases
    "smollm3": (smollm3, "llama3", {"nope_layers": (3,)}),  # no RoPE on every 4th layer
    "gemma2": (gemma2, "llama3", {}),  # a window of 4 on every other layer, softcaps
    # llama.cpp's "27B" (46 layers): attention scaled by 1/sqrt(hidden / heads), not the head's
    "gemma2_27b": (gemma2, "llama3", {"num_hidden_layers": 46, "head_dim": 32,
                                      "layer_types": ("sliding_attention", "full_attention") * 23,
                                      "attention_multiplier": 0.25}),
    # five window layers (RoPE base 10000) then a global one, llama.cpp's fixed gemma3 pattern;
    # the global layer's RoPE scaled linearly by 8 as from Gemma 3 4B up (without the factor in
    # the file llama.cpp's logits differ by ~1 std)
    "gemma3": (gemma3, "llama3", {"num_hidden_layers": 6,
                                  "layer_types": ("sliding_attention",) * 5 + ("full_attention",),
                                  "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    # llama.cpp's deepseek2: V2 without a low-rank query, softmax top-2 of 5 (not renormalised,
    # scaled by 1.5), a shared expert, layer 0 dense
    "deepseek_v2": (deepseek_v2, "llama3", {}),
    # V3: a low-rank query, sigmoid scores, top-3 of 6 within the best 2 of 3 groups,
    # renormalised, 2 shared experts
    "deepseek_v3": (deepseek_v3, "llama3", {}),
    # GLM-4.5: q/k/v biases, per-head q/k norms, RoPE on a third of each head, top-2 of 6
    # within the best of 2 groups, 2 shared experts, layer 0 dense
    "glm4_moe": (glm4_moe, "llama3", {}),
    # gpt-oss: attention sinks, a window of 4 on every other layer, q/k/v/o biases, top-3 of 5
    # by a softmax over the router's top logits, clamped SwiGLU experts with biases; YaRN with
    # its correction range truncated, as llama.cpp computes it (gpt-oss's own, truncate false,
    # is refused: llama.cpp's logits then differ from position 1 on, by 1.8 std here)
    "gpt_oss": (gpt_oss, "llama3", {"rope_scaling": TRUNCATED_YARN}),
    # Llama 4 as llama.cpp's llama4 fixes it: chunks of 8192, layer 3 global without RoPE (its
    # queries' temperature), Scout's llama3 RoPE scaling, top-1 of 3 experts on layers 1 and 3
    "llama4": (llama4, "llama3", LLAMA4),
}  # fmt: skip
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4,
                 "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
# the mixtures of experts (and OLMo 3's YaRN) with weights large enough that routing and YaRN move the logits
# (a random model of initializer_range 0.02 routes by near ties and attends almost uniformly:
# DeepSeek-V3's YaRN moves its logits by 0.01 std there, by 5 std at 0.2), compared where
# nothing rounds: an f32 file and llama.cpp's KV cache in f32 (f16 weights move a near tie of
# the router at one position of the prompt: 1-3 std there)
EXACT = {
    "deepseek_v2": (deepseek_v2, "llama3", {"initializer_range": 0.2}),
    # 12 experts, top-3 within the best 2 of 4 groups, a random router bias (exp_probs_b);
    # DeepSeek's YaRN past 4 positions
    "deepseek_v3": (deepseek_v3, "llama3", {
        "initializer_range": 0.2, "num_experts": 12, "num_experts_per_tok": 3,
        "moe_routing": DeepSeekRouting("noaux_tc", 4, 2, 2.5, 2), "rope_scaling": DEEPSEEK_YARN}),
    "glm4_moe": (glm4_moe, "llama3", {"initializer_range": 0.2}),  # a random router bias too
    "gpt_oss": (gpt_oss, "llama3", {"initializer_range": 0.2, "rope_scaling": TRUNCATED_YARN}),
    # OLMo 3's YaRN on the global layer only (our logits with it on every layer: 3 std away)
    "olmo3_yarn": FAMILIES["olmo3_yarn"],
    "llama4": (llama4, "llama3", {**LLAMA4, "initializer_range": 0.2}),
}  # fmt: skip
EXACT_TOLERANCE = 1e-4  # max |Δ logit| / std, f32 file and f32 KV cache (measured 1e-5)
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "add 12 and 30, please!"},
    {"role": "assistant", "content": "12 + 30 = 42"},
]
TEXTS = [
    "Hello world 123, it's 2026!",
    "\n\n  indented\ttabs <|im_end|> done",
    "ünïcödé 日本語 🙂 mixed",
]


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as error:  # the marker is opt-in: say how to get it, do not skip
        raise RuntimeError(
            "llama-cpp-python is not installed: `make test-llama-cpp` installs the llama-cpp "
            "extra (it builds llama.cpp) and runs these tests"
        ) from error
    return llama_cpp


def _model_dir(root, family: str, families=FAMILIES, router_bias: bool = False):
    zoo, tokenizer_family, overrides = families[family]
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", tokenizer_family)
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    spec = zoo.spec(f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny", vocab_size=vocab, **overrides)
    model = build_model(spec)
    for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias, zero when built
        if router_bias and name.endswith("e_score_correction_bias"):
            buffer.uniform_(-0.3, 0.3)
    return save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: _model_dir(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def _load(path, n_ctx: int = 256, **options):
    return _llama_cpp().Llama(
        model_path=str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False, seed=0,
        **options,
    )  # fmt: skip


def llama_cpp_logits(path, ids: list[int], **options) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` of the GGUF file ``path`` on ``ids``
    (``options``: ``llama_cpp.Llama``'s, e.g. the KV cache's ``type_k``)."""
    llm = _load(path, **options)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return logits


# compared at f16 only (see the module docs)
MOE = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4")
COMPARED = [(f, t) for f in sorted(FAMILIES) for t in sorted(TOLERANCE)
            if f not in MOE or t == "f16"]  # fmt: skip


@pytest.mark.parametrize(("family", "outtype"), COMPARED)
def test_llama_cpp_computes_our_logits(folders, tmp_path, family, outtype):
    folder = folders[family]
    path = export_gguf(folder, tmp_path / "model.gguf", outtype=outtype)
    ids, _ = Tokenizer.from_pretrained(folder).tokenize_conversation(CONVERSATION)
    ours = from_hf(folder, dtype=torch.float32)
    with torch.no_grad():
        want = ours(torch.tensor([ids]))[0].numpy()
    got = llama_cpp_logits(path, ids)
    assert got.shape == want.shape
    gap = np.abs(got - want).max() / want.std()
    assert gap < WIDER.get((family, outtype), TOLERANCE[outtype]), gap
    assert gap > 0  # the file's rounding is there: llama.cpp did compute it


@pytest.mark.parametrize("family", sorted(EXACT))
def test_llama_cpp_computes_our_model_exactly_in_f32(tmp_path, family):
    folder = _model_dir(tmp_path, family, EXACT, router_bias=True)
    path = export_gguf(folder, tmp_path / "model.gguf", outtype="f32")
    ids, _ = Tokenizer.from_pretrained(folder).tokenize_conversation(CONVERSATION)
    with torch.no_grad():
        want = from_hf(folder, dtype=torch.float32)(torch.tensor([ids]))[0].numpy()
    f32 = 0  # GGML_TYPE_F32
    got = llama_cpp_logits(path, ids, type_k=f32, type_v=f32)
    assert np.abs(got - want).max() / want.std() < EXACT_TOLERANCE


# Llama 4 past its first chunk: positions 8192 on start a chunk of their own on the RoPE layers
# and raise the NoPE layer's temperature (floor((pos + 1) / 8192) turns 1 at 8191); f32 file and
# KV cache, weights of initializer_range 0.2. Measured: 1.4e-4 std at worst (sums over 8300
# positions in f32); our model without the temperature is 0.088 std from llama.cpp past 8192, with
# one chunk over the whole prompt 6.9 std (without Scout's RoPE scaling 1.9): llama.cpp did
# compute them. Our forward on 8300 tokens: ~4 s on 2 CPU cores; llama.cpp's ~15 s.
LONG_PROMPT = 8300
LONG_TOLERANCE = 1e-3


def _our_logits(folder, ids: list[int], **config) -> np.ndarray:
    """Our float32 logits on ``ids`` of the model in ``folder``, its ``config.json`` changed by
    ``config`` (in a copy)."""
    if config:
        copy = folder.parent / "_".join(config)
        shutil.copytree(folder, copy)
        data = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**data, **config}))
        folder = copy
    with torch.no_grad():
        return from_hf(folder, dtype=torch.float32)(torch.tensor([ids]))[0].numpy()


def test_llama_cpp_computes_llama4_past_its_first_chunk(tmp_path):
    folder = _model_dir(tmp_path, "llama4", EXACT)
    path = export_gguf(folder, tmp_path / "model.gguf", outtype="f32")
    ids = torch.randint(3, 200, (LONG_PROMPT,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    got = llama_cpp_logits(path, ids, n_ctx=LONG_PROMPT + 256, type_k=0, type_v=0)
    want = _our_logits(folder, ids)
    scale = want.std()
    assert np.abs(got - want).max() / scale < LONG_TOLERANCE
    later = slice(8192, None)  # past the first chunk, the temperature raised
    for config in ({"attn_temperature_tuning": False}, {"attention_chunk_size": 16384}):
        other = _our_logits(folder, ids, **config)
        assert np.abs(got[later] - other[later]).max() / scale > 10 * LONG_TOLERANCE, config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_tokenizes_and_templates_as_we_do(folders, tmp_path, family):
    folder = folders[family]
    llm = _load(export_gguf(folder, tmp_path / "model.gguf", outtype="q8_0"))
    ours = Tokenizer.from_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ours.encode(
            text, add_special_tokens=False
        ), text
    template = llm.metadata["tokenizer.chat_template"]
    assert template == config["chat_template"]
    assert int(llm.metadata["tokenizer.ggml.eos_token_id"]) == ours.eos_id
    formatter = _llama_cpp().llama_chat_format.Jinja2ChatFormatter(
        template, eos_token=config["eos_token"], bos_token=config.get("bos_token") or "",
        add_generation_prompt=False,
    )  # fmt: skip
    prompt = formatter(messages=CONVERSATION).prompt
    assert prompt == ours.apply_chat_template(CONVERSATION)
    ids, _ = ours.tokenize_conversation(CONVERSATION)
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    llm.close()


# sentencepiece-style tokenizers (Gemma's "▁" normalizer; Llama 2's with a "▁" prepended, which
# llama.cpp adds as add_space_prefix) exported as llama.cpp's SPM vocabulary; merges ranked
# against the pieces' ids too (the scores follow the ranks)
SPM_FAMILIES = {"gemma2": (gemma2, {}), "gemma2_reversed": (gemma2, {"reverse": True}),
                "llama": (llama3, {"llama2": True})}  # fmt: skip


@pytest.mark.parametrize("family", sorted(SPM_FAMILIES))
def test_llama_cpp_reads_a_sentencepiece_tokenizer_as_we_do(tmp_path, family):
    zoo, overrides = SPM_FAMILIES[family]
    folder = spm_model_dir(tmp_path, zoo, **overrides)
    llm = _load(export_gguf(folder, tmp_path / "model.gguf", outtype="f16"))
    ours = Tokenizer.from_pretrained(folder)
    for text in SPM_TEXTS:
        want = ours.encode(text, add_special_tokens=False)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want, text
    ids = ours.encode(" ".join(SPM_TEXTS))  # <bos> first, as both add it
    assert llm.tokenize(" ".join(SPM_TEXTS).encode(), add_bos=True, special=True) == ids
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    with torch.no_grad():
        want = from_hf(folder, dtype=torch.float32)(torch.tensor([ids]))[0].numpy()
    gap = np.abs(got - want).max() / want.std()
    assert 0 < gap < TOLERANCE["f16"], gap
