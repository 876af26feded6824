"""The rollout source's stages as a variant composes them: a sample stage of its own feeds the
rows, log-probs, advantages and metrics stages unchanged (asynchronous GRPO's shape), an
advantages stage replaces the per-row advantages (PPO's shape), and the log-prob parity check
stops a collection whose sampler and trainer disagree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tunesmith.models import build_model, llama3
from tunesmith.rl.advantages import LeaveOneOut, TeacherReverseKL
from tunesmith.rl.groups import Group
from tunesmith.rl.ppo.trainer import GAEAdvantages
from tunesmith.rl.prompts import Prompt, PromptDataset, PromptStream
from tunesmith.rl.rollout import completion_logprobs, group_batch
from tunesmith.rl.source import (
    GroupAdvantages,
    LogprobMismatchError,
    PolicyLogprobs,
    Rollouts,
    RolloutSettings,
    RolloutSource,
    stop_token_ids,
)
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.setup import FrozenPolicy

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
TOKENIZER = SimpleNamespace(pad_id=0, eos_id=None, token_to_id=lambda token: None)


def make_group(index: int, rewards: list[float]) -> Group:
    prompt = Prompt(index, [{"role": "user", "content": f"prompt {index}"}])
    completions = [[10 + index, 20 + j, 30] for j in range(len(rewards))]
    return Group(
        prompt,
        round=0,
        prompt_ids=[1, 2 + index],
        prompt_text=f"prompt {index}",
        completions=completions,
        logprobs=[[-1.0] * 3 for _ in completions],
        finish=["stop"] * len(rewards),
        texts=["x"] * len(rewards),
        rewards=torch.tensor(rewards),
        per_reward={"r": torch.tensor(rewards)},
    )


class FixedGroups:
    """A sample stage of the test's own: the same two groups for every batch."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, batch_index: int) -> Rollouts:
        self.calls.append(batch_index)
        groups = [make_group(0, [1.0, 0.0]), make_group(1, [0.5, 0.5])]
        return Rollouts(
            groups,
            drawn_groups=2,
            flat_groups=1,
            metrics={"own_metric": 7.0},
            times={"generate_s": 0.0, "reward_s": 0.0, "generated_tokens": 12},
        )

    def state_dict(self) -> dict:
        return {"calls": list(self.calls)}

    def load_state_dict(self, state: dict) -> None:
        self.calls = list(state["calls"])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(llama3.spec("llama3_tiny"))


def make_source(model, tmp_path, **settings) -> RolloutSource:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "unused", "answer": "0"}\n')
    stream = PromptStream(PromptDataset(str(prompts), prompt_column="prompt"), 1)
    return RolloutSource(
        model=model,
        tokenizer=TOKENIZER,
        prompts=stream,
        ctx=CTX,
        settings=RolloutSettings(group_size=2, micro_batch_size=4, **settings),
        advantages=GroupAdvantages(LeaveOneOut(), group_size=2),
        sample=FixedGroups(),
    )


