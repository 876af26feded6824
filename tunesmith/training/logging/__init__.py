"""What a run reports: metric loggers, the console line, plots of a finished run.

* :mod:`~tunesmith.training.logging.loggers`: JSONL, stdout, TensorBoard and W&B loggers
  (named in a config as ``tunesmith.training.JSONLLogger`` ...) and the step window;
* :mod:`~tunesmith.training.logging.console`: the one-line console output;
* :mod:`~tunesmith.training.logging.plot`: read a run's metrics and plot them.

(Absolute imports keep ``import logging`` meaning the standard library everywhere.)
"""
