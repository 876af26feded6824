"""The recipes: one file per method (``sft``, ``dpo``, ``kd``, ``reward_model``, ``grpo``,
``grpo_async``, ``ppo``), each reading like its paper's algorithm box, with its configs in
``configs/<name>/``. The catalogue that finds, checks and runs them is
:mod:`tunesmith.recipes.catalog`; its public names are re-exported here (``tunesmith.run`` is
:func:`~tunesmith.recipes.catalog.run`).

Example::

    >>> from tunesmith.recipes import recipe_names
    >>> recipe_names()[:3]
    ['dpo', 'grpo', 'grpo_async']
"""

from tunesmith.recipes.catalog import *  # noqa: F403  (the names of its __all__)
from tunesmith.recipes.catalog import __all__  # noqa: F401