def test_a_sample_stage_of_its_own_feeds_the_other_stages(model, tmp_path):
    source = make_source(model, tmp_path, updates_per_batch=2)
    (batch,) = source.next_step()  # one micro-batch of the 4 rows
    metrics = source.step_metrics()
    source.next_step()  # the batch's second update: no new collection
    assert source.sample.calls == [0] and source.step_metrics() == {}
    source.next_step()
    assert source.sample.calls == [0, 1]  # the stage is called with the batch's number
    rows = group_batch(FixedGroups()(0).groups, pad_id=0)
    for key, value in rows.items():
        torch.testing.assert_close(batch[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(batch["old_logprobs"], completion_logprobs(model, rows))
    assert batch["advantages"].tolist() == [1.0, -1.0, 0.0, 0.0]  # LeaveOneOut; a flat group
    assert metrics["own_metric"] == 7.0 and metrics["zero_variance_groups"] == 0.5
    assert metrics["rollout_samples"] == 4 and metrics["reward/r"] == 0.5
    assert source.state_dict()["calls"] == [0, 1]  # the stage's state is the source's
    resumed = make_source(model, tmp_path, updates_per_batch=2)
    resumed.load_state_dict(source.state_dict())
    assert resumed.sample.calls == [0, 1] and resumed.updates_left == 1


def test_a_teachers_reverse_kl_is_each_tokens_advantage(model, tmp_path):
    """On-policy distillation as RL: the reference is a teacher (another model), and each
    completion token's advantage is coef x (teacher's log-prob - the policy's)."""
    torch.manual_seed(1)
    teacher = build_model(llama3.spec("llama3_tiny"))
    source = make_source(model, tmp_path)
    source.logprobs = PolicyLogprobs(model, FrozenPolicy(teacher), CTX, source.settings)
    source.advantages = TeacherReverseKL(coef=0.5)
    (batch,) = source.next_step()
    rows = group_batch(FixedGroups()(0).groups, pad_id=0)
    with torch.no_grad():
        gap = completion_logprobs(teacher, rows) - completion_logprobs(model, rows)
    mask = rows["labels"] != -100
    torch.testing.assert_close(batch["advantages"], 0.5 * gap * mask, rtol=0, atol=1e-6)
    kl = -(gap * mask).sum() / mask.sum()
    assert source.step_metrics()["teacher_reverse_kl"] == pytest.approx(kl.item(), abs=1e-6)
    assert abs(kl.item()) > 0.01  # two models: a real gap (k1 is >= 0 only on the policy's samples)
    with pytest.raises(ValueError, match="set reference_model to the teacher's folder"):
        TeacherReverseKL()({"labels": rows["labels"], "old_logprobs": gap})
    with pytest.raises(ValueError, match="coef must be > 0"):
        TeacherReverseKL(coef=0.0)


def test_the_parity_check_stops_a_collection_whose_sampler_disagrees(model, tmp_path):
    source = make_source(model, tmp_path, max_logprob_mismatch=1e-3)  # sampled at -1.0 each
    with pytest.raises(LogprobMismatchError, match="max_logprob_mismatch=0.001"):
        source.next_step()
    check = PolicyLogprobs(model, None, CTX, RolloutSettings(group_size=1)).check
    check({"logprob_mismatch_max": 9.0, "logprob_mismatch_mean": 1.0})  # no limit: no stop


def test_an_advantages_stage_with_a_kl_needs_the_references_logprobs():
    stage = GAEAdvantages(nn.Identity(), CTX, RolloutSettings(group_size=1), kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs a reference policy"):
        stage({"labels": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="lam must be in"):
        GAEAdvantages(nn.Identity(), CTX, RolloutSettings(group_size=1), lam=2.0)


def test_the_default_sample_stage_needs_rewards_or_an_environment(model, tmp_path):
    with pytest.raises(ValueError, match="rewards=, environment= or both score the groups"):
        RolloutSource(
            model=model,
            tokenizer=TOKENIZER,
            prompts=None,
            ctx=CTX,
            settings=RolloutSettings(group_size=1),
            advantages=GroupAdvantages(LeaveOneOut(), 1),
        )


def test_rollouts_stop_where_generate_stops(tmp_path):
    """An instruct model ends its turn with an end-of-turn token that is not its eos (Qwen's
    ``<|im_end|>`` next to ``<|endoftext|>``): rollouts stop there as ``generate`` and ``chat``
    do, and at the config's own ``stop_tokens``, not only at eos."""
    from tests.data.tokenizer_factory import make_tokenizer_folder
    from tunesmith.data import Tokenizer

    folder = make_tokenizer_folder(
        tmp_path / "tok", "qwen2_5", generation_config=False, eos_token="<|endoftext|>"
    )  # a base model's folder: eos is <|endoftext|>, the chat template ends turns with <|im_end|>
    tokenizer = Tokenizer.from_pretrained(folder)
    end_of_turn, eos = tokenizer.token_to_id("<|im_end|>"), tokenizer.eos_id
    assert eos == tokenizer.token_to_id("<|endoftext|>") and end_of_turn not in (None, eos)
    assert stop_token_ids(tokenizer, []) == sorted({eos, end_of_turn})
    assert stop_token_ids(tokenizer, ["<|im_start|>"]) == sorted(
        {eos, end_of_turn, tokenizer.token_to_id("<|im_start|>")}
    )
    with pytest.raises(ValueError, match="generation.stop_tokens: '<nope>'"):
        stop_token_ids(tokenizer, ["<nope>"])
