"""The two backends are one model: a native family's folder built natively (``TransformerLM``)
and through transformers' own class (``from_hf(..., backend="transformers")``, a
``TransformersLM``) computes the same numbers.

- forward: the same logits (atol 1e-5) on a padded batch (2-D attention mask, per-row
  position ids, left- and right-padded rows) at every attended position, and on packed rows
  (native masks the documents by ``document_ids``, transformers by the restarting position
  ids), where each document's logits are also those of the document run alone; greedy
  KV-cache generation decodes the same tokens;
- training: the SFT recipe's ``tiny`` config for 5 steps with ``model.backend=native`` and
  ``model.backend=transformers`` logs the same loss and gradient norm at every step (relative
  1e-5) and ends with the same weights (atol 1e-6, while training moved them > 1e-3), on
  padded batches (default tier) and on packed rows of several documents (slow tier).

Families: Llama 3 (llama3 RoPE scaling, untied head) and Qwen3 (qk-norm, tied head).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    final_weights,
    largest_change,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft_keeping_model,
    sample_lengths,
)
from tunesmith.data.collate import collate_packed
from tunesmith.data.packing import assign_packs, pack_greedy
from tunesmith.generation import generate
from tunesmith.models import from_hf
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.models.zoo import llama3, qwen3
from tunesmith.modules.decoder import TransformerLM

FAMILIES: dict[str, ModuleType] = {"llama3": llama3, "qwen3": qwen3}
STEPS = 5
PACK_LEN = 256


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF folder per family (one tokenizer, one chat data file)."""
    root = tmp_path_factory.mktemp("backends")
    dirs = {name: make_model_dir(root / name, family=fam) for name, fam in FAMILIES.items()}
    return {**dirs, "data": make_chat_data(root / "chat.jsonl")}


def _both(model_dir: Path) -> tuple[TransformerLM, TransformersLM]:
    native = from_hf(model_dir, dtype="float32", backend="native")
    hf = from_hf(model_dir, dtype="float32", backend="transformers")
    assert type(native) is TransformerLM and type(hf) is TransformersLM
    return native.eval(), hf.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_same_logits_padded_packed_and_decoded(world, family):
    native, hf = _both(world[family])
    vocab = native.spec.vocab_size
    gen = torch.Generator().manual_seed(0)

    # a padded batch: a full row, a right-padded and a left-padded one
    ids = torch.randint(3, vocab, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, :4] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    got = {m: m(ids, attention_mask=mask, position_ids=pos) for m in (native, hf)}
    real = mask.bool()
    torch.testing.assert_close(got[hf][real], got[native][real], atol=1e-5, rtol=0)
    hidden = {m: m(ids, attention_mask=mask, position_ids=pos, return_hidden_states=True)
              for m in (native, hf)}  # fmt: skip
    torch.testing.assert_close(hidden[hf][real], hidden[native][real], atol=1e-5, rtol=0)
    # left padding shifts the real tokens: their logits are the unpadded row's
    alone = native(ids[2:, 4:])
    torch.testing.assert_close(got[hf][2, 4:], alone[0], atol=1e-5, rtol=0)

    # packed rows: documents of 5, 3, 7, 4 and 1 tokens in two rows of 12 (the second padded)
    docs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 3, 7, 4, 1)]
    samples = [{"input_ids": d, "labels": [1] * (len(d) - 1) + [-100]} for d in docs]
    batch = collate_packed(pack_greedy(samples, 12, pad_id=0))
    assert (batch["document_ids"] == -1).any() and batch["document_ids"].max() >= 2
    packed = {
        m: m(
            batch["input_ids"],
            position_ids=batch["position_ids"],
            document_ids=batch["document_ids"],
        )
        for m in (native, hf)
    }
    real = batch["document_ids"] >= 0
    torch.testing.assert_close(packed[hf][real], packed[native][real], atol=1e-5, rtol=0)
    # each document attends to itself only: its logits are those of the document alone
    checked = 0
    for row, doc_ids in enumerate(batch["document_ids"]):
        for doc in doc_ids[doc_ids >= 0].unique():
            where = doc_ids == doc
            alone = hf(batch["input_ids"][row, where][None])[0]
            torch.testing.assert_close(packed[hf][row, where], alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(packed[native][row, where], alone, atol=1e-5, rtol=0)
            checked += 1
    assert checked == len(docs)
    # ... which differ from the causal logits across documents (the masking matters)
    causal = hf(batch["input_ids"])  # positions 0..11: one causal sequence per row
    assert (causal[real] - packed[hf][real]).abs().max() > 1e-3

    # greedy decoding with the KV cache: the same tokens from prompts of unequal lengths
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 7, 2)]
    out = {m: generate(m, prompts, max_new_tokens=8).sequences for m in (native, hf)}
    assert out[hf] == out[native]
    assert all(len(s) == 8 for s in out[native])


def _train_both(world, family: str, out: Path, *overrides: str):
    runs, models = {}, {}
    for backend in ("native", "transformers"):
        runs[backend], models[backend] = run_sft_keeping_model(
            world[family],
            world["data"],
            out / backend,
            f"max_steps={STEPS}",
            f"model.backend={backend}",
            *overrides,
        )
    assert type(models["native"]) is TransformerLM
    assert type(models["transformers"]) is TransformersLM
    return runs


def _assert_same_training(model_dir: Path, runs: dict[str, Path]) -> None:
    native, hf = read_metrics(runs["native"]), read_metrics(runs["transformers"])
    assert sorted(native) == sorted(hf) == list(range(1, STEPS + 1))
    for step in native:
        tokens = "trained_tokens_in_window"
        assert native[step][tokens] == hf[step][tokens], step
        assert hf[step]["loss"] == pytest.approx(native[step]["loss"], rel=1e-5), step
        assert hf[step]["grad_norm"] == pytest.approx(native[step]["grad_norm"], rel=1e-5), step
    weights = final_weights(runs["native"])
    assert_same_weights(final_weights(runs["transformers"]), weights, atol=1e-6)
    assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_same_losses_grad_norms_and_weights(world, family, tmp_path):
    runs = _train_both(world, family, tmp_path)
    _assert_same_training(world[family], runs)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_packed_same_losses_grad_norms_and_weights(world, family, tmp_path):
    """Packed rows of 256 tokens (about three documents each): native masks by document
    ids, transformers by the position ids that restart at each document."""
    packs = assign_packs(sample_lengths(world[family], world["data"]), PACK_LEN)
    assert min(len(members) for members in packs[:-1]) >= 2  # the masking matters
    runs = _train_both(world, family, tmp_path, "packed=true", f"dataset.max_seq_len={PACK_LEN}")
    _assert_same_training(world[family], runs)
