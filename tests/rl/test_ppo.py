"""PPO with a learned critic on the tiny RL world: the batch stage's values, KL-folded token
rewards and GAE advantages/returns against a per-row reference computed here; a run in which the
policy and the critic both learn and checkpoint side by side, the critic warm-up leaving the
policy untouched; stopped and resumed (inside the warm-up, and mid-batch) == uninterrupted,
bitwise; resumes refused when the critic's checkpoint is missing or at another step; a critic
from a model folder (``critic_model``); two FSDP2 ranks == one process.

Why two ranks see the same rollouts as one process: the prompt stream hands rank r the r-th
half of each step's prompts, and keyed sampling makes each completion depend only on the seed,
the collection round, the prompt and its sample number."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    _any_component_allowed,
    assert_same_weights,
    checkpoint_weights,
    largest_change,
    launch_ranks,
    make_model_dir,
    run_config,
)
from tests.rl.rl_world import DIGIT_REWARD, DigitFraction, make_prompts
from tunesmith.config import load_config
from tunesmith.data import Tokenizer
from tunesmith.models import from_hf
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.peft import apply_lora
from tunesmith.recipes import config_path
from tunesmith.rl.ppo.critic import critic_from_policy
from tunesmith.rl.ppo.trainer import GAEAdvantages, offload_reward_models, token_rewards
from tunesmith.rl.prompts import PromptDataset, PromptStream
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.rollout import completion_logprobs
from tunesmith.rl.source import GenerationConfig, RolloutSettings, RolloutSource
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.setup import FrozenPolicy

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
SMALL = ["generation.max_new_tokens=6", "prompts_per_step=4", "batch_size=2", "kl_coef=0.1",
         "optimizer.lr=1e-3"]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    prompts = make_prompts(root / "prompts.jsonl", rows=24)
    return {"model_dir": make_model_dir(root), "prompts": prompts, "root": root}


def test_token_rewards_put_the_reward_on_the_last_token_and_the_kl_on_every_one():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    kl = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    rewards = torch.tensor([1.0, -2.0, 7.0])
    expected = torch.tensor(
        [[0.0, -0.5, -1.0, -1.5 + 1.0, 0.0], [-2.5, -3.0 - 2.0, 0.0, 0.0, 0.0], [0.0] * 5]
    )
    torch.testing.assert_close(token_rewards(rewards, mask, kl, kl_coef=0.5), expected)
    no_kl = torch.tensor([[0.0, 0, 0, 1, 0], [0, -2, 0, 0, 0], [0] * 5])
    torch.testing.assert_close(token_rewards(rewards, mask), no_kl)


def _reference_gae(rewards, values, gamma, lam):
    """GAE on one row's completion tokens, as plain floats (the episode ends after them)."""
    advantages, next_value, next_advantage = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = advantages[t] = delta + gamma * lam * next_advantage
        next_value = values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_batch_values_rewards_and_gae_match_a_reference_computed_from_the_rollout(world):
    torch.manual_seed(0)
    tokenizer = Tokenizer.from_pretrained(world["model_dir"])
    policy = from_hf(world["model_dir"], dtype="float32")
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # a reference that differs: the KL term is not zero
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    critic = critic_from_policy(policy, pad_token_id=tokenizer.pad_id)
    prompts = PromptDataset(str(world["prompts"]), prompt_column="prompt")
    kl_coef, gamma, lam = 0.5, 0.9, 0.8
    settings = RolloutSettings(
        group_size=2, generation=GenerationConfig(max_new_tokens=6), micro_batch_size=8
    )
    source = RolloutSource(
        model=policy,
        tokenizer=tokenizer,
        prompts=PromptStream(prompts, 4),
        rewards=RewardSet([DigitFraction()]),
        ctx=CTX,
        settings=settings,
        advantages=GAEAdvantages(critic, CTX, settings, gamma=gamma, lam=lam, kl_coef=kl_coef),
        reference=FrozenPolicy(reference),
    )
    (batch,) = source.next_step()
    mask = batch["labels"] != -100
    assert batch["rewards"].unique().numel() > 1 and mask.any(1).all()
    with torch.no_grad():
        values = critic(
            batch["input_ids"], position_ids=batch["position_ids"], every_position=True
        )[..., 0]
        ref_logprobs = completion_logprobs(reference, batch)
    torch.testing.assert_close(batch["old_values"], torch.where(mask, values, 0.0))
    torch.testing.assert_close(batch["ref_logprobs"], ref_logprobs)
    kl = batch["old_logprobs"] - batch["ref_logprobs"]
    assert kl[mask].abs().max() > 1e-3
    raw, returns = torch.zeros_like(values), torch.zeros_like(values)
    for i in range(batch["input_ids"].shape[0]):
        at = mask[i].nonzero().flatten().tolist()
        r = [-kl_coef * float(kl[i, t]) for t in at]
        r[-1] += float(batch["rewards"][i])
        adv, ret = _reference_gae(r, [float(values[i, t]) for t in at], gamma, lam)
        raw[i, at], returns[i, at] = torch.tensor(adv), torch.tensor(ret)
    torch.testing.assert_close(batch["returns"], returns, atol=1e-5, rtol=0)
    flat = raw[mask].double()
    std = math.sqrt(float(((flat - flat.mean()) ** 2).sum()) / (len(flat) - 1))
    whitened = torch.where(mask, (raw - flat.mean()) / std, 0.0).float()
    torch.testing.assert_close(batch["advantages"], whitened, atol=1e-4, rtol=0)
    metrics = source.step_metrics()
    assert metrics["values"] == pytest.approx(float(values[mask].mean()), abs=1e-6)
    assert metrics["advantage_mean"] == pytest.approx(float(raw[mask].mean()), abs=1e-6)


