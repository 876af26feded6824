"""The recipes: one file per method (``sft``, ``dpo``, ``kto``, ``kd``, ``gkd``,
``reward_model``, ``grpo``, ``grpo_async``, ``online_dpo``, ``ppo``), each reading like its
paper's algorithm box, with its configs in
``configs/<name>/``. The catalogue that finds, checks and runs them is
:mod:`tunesmith.recipes.catalog`; its public names are re-exported here (``tunesmith.run`` is
:func:`~tunesmith.recipes.catalog.run`).

Example::

    >>> from tunesmith.recipes import recipe_names
    >>> recipe_names()[:2]
    ['dpo', 'gkd']
"""

from tunesmith.recipes.catalog import *  # noqa: F403  (the names of its __all__)
from tunesmith.recipes.catalog import __all__  # noqa: F401
