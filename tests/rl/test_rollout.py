"""Rollouts as training rows, and the rollout source's contracts: the trainer's log-probs of
the sampled tokens equal the sampler's (every family, fp32), the GRPO objective on a fresh
batch is the plain policy gradient, dynamic sampling keeps only groups with a signal, and
overlong filtering trains nothing of a cut completion."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.sft_world import make_model_dir
from tests.rl.rl_world import DigitFraction, make_prompts
from tunesmith.data import Tokenizer
from tunesmith.generation import generate
from tunesmith.generation.keyed import row_key
from tunesmith.models import build_model, from_hf, llama3, mistral, qwen2_5, qwen3, qwen3_moe
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.modules.losses.rl import PolicyLoss
from tunesmith.rl.advantages import GroupNormalized
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.prompts import PromptDataset, PromptStream
from tunesmith.rl.rewards import RewardSet, Sample
from tunesmith.rl.rollout import completion_logprobs, micro_batches, rollout_batch
from tunesmith.rl.source import GenerationConfig, GroupAdvantages, RolloutSettings, RolloutSource
from tunesmith.training.parallel.distributed import close_distributed, init_distributed


def test_rollout_batch_places_completion_values_at_their_label_positions():
    batch = rollout_batch(
        [[5, 6, 7], [8]],
        [[9, 10], [11, 12, 13]],
        pad_id=0,
        per_token={"lp": [[-1.0, -2.0], [-3.0, -4.0, -5.0]]},
        per_row={"advantages": torch.tensor([0.5, -0.5])},
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # label t is token t + 1 where that token is a completion token
    assert batch["labels"].tolist() == [[-100, -100, 9, 10, -100], [11, 12, 13, -100, -100]]
    assert batch["lp"].tolist() == [[0, 0, -1, -2, 0], [-3, -4, -5, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(5))] * 2
    cut = micro_batches(batch, 1)
    assert [mb["input_ids"].shape[1] for mb in cut] == [5, 4]  # each to its own length
    assert cut[1]["advantages"].tolist() == [-0.5]
    with pytest.raises(ValueError, match="lp of row 0 has 1 values for 2 completion tokens"):
        rollout_batch([[1]], [[2, 3]], 0, per_token={"lp": [[0.0]]})


SPECS = {
    "llama3": llama3.spec("llama3_tiny"), "mistral": mistral.spec("mistral_tiny"),
    "qwen2_5": qwen2_5.spec("qwen2_5_tiny"), "qwen3": qwen3.spec("qwen3_tiny"),
    "qwen3_moe": qwen3_moe.spec("qwen3_moe_tiny"),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(SPECS))
def test_trainer_logprobs_equal_the_samplers_on_every_family(family):
    torch.manual_seed(0)
    model = build_model(SPECS[family]).eval()
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 2, 7)]
    keys = [row_key(0, i) for i in range(len(prompts))]
    out = generate(
        model,
        prompts,
        max_new_tokens=12,
        temperature=0.7,
        top_p=0.95,
        stop_token_ids=[1, 2],
        row_keys=keys,
    )
    batch = rollout_batch(prompts, out.sequences, pad_id=0, per_token={"sampling": out.logprobs})
    with torch.no_grad():
        trainer = completion_logprobs(model, batch, temperature=0.7, chunk_size=5)
    mask = batch["labels"] != IGNORE_INDEX
    assert int(mask.sum()) == out.new_tokens > 0
    assert (trainer - batch["sampling"])[mask].abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def ctx():
    context = init_distributed("cpu")
    yield context
    close_distributed()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    model_dir = make_model_dir(root)
    return Tokenizer.from_pretrained(model_dir), model_dir, make_prompts(root / "p.jsonl", 16)


class EvenAnswersFlat:
    """0.5 for every completion of a prompt whose answer is even (no signal), the length of the
    completion's text otherwise (random tokens: a different length for each completion)."""

    name = "even_flat"

    def __call__(self, samples: list[Sample]) -> list[float]:
        return [0.5 if int(s.answer) % 2 == 0 else len(s.completion) / 100 for s in samples]


def make_source(world, ctx, reward, **kwargs) -> RolloutSource:
    tokenizer, model_dir, prompts = world
    torch.manual_seed(0)
    model = from_hf(model_dir)
    stream = PromptStream(PromptDataset(str(prompts), prompt_column="prompt"), 4, seed=0)
    generation = GenerationConfig(
        max_new_tokens=kwargs.pop("max_new_tokens", 8), stop_strings=kwargs.pop("stop_strings", ())
    )
    settings = RolloutSettings(group_size=4, generation=generation, micro_batch_size=16, **kwargs)
    return RolloutSource(
        model=model,
        tokenizer=tokenizer,
        prompts=stream,
        rewards=RewardSet([reward]),
        ctx=ctx,
        settings=settings,
        advantages=GroupAdvantages(GroupNormalized(), group_size=4),
    )


def test_a_fresh_batch_gives_the_plain_policy_gradient(world, ctx):
    source = make_source(world, ctx, DigitFraction())
    (batch,) = source.next_step()
    model = source.model
    objective = PolicyGradient(PolicyLoss(clip_low=0.2, clip_high=0.28), log_entropy=False)
    out = objective(model, batch)
    (out.loss / objective.units(batch)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the plain REINFORCE-with-baseline gradient: -mean over tokens of A * log pi(token)
    mask = batch["labels"] != IGNORE_INDEX
    logprobs = completion_logprobs(model, batch)
    plain = -(batch["advantages"][:, None] * logprobs)[mask].sum() / mask.sum()
    plain.backward()
    assert batch["advantages"].abs().max() > 0.1
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_dynamic_sampling_keeps_only_groups_with_a_signal(world, ctx):
    source = make_source(world, ctx, EvenAnswersFlat(), dynamic_sampling=True, max_refills=8)
    (batch,) = source.next_step()
    rewards = batch["rewards"].view(-1, 4)
    assert rewards.shape[0] == 4  # the step's quota of groups
    assert (rewards.std(dim=1) > 0).all()  # every kept group has a signal
    metrics = source.step_metrics()
    assert 0 < metrics["zero_variance_groups"] < 1
    assert source.prompts.position > 4  # refills drew more prompts than one step's


def test_dynamic_sampling_falls_back_to_flat_groups_when_refills_run_out(world, ctx):
    source = make_source(world, ctx, EvenAnswersFlat(), dynamic_sampling=True, max_refills=0)
    (batch,) = source.next_step()
    assert batch["rewards"].numel() == 16  # the batch is full whatever the refills found


def test_overlong_filter_trains_nothing_of_a_cut_completion(world, ctx):
    source = make_source(
        world, ctx, DigitFraction(), overlong_filter=True, max_new_tokens=4, stop_strings=["e"]
    )
    (batch,) = source.next_step()
    trained = (batch["labels"] != IGNORE_INDEX).sum(dim=1)
    stopped = batch["stopped"].bool()
    assert stopped.any() and not stopped.all()  # both kinds in the batch
    assert (trained[~stopped] == 0).all()  # cut at max_new_tokens: nothing trained
    assert (trained[stopped] >= 1).all()
