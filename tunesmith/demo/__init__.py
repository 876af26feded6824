"""``tunesmith demo``: a generated task, a tiny local model, SFT, and accuracy before/after.

Modules: :mod:`~tunesmith.demo.task` (the task's data and scorer), :mod:`~tunesmith.demo.assets`
(tokenizer and base model, built locally) and :mod:`~tunesmith.demo.run` (the orchestration);
:mod:`~tunesmith.demo.rl` is ``tunesmith demo rl`` (SFT on a few demonstrations, then GRPO);
:mod:`~tunesmith.demo.agent` is ``tunesmith demo agent`` (SFT on tool-use traces, then GRPO
with a calculator tool and, as the control, without it).
The demo sits at the top of the layers, beside the CLI (which imports it, never the other
way round): it trains through :func:`tunesmith.run`, as ``tunesmith run`` does.

Example::

    from tunesmith.demo import run_demo
    result = run_demo("outputs/demo", threads=1)
"""

from tunesmith.demo.agent import AgentDemoResult, AgentDemoSettings, run_agent_demo
from tunesmith.demo.assets import AssetSettings, DemoAssets, make_assets
from tunesmith.demo.rl import RLDemoResult, RLDemoSettings, run_rl_demo
from tunesmith.demo.run import DemoResult, evaluate, run_demo
from tunesmith.demo.task import Example, accuracy, make_splits, score

__all__ = [
    "AgentDemoResult",
    "AgentDemoSettings",
    "AssetSettings",
    "DemoAssets",
    "DemoResult",
    "Example",
    "RLDemoResult",
    "RLDemoSettings",
    "accuracy",
    "evaluate",
    "make_assets",
    "make_splits",
    "run_agent_demo",
    "run_demo",
    "run_rl_demo",
    "score",
]
