"""llama.cpp itself reads our GGUF files (issue #37): a tiny random model of each family, with
the test suite's trained byte-level BPE tokenizer, exported as f16 and q8_0 and loaded by
``llama_cpp.Llama`` (llama-cpp-python, which builds llama.cpp from source): its logits on a
rendered conversation against ours in float32, its tokenizer's ids against ours, and the chat
template it reads (``tokenizer.chat_template``) rendering the same prompt.

Marked ``llama_cpp`` (not in ``make test``: building llama.cpp takes minutes);
``make test-llama-cpp`` installs the ``llama-cpp`` extra and runs it.

Tolerances: max |logit difference| over the prompt's positions, against the standard deviation
of our logits (so a shape's scale does not matter): f16 2%, q8_0 15% (measured on these tiny
models: 0.2-0.4% and 5-7%). llama.cpp runs with its defaults, as a user's would: its KV cache
is f16, and its CPU matmuls round the activations to the weights' type too (f16; q8_0: 8-bit
blocks of 32 with a scale), which transformers' reader (``test_gguf_export.py``) does not. The mixture of experts is compared at f16 only: q8_0's
rounding moves a token's router scores across a top-k tie, which sends it to another expert
(a whole expert's difference at that position; ``benchmarks/results/gguf_export.md`` records
the measured values of every family and out type at a larger shape).

Every model shape of the test suite's tiny families loads as is: llama.cpp refused none (head
dims 16 and 32, 2 layers, vocabularies of ~640).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data import Tokenizer
from tunesmith.models import build_model
from tunesmith.models.gguf_export import export_gguf
from tunesmith.models.hf import from_hf, save_hf_checkpoint
from tunesmith.models.zoo import llama3, qwen2_5, qwen3, qwen3_moe

pytestmark = pytest.mark.llama_cpp

TOLERANCE = {"f16": 0.02, "q8_0": 0.15}  # max |Δ logit| / std of our logits
# family -> (zoo module, tokenizer family, spec overrides); Llama keeps its llama3 RoPE scaling
# (llama.cpp reads rope_freqs); Qwen3-MoE with every layer sparse (llama.cpp's qwen3moe)
FAMILIES = {
    "llama": (llama3, "llama3", {}),
    "qwen2": (qwen2_5, "qwen2_5", {}),
    "qwen3": (qwen3, "qwen3", {}),
    "qwen3_moe": (qwen3_moe, "qwen3", {"mlp_only_layers": (), "norm_topk_prob": True}),
}
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


def _load(path, n_ctx: int = 256):
    return _llama_cpp().Llama(
        model_path=str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False, seed=0
    )


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` of the GGUF file ``path`` on ``ids``."""
    llm = _load(path)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return logits


COMPARED = [(f, t) for f in sorted(FAMILIES) for t in sorted(TOLERANCE)
            if f != "qwen3_moe" or t == "f16"]  # fmt: skip


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
    assert gap < TOLERANCE[outtype], gap
    assert gap > 0  # the file's rounding is there: llama.cpp did compute it


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
