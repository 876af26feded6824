"""PPO's critic: a value model, its objective, and where its checkpoints live.

The critic is a :class:`~tunesmith.models.reward.RewardModel` (a decoder body and a one-output
``score`` head) read at every position instead of the last: :func:`critic_values` gives one
value per label position of a rollout batch, ``values[i, t]`` estimating the return after the
prefix that ends at token ``t`` (the state in which completion token ``t + 1`` is sampled), so
values line up with the labels like the other per-token tensors of
:mod:`tunesmith.rl.rollout`. It is built either as a copy of the policy's body with a fresh
head (:func:`critic_from_policy`) or from ``critic_model`` (e.g. a reward-model folder written
by the ``reward_model`` recipe, through :func:`~tunesmith.models.reward.reward_model_from_hf`):
:func:`build_critic`. It trains with its own optimizer and LR schedule on
:class:`ValueObjective`, and checkpoints as a HF ``*ForSequenceClassification`` folder under
``<output_dir>/critic/checkpoints/step_N`` next to the policy's ``<output_dir>/checkpoints/
step_N`` (:func:`critic_checkpoint`, :func:`critic_config`).

Example::

    critic = build_critic(cfg, ctx, policy, tokenizer)
    values, _ = critic_values(critic, batch)  # [b, L] float32
    trainer = Trainer.from_config(critic_config(cfg), ctx, model=critic,
                                  objective=ValueObjective(ValueLoss(clip=0.2)))
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from tunesmith.config import instantiate
from tunesmith.models.reward import RewardModel
from tunesmith.modules.losses.rl import ValueLoss, aggregate
from tunesmith.modules.peft import adapter_modules
from tunesmith.rl.rollout import completion_mask
from tunesmith.training.forward import forward_batch, router_aux_loss
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.setup import apply_attention_backend, check_vocab
from tunesmith.training.trainer import LossOutput

__all__ = [
    "CRITIC_DIR",
    "ValueObjective",
    "build_critic",
    "critic_checkpoint",
    "critic_config",
    "critic_from_policy",
    "critic_values",
]

CRITIC_DIR = "critic"
"""The critic's folder inside ``output_dir`` (its checkpoints in ``critic/checkpoints``)."""


def critic_from_policy(policy: nn.Module, pad_token_id: int) -> RewardModel:
    """A critic whose body is a copy of ``policy``'s body as it is now (call it before the
    policy is sharded) and whose one-output ``score`` head is freshly drawn
    (:meth:`~tunesmith.models.reward.RewardModel.init_score`, seeded by ``torch.manual_seed``);
    ``pad_token_id`` goes into its spec (a saved reward-model folder needs one). A LoRA/DoRA
    policy is refused: set ``critic_model`` instead.

    Example::

        >>> from tunesmith.models import llama3
        >>> critic = critic_from_policy(llama3.llama3_tiny(), pad_token_id=0)
        >>> critic.score.weight.shape[0], critic.spec.pad_token_id
        (1, 0)
    """
    if adapter_modules(policy):
        raise ValueError(
            "critic_model: null copies the policy's body, but the policy has LoRA/DoRA adapters "
            "(a critic checkpoint would keep only them): set critic_model, e.g. "
            "{_component_: tunesmith.models.reward_model_from_hf, path: <the base model folder>}"
        )
    if getattr(policy.spec, "backend", "native") == "transformers":
        raise ValueError(
            f"critic_model: null copies the policy's body, but the policy "
            f"({policy.spec.model_type}) runs on the transformers backend, which has no critic "
            "head: set critic_model to a reward model of a native family with the same tokenizer"
        )
    spec = policy.spec.replace(pad_token_id=pad_token_id)
    body = copy.deepcopy(policy.model)
    body.requires_grad_(True)
    return RewardModel(body, num_labels=1, initializer_range=spec.initializer_range, spec=spec)


