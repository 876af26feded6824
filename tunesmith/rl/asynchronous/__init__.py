"""Asynchronous GRPO on Ray: rollouts generated while the trainer trains.

* :mod:`~tunesmith.rl.asynchronous.workers`: rollout and reward workers (Ray actors);
* :mod:`~tunesmith.rl.asynchronous.replay`: the replay buffer, groups tagged with the policy
  version that sampled them;
* :mod:`~tunesmith.rl.asynchronous.pipeline`: Ray, the modes (sync, overlap, off-policy) and
  worker faults;
* :mod:`~tunesmith.rl.asynchronous.weight_sync`: new weights to the workers (object store or a
  collective);
* :mod:`~tunesmith.rl.asynchronous.source`: the trainer's batch source over the pipeline;
* :mod:`~tunesmith.rl.asynchronous.trainer_group`: trainer ranks as Ray actors.
"""
