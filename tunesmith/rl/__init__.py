"""Reinforcement learning from rewards: prompt sources, rewards, advantages, rollouts.

The pieces the ``grpo``, ``grpo_async`` and ``ppo`` recipes compose; each is a small module with one
job:

* :mod:`tunesmith.rl.prompts`: prompt datasets (JSONL/Parquet/Hub with an answer column,
  reasoning-gym tasks) and a resumable, data-parallel prompt stream;
* :mod:`tunesmith.rl.rewards`: reward functions as components, combined with weights;
* :mod:`tunesmith.rl.advantages`: GRPO / Dr. GRPO / RLOO / REINFORCE++ advantages and GAE;
* :mod:`tunesmith.rl.rollout` and :mod:`tunesmith.rl.source`: generate, score and batch
  rollouts as a :class:`~tunesmith.training.sources.BatchSource` for the Trainer;
* :mod:`tunesmith.rl.objective`: the policy-gradient objective (PPO-clip / GSPO + KL);
* :mod:`tunesmith.rl.ppo.critic` and :mod:`tunesmith.rl.ppo.trainer`: PPO's value model, GAE stage
  and two-model trainer;
* :mod:`tunesmith.rl.groups`: a prompt's group of completions, sampled and scored;
* asynchronous GRPO: :mod:`tunesmith.rl.asynchronous.workers` (rollout and reward workers),
  :mod:`tunesmith.rl.asynchronous.replay` (the replay buffer with policy versions),
  :mod:`tunesmith.rl.asynchronous.pipeline` (Ray, the modes, faults) and
  :mod:`tunesmith.rl.asynchronous.source` (the trainer's batch source and weight sync);
* :mod:`tunesmith.rl.evaluate`: held-out rewards of greedy answers;
* :mod:`tunesmith.rl.setup`: the config keys and set-up the RL recipes share.

The policy losses (PPO-clip, GSPO, KL estimators, value loss) live with the other losses in
:mod:`tunesmith.modules.losses.rl`. See ``docs/rl.md``.
"""
