"""An interpolation that cannot be resolved is named by its key wherever a check reads it: a
Ray runtime environment (``rollout.runtime_env: ${oc.env:UNSET}``), read by the config rule
and again where the workers start, and a value a top-level rule looks inside (a list item of
``metric_loggers``), whose check used to raise the bare resolver error: reported at that
value's own key, once. End to end through
``validate`` and ``run``: ``tests/faults`` (kind ``config-route``)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tunesmith.config import ConfigError
from tunesmith.recipes import check_config, recipe_path
from tunesmith.rl.asynchronous.pipeline import check_runtime_env, section_runtime_env_problem
from tunesmith.training.rules import Rule, check_rules
from tunesmith.training.settings import LOOP_RULES

UNSET = "TUNESMITH_TEST_UNSET"


@pytest.fixture(autouse=True)
def _unset(monkeypatch) -> None:
    monkeypatch.delenv(UNSET, raising=False)


def test_the_runtime_env_that_does_not_resolve_is_named() -> None:
    section = OmegaConf.create({"workers": 1, "runtime_env": f"${{oc.env:{UNSET}}}"})
    problem = section_runtime_env_problem(section)
    assert problem is not None
    assert problem.startswith(
        f"runtime_env: interpolation '${{oc.env:{UNSET}}}' cannot be resolved"
    )
    with pytest.raises(ValueError, match=r"^reward_workers\.runtime_env: interpolation "):
        check_runtime_env(section, "reward_workers")


def test_a_missing_or_absent_runtime_env() -> None:
    assert section_runtime_env_problem(OmegaConf.create({"workers": 1})) is None
    assert section_runtime_env_problem({"runtime_env": None}) is None
    missing = section_runtime_env_problem(OmegaConf.create({"runtime_env": "???"}))
    assert (
        missing == "runtime_env: value is missing (???); set it in the config or with an override"
    )


def test_a_rule_looking_inside_a_value_names_the_value() -> None:
    cfg = OmegaConf.create(
        {"metric_loggers": [{"_component_": "torch.nn.Identity"}, f"${{oc.env:{UNSET}}}"]}
    )
    (issue,) = check_rules(cfg, {"metric_loggers": LOOP_RULES["metric_loggers"]})
    assert issue.path == "metric_loggers.1"
    assert issue.message.startswith(f"interpolation '${{oc.env:{UNSET}}}' cannot be resolved: ")


def test_a_rule_meets_a_cycle_once() -> None:
    """A value that refers to a section that refers back to it is walked once (no endless
    walk), and the value that does not resolve is still found."""
    cfg = OmegaConf.create(
        {
            "metric_loggers": {"other": "${other}", "bad": f"${{oc.env:{UNSET}}}"},
            "other": {"back": "${metric_loggers}"},
        }
    )
    rule = LOOP_RULES["metric_loggers"]
    broken = Rule(rule.allowed, lambda v: bool(list(v.values())))  # reads every value
    (issue,) = check_rules(cfg, {"metric_loggers": broken})
    assert issue.path == "metric_loggers.bad", issue


def test_the_config_check_names_the_value_once() -> None:
    """The whole check (what ``validate`` and ``run`` share): the key of the very value first,
    and no second line for the section that holds it."""
    cfg = OmegaConf.create(
        {
            "rollout": {"workers": 1, "runtime_env": f"${{oc.env:{UNSET}}}"},
            "metric_loggers": [f"${{oc.env:{UNSET}}}"],
        }
    )
    with pytest.raises(ConfigError) as raised:
        check_config(cfg, recipe_path("grpo_async"))
    paths = [issue.path for issue in raised.value.issues]
    assert len(paths) == len(set(paths)), paths
    assert "rollout.runtime_env" in paths and "metric_loggers.0" in paths, paths
    assert "rollout" not in paths and "metric_loggers" not in paths, paths