def test_a_lora_policy_needs_a_critic_model():
    from tunesmith.models import llama3

    policy = apply_lora(llama3.llama3_tiny(), target_modules=["q_proj"], rank=2, alpha=4)
    with pytest.raises(ValueError, match="set critic_model"):
        critic_from_policy(policy, pad_token_id=0)


# -- runs of the recipe


def _overrides(world, out: Path, *extra: str) -> list[str]:
    """The tiny PPO config on this world, scored by the dense test reward."""
    return [
        f"model_dir={world['model_dir']}", f"prompts.source={world['prompts']}",
        f"output_dir={out}", f"rewards.rewards={{digits: {{_component_: {DIGIT_REWARD}}}}}",
        "progress_bar=false", *SMALL, *extra,
    ]  # fmt: skip


def _run(world, out: Path, *extra: str, **nodes: dict) -> Path:
    """Run the tiny PPO config in this process; ``nodes`` replace whole config nodes."""
    cfg = load_config(config_path("tiny", "ppo"), _overrides(world, out, *extra))
    for key, node in nodes.items():
        cfg[key] = OmegaConf.create(node)
    with _any_component_allowed():  # the test reward lives in tests/
        run_config("ppo", cfg)
    return out


def _records(out: Path) -> dict[int, dict]:
    """The training records by step (every step logs the critic's loss)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "critic/loss" in r}


def _step(out: Path, step: int, critic: bool = False) -> Path:
    return out / ("critic/checkpoints" if critic else "checkpoints") / f"step_{step:06d}"


RESUMED = ["max_steps=4", "updates_per_batch=2", "critic_warmup_steps=1", "keep_last=null"]


@pytest.fixture(scope="module")
def uninterrupted(world):
    return _run(world, world["root"] / "whole", *RESUMED, "save_every_n_steps=1")


def test_policy_and_critic_learn_and_checkpoint_side_by_side(world, uninterrupted):
    initial = checkpoint_weights(world["model_dir"])
    body = {k: v for k, v in initial.items() if k.startswith("model.")}
    logged = _records(uninterrupted)
    assert sorted(logged) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert _step(uninterrupted, step).is_dir() and _step(uninterrupted, step, True).is_dir()
        assert ("explained_variance" in logged[step]) == (step % 2 == 1)  # a new batch
    assert logged[1]["reward_std"] > 0.01  # the dense reward: every batch has a signal
    # steps 1-2 (one batch of rollouts, two updates) train only the critic
    assert logged[1]["critic_warmup"] == logged[2]["critic_warmup"] == 1.0
    assert "loss" not in logged[2] and "loss" in logged[3] and "critic_warmup" not in logged[3]
    for step in (1, 2):
        assert_same_weights(checkpoint_weights(_step(uninterrupted, step)), initial, 0.0)
    assert largest_change(checkpoint_weights(_step(uninterrupted, 4)), initial) > 1e-3
    critic = checkpoint_weights(_step(uninterrupted, 4, critic=True))
    assert sorted(critic) == sorted([*body, "score.weight"])
    assert critic["score.weight"].shape[0] == 1
    assert largest_change(critic, body) > 1e-3
    assert largest_change(critic, checkpoint_weights(_step(uninterrupted, 2, critic=True))) > 1e-4
    config = json.loads((_step(uninterrupted, 4, critic=True) / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")


def test_stopped_and_resumed_equals_uninterrupted(world, uninterrupted, tmp_path):
    out = tmp_path / "resumed"
    _run(world, out, *RESUMED, "stop_after_steps=1")  # inside the warm-up, mid-batch
    _run(world, out, *RESUMED, "stop_after_steps=3", "resume=true")  # mid-batch
    _run(world, out, *RESUMED, "resume=true")
    for critic in (False, True):  # bitwise
        got, expected = checkpoint_weights(_step(out, 4, critic)), checkpoint_weights(
            _step(uninterrupted, 4, critic))  # fmt: skip
        assert_same_weights(got, expected, 0.0)
    got, expected = _records(out), _records(uninterrupted)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        keys = (
            ("reward", "reward/digits", "values", "returns", "advantage_mean") if step % 2 else ()
        )
        for key in ("critic/loss", "critic/values", "lr", "critic/lr", "loss", *keys):
            assert got[step].get(key) == expected[step].get(key), (step, key)


def test_a_resume_without_the_critic_of_that_step_is_refused(world, uninterrupted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(_step(out, 4, critic=True))
    with pytest.raises(FileNotFoundError, match=r"critic/checkpoints/step_000004 is missing"):
        _run(world, out, *RESUMED, "resume=true")
    shutil.rmtree(_step(out, 3, critic=True))  # the critic of step 3 is step 2's, renamed
    shutil.copytree(_step(out, 2, critic=True), _step(out, 3, critic=True))
    with pytest.raises(CheckpointError, match="policy resumed at step 3 .* critic at step 2"):
        _run(world, out, *RESUMED, f"resume={_step(out, 3)}")


def test_a_critic_from_a_model_folder_with_its_own_optimizer(world, tmp_path):
    # a causal LM folder gives the body (lm_head dropped) and a fresh head; a reward-model
    # folder of the reward_model recipe loads the same way, head included
    folder = {"_component_": "tunesmith.models.reward_model_from_hf",
              "path": str(world["model_dir"])}  # fmt: skip
    out = _run(
        world,
        tmp_path / "rm",
        "max_steps=2",
        critic_model=folder,
        critic_optimizer={"_component_": "torch.optim.SGD", "lr": 0.0},
    )
    critic = checkpoint_weights(_step(out, 2, critic=True))
    body = {k: v for k, v in checkpoint_weights(world["model_dir"]).items() if k in critic}
    assert len(body) == len(critic) - 1  # all but the new score head
    assert_same_weights({k: critic[k] for k in body}, body, 0.0)  # lr 0: its own optimizer
    assert _records(out)[1]["critic/lr"] == 0.0 and _records(out)[1]["lr"] > 0.0


def test_two_fsdp2_ranks_equal_one_process(world, tmp_path):
    steps = ["max_steps=3", "critic_warmup_steps=1"]
    single = _run(world, tmp_path / "one", *steps, "batch_size=4")
    with _any_component_allowed():  # inherited by the ranks
        launch_ranks(
            _overrides(world, tmp_path / "two", *steps), tmp_path, recipe="ppo", timeout=300
        )
    one_logged, two_logged = _records(single), _records(tmp_path / "two")
    assert sorted(one_logged) == sorted(two_logged) == [1, 2, 3]
    for step, one in one_logged.items():
        two = two_logged[step]
        assert two["reward"] == pytest.approx(one["reward"], abs=1e-6), step  # same rollouts
        for key in (
            "critic/loss",
            "values",
            "returns",
            "advantage_mean",
            "explained_variance",
            *(("grad_norm", "entropy") if step > 1 else ()),
        ):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (step, key)
    assert (_step(tmp_path / "two", 3) / "training_state" / "rank1.pt").is_file()
    for critic in (False, True):
        weights = checkpoint_weights(_step(single, 3, critic))
        # 5% of one Adam step of lr 1e-3: Adam magnifies rounding where a gradient is near 0
        assert_same_weights(checkpoint_weights(_step(tmp_path / "two", 3, critic)), weights, 5e-5)
        initial = checkpoint_weights(world["model_dir"])
        assert largest_change(weights, {k: initial[k] for k in weights if k in initial}) > 1e-3


class _ModelReward:
    name = "rm"

    def __init__(self, device: str) -> None:
        self.model, self.device = torch.nn.Linear(2, 1), torch.device(device)

    def __call__(self, samples):
        return [0.0] * len(samples)


def test_reference_offload_wraps_only_the_rewards_that_run_a_model_on_a_gpu():
    rewards = RewardSet(
        {"gpu": _ModelReward("cuda"), "cpu": _ModelReward("cpu"), "digits": DigitFraction()}
    )
    assert offload_reward_models(rewards) == ["gpu"]
    assert (
        rewards.rewards["gpu"].name == "rm" and rewards.rewards["gpu"].reward.device.type == "cuda"
    )
    assert isinstance(rewards.rewards["cpu"], _ModelReward)
