"""Reward models against transformers' ``*ForSequenceClassification``: load, score, save.

Every checkpoint is a tiny random transformers model written with ``save_pretrained`` into a
temporary folder (nothing is downloaded). Scores are compared on a right-padded batch of
unequal lengths whose pad id never occurs in the real tokens, so transformers' "last token that
is not padding" and our "last position where the mask is 1" must pick the same token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tunesmith.models import (
    RewardModel,
    build_reward_model,
    granite,
    reward_model_from_hf,
)
from tunesmith.models.hf import (
    CheckpointError,
    save_hf_checkpoint,
    write_hf_checkpoint,
)
from tunesmith.models.reward import last_token_positions
from tunesmith.models.safetensors_io import CheckpointFileNotFoundError
from tunesmith.models.spec import spec_from_hf_config

PAD = 0
ATOL = 1e-5
LENGTHS = (9, 5, 7)  # unequal rows, right-padded to 9
# Independently of spec.py: the class transformers must instantiate for each family.
SEQ_CLS = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
}
FAMILIES = ("llama", "qwen2", "qwen3")  # qwen2: q/k/v bias; qwen3: qk-norm, wide heads


# ----------------------------------------------------------------------------- helpers


def _batch(vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (real tokens never equal PAD) and their 0/1 mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def _hf_seq_cls(hf_tiny, family: str, num_labels: int = 1, seed: int = 0, **overrides):
    config = hf_tiny.config(family, pad_token_id=PAD, num_labels=num_labels, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return hf_tiny.randomize(model, seed).eval()


def _load_seq_cls(folder: Path) -> tuple[transformers.PreTrainedModel, list[str]]:
    """transformers' classifier from ``folder``; fails on missing/unexpected/mismatched keys.
    Returns the model and every warning transformers logged while loading."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, output_loading_info=True, attn_implementation="eager"
        )
    finally:
        logger.removeHandler(handler)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loading {folder}: {problems}"
    return model.eval(), records


@torch.no_grad()
def _hf_scores(model: transformers.PreTrainedModel, ids, mask) -> torch.Tensor:
    return model(ids, attention_mask=mask).logits


@torch.no_grad()
def _our_scores(model: RewardModel, ids, mask) -> torch.Tensor:
    return model(ids, attention_mask=mask)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def seq_cls_folders(hf_tiny, tmp_path_factory):
    """family -> (folder written by transformers' save_pretrained, the transformers model)."""
    root = tmp_path_factory.mktemp("seq_cls")
    folders = {}
    for family in FAMILIES:
        model = _hf_seq_cls(hf_tiny, family, seed=1)
        model.save_pretrained(root / family)
        folders[family] = (root / family, model)
    return folders


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoint_scores_match(family, seq_cls_folders) -> None:
    folder, hf = seq_cls_folders[family]
    rm = reward_model_from_hf(folder).eval()
    assert isinstance(rm, RewardModel) and not hasattr(rm, "lm_head")
    assert rm.num_labels == 1 and rm.spec.model_type == family and rm.spec.pad_token_id == PAD
    ids, mask = _batch()
    ours, theirs = _our_scores(rm, ids, mask), _hf_scores(hf, ids, mask)
    assert ours.shape == (len(LENGTHS), 1) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max() < ATOL
    # The parity is not vacuous: scoring the last padded position instead differs.
    assert (_our_scores(rm, ids, None) - theirs)[1:].abs().min() > 1e-3


def test_scores_are_the_head_at_the_last_real_token(seq_cls_folders) -> None:
    """Written out directly: score.weight @ hidden[last real token], each row also alone."""
    rm = reward_model_from_hf(seq_cls_folders["qwen3"][0]).eval()
    ids, mask = _batch(seed=2)
    with torch.no_grad():
        hidden = rm.model(ids, attention_mask=mask)
        scores = rm(ids, attention_mask=mask)
        for row, length in enumerate(LENGTHS):
            expected = hidden[row, length - 1] @ rm.score.weight.T
            torch.testing.assert_close(scores[row], expected, rtol=0, atol=1e-6)
            alone = rm(ids[row : row + 1, :length])[0]  # no mask: the last position
            torch.testing.assert_close(scores[row], alone, rtol=0, atol=ATOL)


