"""PPO: a value model beside the policy.

* :mod:`~tunesmith.rl.ppo.critic`: the critic (built from the policy or a reward model), its
  values and its objective;
* :mod:`~tunesmith.rl.ppo.trainer`: per-token rewards, GAE advantages, the rollout source and
  the two-model trainer.
"""
