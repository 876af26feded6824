"""tunesmith: PyTorch-native post-training for open-weight LLMs.

``tunesmith.run`` trains a recipe on a config in this process (imported on first use, so
``import tunesmith`` stays light).

Example::

    import tunesmith
    tunesmith.run("sft", "demo", ["max_steps=10", "output_dir=outputs/try"])
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # tunesmith.recipes.run: the one library-level entry point
        from tunesmith.recipes import run

        return run
    raise AttributeError(f"module 'tunesmith' has no attribute {name!r}")
