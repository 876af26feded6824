"""RewardModelScore: a tiny reward model saved as the reward_model recipe saves it (HF
sequence-classification folder + tokenizer files), scored in right-padded batches, must give
each text the score the model gives that text alone, unpadded."""

from __future__ import annotations

import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data import Tokenizer
from tunesmith.models import build_reward_model, qwen3
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.rl.rewards import RewardModelScore, RewardSet, Sample

PROMPT = "<|im_start|>user\nWhat is two plus {n}?<|im_end|>\n<|im_start|>assistant\n"
COMPLETIONS = ["4", "It is four, I think.", "Five", "", "two plus two is four, surely"]


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    """(folder, the in-memory model, the tokenizer) of a tiny random reward model."""
    root = tmp_path_factory.mktemp("rm")
    tok_dir = make_tokenizer_folder(root / "tok", "qwen2_5")
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    spec = qwen3.spec("qwen3_tiny", vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id)
    model = build_reward_model(spec).eval()
    model.init_score(std=1.0)  # scores far apart, so equality means something
    folder = save_hf_checkpoint(model, root / "rm", source_dir=tok_dir)
    return folder, model, tokenizer


def _samples() -> list[Sample]:
    return [Sample(PROMPT.format(n=i), c) for i, c in enumerate(COMPLETIONS)]


@torch.no_grad()
def _alone(model, tokenizer, text: str) -> float:
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    return model(ids)[0, 0].item()


def test_batched_scores_equal_one_by_one(rm_folder) -> None:
    folder, model, tokenizer = rm_folder
    samples = _samples()
    reward = RewardModelScore(folder, batch_size=2)  # 3 batches, padded within each
    scores = reward(samples)
    expected = [_alone(model, tokenizer, s.prompt + s.completion) for s in samples]
    assert len(scores) == len(samples)
    assert scores == pytest.approx(expected, abs=1e-5, rel=0)
    assert torch.tensor(expected).std() > 0.05  # distinct texts, distinct scores
    # the batch size changes nothing
    assert RewardModelScore(folder, batch_size=16)(samples) == pytest.approx(scores, abs=1e-5)
    assert not any(p.requires_grad for p in reward.model.parameters())
    assert not reward.model.training


def test_suffix_and_left_truncation(rm_folder) -> None:
    folder, model, tokenizer = rm_folder
    samples = _samples()[:3]
    with_suffix = RewardModelScore(folder, suffix="<|im_end|>")(samples)
    expected = [_alone(model, tokenizer, s.prompt + s.completion + "<|im_end|>") for s in samples]
    assert with_suffix == pytest.approx(expected, abs=1e-5, rel=0)

    short = RewardModelScore(folder, max_length=4)(samples)
    for sample, score in zip(samples, short):
        ids = tokenizer.encode(sample.prompt + sample.completion, add_special_tokens=False)
        with torch.no_grad():
            alone = model(torch.tensor([ids[-4:]]))[0, 0].item()
        assert score == pytest.approx(alone, abs=1e-5)


def test_from_yaml_in_a_reward_set(rm_folder) -> None:
    from tunesmith.config import instantiate

    folder, model, tokenizer = rm_folder
    rewards = instantiate(
        {
            "_component_": "tunesmith.rl.rewards.RewardSet",
            "rewards": {
                "rm": {
                    "_component_": "tunesmith.rl.rewards.RewardModelScore",
                    "model_dir": str(folder),
                }
            },
            "weights": {"rm": 0.5},
        }
    )
    sample = _samples()[1]
    result = rewards([sample])
    assert result.total.item() == pytest.approx(
        0.5 * _alone(model, tokenizer, sample.prompt + sample.completion), abs=1e-5
    )
    assert isinstance(rewards, RewardSet)


def test_empty_text_fails_only_its_sample(rm_folder) -> None:
    folder, _, _ = rm_folder
    result = RewardSet([RewardModelScore(folder)])([Sample("", ""), Sample("", "hi")])
    assert result.failures == {"reward_model": 1}
    assert result.per_reward["reward_model"][0].item() == 0.0
