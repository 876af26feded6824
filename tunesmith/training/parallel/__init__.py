"""The device mesh and the ways a model is split over it (composed by
:func:`tunesmith.training.parallelize.parallelize`, whose docstring explains the order).

* :mod:`~tunesmith.training.parallel.distributed`: the process group, the named mesh
  (:class:`~tunesmith.training.parallel.distributed.ParallelDims`), FSDP2/HSDP sharding and
  the collectives the loop uses;
* :mod:`~tunesmith.training.parallel.tensor_parallel`, with its styles
  (:mod:`~tunesmith.training.parallel.tp_styles`) and the LoRA/DoRA ones
  (:mod:`~tunesmith.training.parallel.tp_adapters`): tensor, sequence and loss parallel;
* :mod:`~tunesmith.training.parallel.context_parallel`: zigzag sequence shards, ring attention;
* :mod:`~tunesmith.training.parallel.expert_parallel`: MoE experts split over ranks.
"""
