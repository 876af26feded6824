"""Reinforcement learning from rewards: prompt sources, rewards, advantages, rollouts.

The pieces a GRPO/PPO recipe composes; each is a small module with one job:

* :mod:`tunesmith.rl.prompts`: prompt datasets (JSONL/Parquet/Hub with an answer column,
  reasoning-gym tasks) and a resumable, data-parallel prompt stream;
* :mod:`tunesmith.rl.rewards`: reward functions as components, combined with weights;
* :mod:`tunesmith.rl.advantages`: GRPO / Dr. GRPO / RLOO / REINFORCE++ advantages and GAE;
* :mod:`tunesmith.rl.rollout` and :mod:`tunesmith.rl.source`: generate, score and batch
  rollouts as a :class:`~tunesmith.training.sources.BatchSource` for the Trainer.

The policy losses (PPO-clip, GSPO, KL estimators, value loss) live with the other losses in
:mod:`tunesmith.modules.losses.rl`.
"""
