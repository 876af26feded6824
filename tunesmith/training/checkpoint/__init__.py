"""Checkpoints and the output folder: what a run leaves on disk and how it comes back.

* :mod:`~tunesmith.training.checkpoint.checkpointer`: save and load a run (Hugging Face
  weights or PEFT adapters, the training state through DCP), written atomically;
* :mod:`~tunesmith.training.checkpoint.directory`: the ``step_N`` folders, the marker that makes
  one complete, retention and the cleaning of a dead writer's temporary folders;
* :mod:`~tunesmith.training.checkpoint.safe_dcp`: DCP loading that refuses foreign objects;
* :mod:`~tunesmith.training.checkpoint.run_lock`: one run per output folder.
"""