def build_critic(
    cfg: DictConfig,
    ctx: DistributedContext,
    policy: nn.Module,
    tokenizer: Any,
    log: Callable[..., None] = print,
) -> RewardModel:
    """The critic of ``cfg``, on ``ctx.device``, not yet sharded: ``cfg.critic_model`` (a
    one-output reward model, checked against ``tokenizer``), else :func:`critic_from_policy`.
    Its spec gets the tokenizer's pad id when it has none.

    Example::

        critic = parallelize(build_critic(cfg, ctx, policy, tokenizer), ctx, cfg)
    """
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if cfg.get("critic_model"):
        critic = instantiate(cfg.critic_model)
        if not isinstance(critic, RewardModel) or critic.num_labels != 1:
            raise ValueError(
                f"critic_model ({cfg.critic_model._component_}) must build a RewardModel with "
                f"one output (e.g. tunesmith.models.reward_model_from_hf), got "
                f"{type(critic).__name__} with {getattr(critic, 'num_labels', '?')} output(s)"
            )
        check_vocab(tokenizer, critic, cfg, key="critic_model")
        apply_attention_backend(critic, cfg.get("attention_backend"))
        if critic.spec.pad_token_id is None:
            critic.spec = critic.spec.replace(pad_token_id=pad)
        log(f"critic: {cfg.critic_model.get('path', cfg.critic_model._component_)}")
    else:
        critic = critic_from_policy(policy, pad)
        log("critic: a copy of the policy's body with a new value head")
    return critic.to(ctx.device)


def critic_values(
    critic: nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``[b, L]`` float32 values of every position of a rollout ``batch`` (aligned with its
    labels; mask them with :func:`~tunesmith.rl.rollout.completion_mask`), and the MoE router
    logits (empty for a dense body). Gradients flow unless called under ``torch.no_grad``.

    Example::

        values, _ = critic_values(critic, batch)
    """
    scores, router_logits = forward_batch(critic, batch, every_position=True)
    return scores[..., 0], router_logits


_UNITS = {"token_mean": "completion_tokens", "constant": "loss_normaliser"}


class ValueObjective:
    """PPO's critic objective for the :class:`~tunesmith.training.trainer.Trainer`: the
    summed clipped value loss (:class:`~tunesmith.modules.losses.rl.ValueLoss`) of the
    critic's values against the batch's ``returns``, clipped around its ``old_values`` (the
    values at collection time), on the completion tokens; plus the MoE load-balancing loss.

    Logged (means over the loss's unit): ``value_clip_fraction``, ``values`` and ``returns``.

    Example::

        >>> objective = ValueObjective(ValueLoss(clip=0.2))
        >>> objective.unit
        'completion_tokens'
    """

    def __init__(self, loss: ValueLoss) -> None:
        self.loss = loss
        self.unit = _UNITS.get(loss.aggregation, "sequences")

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        return self.loss.units(completion_mask(batch))

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        mask = completion_mask(batch)
        values, router_logits = critic_values(model, batch)
        out = self.loss(values, batch["old_values"], batch["returns"], mask)
        mode, max_tokens = self.loss.aggregation, self.loss.max_tokens
        metrics = {
            **out.metrics,
            "values": aggregate(values.detach(), mask, mode, max_tokens),
            "returns": aggregate(batch["returns"].float(), mask, mode, max_tokens),
        }
        return LossOutput(out.loss, metrics, aux_loss=router_aux_loss(model, router_logits, batch))


def critic_checkpoint(policy_checkpoint: str | Path) -> Path:
    """The critic's checkpoint that goes with the policy checkpoint
    ``<output_dir>/checkpoints/step_N``: ``<output_dir>/critic/checkpoints/step_N``.

    Example::

        >>> critic_checkpoint("out/checkpoints/step_000004").as_posix()
        'out/critic/checkpoints/step_000004'
    """
    path = Path(policy_checkpoint)
    return path.parent.parent / CRITIC_DIR / path.parent.name / path.name


def critic_config(cfg: DictConfig) -> DictConfig:
    """The config of the critic's :class:`~tunesmith.training.trainer.Trainer`: ``cfg`` with
    ``critic_optimizer`` / ``critic_lr_scheduler`` (when set) as its ``optimizer`` /
    ``lr_scheduler`` and ``<output_dir>/critic`` as its ``output_dir``; everything else
    (``max_steps``, ``max_grad_norm``, ``keep_last``, ``mixed_precision``...) as the policy's.

    Example::

        >>> critic_config(OmegaConf.create({"output_dir": "out", "optimizer": {"lr": 1},
        ...                                 "critic_optimizer": {"lr": 2}})).optimizer.lr
        2
    """
    critic = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key in ("optimizer", "lr_scheduler"):
        if cfg.get(f"critic_{key}"):
            critic[key] = critic[f"critic_{key}"]
    critic.output_dir = str(Path(cfg.output_dir) / CRITIC_DIR)
    return critic