def test_left_padding_with_positions_scores_the_same() -> None:
    spec = spec_from_hf_config(
        transformers.AutoConfig.for_model(
            "llama",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=PAD,
        ).to_dict()
    )
    torch.manual_seed(0)
    rm = build_reward_model(spec).eval()
    ids, mask = _batch(vocab=64, seed=3)
    left_ids, left_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for row, length in enumerate(LENGTHS):
        left_ids[row, -length:] = ids[row, :length]
        left_mask[row, -length:] = 1
    positions = (left_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        right = rm(ids, attention_mask=mask)
        left = rm(left_ids, attention_mask=left_mask, position_ids=positions)
    torch.testing.assert_close(left, right, rtol=0, atol=ATOL)


def test_last_token_positions() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]])
    assert last_token_positions(mask, torch.zeros(3, 4)).tolist() == [1, 3, 2]
    assert last_token_positions(None, torch.zeros(2, 5)).tolist() == [4, 4]


def test_two_labels_load_and_save(hf_tiny, tmp_path: Path) -> None:
    hf = _hf_seq_cls(hf_tiny, "qwen2", num_labels=2, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    rm = reward_model_from_hf(tmp_path / "hf", num_labels=2).eval()
    ids, mask = _batch(seed=4)
    ours = _our_scores(rm, ids, mask)
    assert ours.shape == (len(LENGTHS), 2)
    assert (ours - _hf_scores(hf, ids, mask)).abs().max() < ATOL
    out = save_hf_checkpoint(rm, tmp_path / "ours")
    reloaded, _ = _load_seq_cls(out)
    assert reloaded.config.num_labels == 2
    assert (_hf_scores(reloaded, ids, mask) - ours).abs().max() < ATOL


def test_bf16_load_gives_float32_scores(seq_cls_folders) -> None:
    rm = reward_model_from_hf(seq_cls_folders["llama"][0], dtype="bf16").eval()
    assert rm.score.weight.dtype == rm.model.embed_tokens.weight.dtype == torch.bfloat16
    ids, mask = _batch()
    assert _our_scores(rm, ids, mask).dtype == torch.float32
    built = build_reward_model(rm.spec, dtype=torch.bfloat16)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    meta = build_reward_model(rm.spec, device="meta", dtype=torch.bfloat16)
    assert meta.score.weight.is_meta and meta.score.weight.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- saving


@pytest.mark.parametrize("family", [*FAMILIES, "mistral"])
def test_saved_reward_model_loads_in_transformers(family, hf_tiny, tmp_path: Path) -> None:
    spec = spec_from_hf_config(hf_tiny.config(family, pad_token_id=PAD).to_dict())
    rm = hf_tiny.randomize(build_reward_model(spec), seed=5).eval()
    out = save_hf_checkpoint(rm, tmp_path / "rm")

    config = _config(out)
    assert config["architectures"] == [SEQ_CLS[family]]
    assert config["pad_token_id"] == PAD
    assert not (out / "generation_config.json").exists()
    # Label fields and tensor names exactly as transformers' own save_pretrained writes them.
    reference = _hf_seq_cls(hf_tiny, family)
    reference.save_pretrained(tmp_path / "reference")
    theirs = _config(tmp_path / "reference")
    assert config["id2label"] == theirs["id2label"] == {"0": "LABEL_0"}
    assert config["label2id"] == theirs["label2id"]
    assert set(_tensors(out)) == set(_tensors(tmp_path / "reference"))

    hf, warnings = _load_seq_cls(out)
    assert type(hf).__name__ == SEQ_CLS[family] and hf.config.num_labels == 1
    assert warnings == []
    ids, mask = _batch(seed=6)
    assert (_hf_scores(hf, ids, mask) - _our_scores(rm, ids, mask)).abs().max() < ATOL


def test_round_trip_is_exact(seq_cls_folders, tmp_path: Path) -> None:
    rm = reward_model_from_hf(seq_cls_folders["qwen2"][0])
    out = save_hf_checkpoint(rm, tmp_path / "rm")
    again = reward_model_from_hf(out)
    assert again.spec == rm.spec
    mine, theirs = rm.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_plain_state_dict_saves_as_a_classifier(seq_cls_folders, tmp_path: Path) -> None:
    """The trainer's path: a gathered state dict plus spec, no module."""
    folder, hf = seq_cls_folders["llama"]
    rm = reward_model_from_hf(folder)
    out = tmp_path / "state"
    out.mkdir()
    write_hf_checkpoint(rm.state_dict(), out, spec=rm.spec)
    reloaded, _ = _load_seq_cls(out)
    ids, mask = _batch(seed=7)
    assert (_hf_scores(reloaded, ids, mask) - _hf_scores(hf, ids, mask)).abs().max() < ATOL

    state = dict(rm.state_dict(), **{"lm_head.weight": torch.zeros(128, 64)})
    with pytest.raises(CheckpointError, match=r"unexpected \['lm_head\.weight'\]"):
        write_hf_checkpoint(state, tmp_path / "bad", spec=rm.spec)


def test_pad_token_id_is_required_and_can_be_passed(hf_tiny, tmp_path: Path) -> None:
    spec = spec_from_hf_config(hf_tiny.config("qwen3").to_dict())
    assert spec.pad_token_id is None
    rm = build_reward_model(spec)
    with pytest.raises(ValueError, match="pad_token_id"):
        save_hf_checkpoint(rm, tmp_path / "no_pad")
    assert not (tmp_path / "no_pad").exists()
    out = save_hf_checkpoint(rm, tmp_path / "pad", pad_token_id=7)
    assert _config(out)["pad_token_id"] == 7
    assert _load_seq_cls(out)[0].config.pad_token_id == 7


# ----------------------------------------------------------------------------- causal LM in


@pytest.mark.parametrize(
    ("family", "tied"), [("llama", False), ("qwen2", True)], ids=["llama", "qwen2_tied"]
)
def test_causal_lm_gives_body_and_fresh_head(family, tied, hf_tiny, tmp_path: Path, caplog) -> None:
    folder = tmp_path / "lm"
    hf_lm = hf_tiny.write_checkpoint(
        folder, family, seed=8, tie_word_embeddings=tied, pad_token_id=PAD
    )
    torch.manual_seed(11)
    with caplog.at_level(logging.WARNING, logger="tunesmith.models.reward"):
        rm = reward_model_from_hf(folder).eval()
    assert any(
        "causal LM" in r.getMessage() and "score.weight" in r.getMessage() for r in caplog.records
    )

    # Body: bit-identical to the causal LM's; no lm_head anywhere.
    body = {k: v for k, v in _tensors(folder).items() if k.startswith("model.")}
    state = rm.state_dict()
    assert set(state) == set(body) | {"score.weight"}
    assert all(torch.equal(state[k], body[k]) for k in body)
    # Head: N(0, initializer_range) drawn from torch's seeded default generator.
    torch.manual_seed(11)
    expected = torch.randn(1, hf_lm.config.hidden_size) * hf_lm.config.initializer_range
    assert torch.equal(rm.score.weight, expected)

    # transformers builds the same body from the same folder: equal hidden states.
    ids, mask = _batch(seed=9)
    with torch.no_grad():
        hf_hidden = hf_lm.model(ids, attention_mask=mask).last_hidden_state
        ours = rm.model(ids, attention_mask=mask)
    assert (hf_hidden - ours)[mask.bool()].abs().max() < 1e-4
    # ... and the converted model saves as a classifier transformers scores identically.
    out = save_hf_checkpoint(rm, tmp_path / "rm")
    hf, warnings = _load_seq_cls(out)
    assert warnings == []
    assert (_hf_scores(hf, ids, mask) - _our_scores(rm, ids, mask)).abs().max() < ATOL


def test_fresh_head_follows_the_seed(hf_tiny, tmp_path: Path) -> None:
    hf_tiny.write_checkpoint(tmp_path, "llama", seed=10)
    heads = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        heads.append(reward_model_from_hf(tmp_path, num_labels=200).score.weight)
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert abs(heads[0].std().item() - 0.02) < 0.002  # 12800 draws of N(0, 0.02)


# ----------------------------------------------------------------------------- errors


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileNotFoundError, match=r"nowhere.*config\.json"):
        reward_model_from_hf(tmp_path / "nowhere")


