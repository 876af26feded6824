"""What a run reports: metric loggers, the console line, plots of a finished run.

* :mod:`~tunesmith.training.logging.loggers`: JSONL, stdout, TensorBoard and W&B loggers
  (named in a config as ``tunesmith.training.JSONLLogger`` ...) and the step window;
* :mod:`~tunesmith.training.logging.console`: the console's step line (which metrics, in which
  format), the end-of-run summary, the parameter count;
* :mod:`~tunesmith.training.logging.quiet`: known third-party notices kept off the console;
* :mod:`~tunesmith.training.logging.plot`: read a run's metrics and plot them.

(Absolute imports keep ``import logging`` meaning the standard library everywhere.)
"""
