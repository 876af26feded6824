"""Memory and speed: what a step costs and the switches that make it cheaper.

* :mod:`~tunesmith.training.memory.usage`: peak memory and tensor storage, measured;
* :mod:`~tunesmith.training.memory.planner` and :mod:`~tunesmith.training.memory.preflight`:
  the memory a configuration will need, estimated before the first step and checked on it;
* :mod:`~tunesmith.training.memory.activations`: activation checkpointing and offloading;
* :mod:`~tunesmith.training.memory.optim_in_backward`: the optimizer step in backward;
* :mod:`~tunesmith.training.memory.compile`: ``torch.compile`` of blocks and the loss.
"""