def test_num_labels_mismatch_names_file_and_key(seq_cls_folders) -> None:
    folder = seq_cls_folders["llama"][0]
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor 'score\.weight' has shape \[1, 64\]"
    ) as err:
        reward_model_from_hf(folder, num_labels=2)
    assert "num_labels=2" in str(err.value)
    with pytest.raises(ValueError, match="num_labels must be a positive int"):
        reward_model_from_hf(folder, num_labels=0)


def test_classifier_config_without_score_is_named(seq_cls_folders, tmp_path: Path) -> None:
    source = seq_cls_folders["llama"][0]
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    tensors = _tensors(source)
    del tensors["score.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"config\.json names .*ForSequenceClassification.*'score\.weight'"
    ):
        reward_model_from_hf(tmp_path)


def test_bad_masks_are_refused(seq_cls_folders) -> None:
    rm = reward_model_from_hf(seq_cls_folders["llama"][0])
    ids, mask = _batch()
    with pytest.raises(ValueError, match="2-D"):
        rm(ids, attention_mask=mask.bool()[:, None, None, :])
    mask[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        rm(ids, attention_mask=mask)


def test_an_moe_body_gives_its_router_logits_to_the_load_balancing_loss() -> None:
    from tunesmith.models import llama3, qwen3_moe
    from tunesmith.modules.losses import BradleyTerryLoss
    from tunesmith.modules.moe import load_balancing_loss
    from tunesmith.training.objectives import PairwiseRanking

    torch.manual_seed(0)
    spec = qwen3_moe.spec("qwen3_moe_tiny", pad_token_id=PAD)
    model = build_reward_model(spec)
    ids, mask = _batch(vocab=spec.vocab_size)
    scores, router_logits = model(ids, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(scores, model(ids, attention_mask=mask), rtol=0, atol=0)
    _, body_router_logits = model.model(ids, attention_mask=mask, output_router_logits=True)
    assert len(router_logits) == len(body_router_logits) == 2  # layer 1 of 3 is dense
    for ours, body in zip(router_logits, body_router_logits):
        torch.testing.assert_close(ours, body, rtol=0, atol=0)

    # the objective adds coef x the load-balancing loss, and it trains the routers
    half = ids.shape[0] // 2
    batch = {"input_ids": ids[: 2 * half], "attention_mask": mask[: 2 * half],
             "position_ids": torch.arange(ids.shape[1]).expand(2 * half, -1)}  # fmt: skip
    out = PairwiseRanking(BradleyTerryLoss())(model, batch)
    _, batch_router_logits = model.model(
        batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
    )
    expected = spec.router_aux_loss_coef * load_balancing_loss(
        batch_router_logits, spec.num_experts_per_tok, batch["attention_mask"]
    )
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    torch.testing.assert_close(out.aux_loss, expected)
    out.aux_loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0

    dense = build_reward_model(llama3.spec("llama3_tiny", pad_token_id=PAD))
    assert dense(ids, attention_mask=mask, output_router_logits=True)[1] == ()
    assert PairwiseRanking(BradleyTerryLoss())(dense, batch).aux_loss is None


def test_a_family_transformers_has_no_classifier_for_saves_with_a_warning(tmp_path):
    """Granite has no *ForSequenceClassification in transformers: its reward (or PPO value)
    model still saves and loads back in tunesmith, with no class named and a warning."""
    model = build_reward_model(granite.spec("granite_tiny", pad_token_id=0))
    with pytest.warns(UserWarning, match="no sequence-classification class for granite"):
        save_hf_checkpoint(model, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == [] and config["num_labels"] == 1
    again = reward_model_from_hf(tmp_path / "rm")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
