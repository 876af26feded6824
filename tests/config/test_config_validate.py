"""validate_config() and check_keys(): sound configs pass, every problem is found."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tunesmith.config import (
    ConfigError,
    ConfigIssue,
    check_keys,
    instantiate,
    load_config,
    validate_config,
)

HELPERS = "tests.config.configtest_components"
GOOD = Path(__file__).parent / "good_config.yaml"


def issues_of(node: dict, **kwargs) -> dict[str, str]:
    kwargs.setdefault("allow_any_component", True)
    return {i.path: i.message for i in validate_config(OmegaConf.create(node), **kwargs)}


def test_good_config_has_no_issues_and_builds() -> None:
    cfg = load_config(GOOD)
    assert validate_config(cfg, runtime_args={"optimizer": 1}) == []
    model = instantiate(cfg.model)
    loss = instantiate(cfg.loss)
    assert loss.ignore_index == -100
    assert model.weight.shape == (2, 4)


def test_runtime_args_are_declared_by_path() -> None:
    cfg = load_config(GOOD)
    issues = validate_config(cfg)  # the recipe's parameters are not declared
    assert [str(i) for i in issues] == [
        "optimizer.params: missing required argument of torch.optim.AdamW"
    ]


def test_runtime_positional_args_cover_the_first_parameters() -> None:
    node = {"o": {"_component_": f"{HELPERS}.WithParams", "lr": 0.1}}
    assert issues_of(node) == {"o.params": f"missing required argument of {HELPERS}.WithParams"}
    assert issues_of(node, runtime_args={"o": 1}) == {}
    assert issues_of(node, runtime_args={"o": 3}) == {
        "o": f"{HELPERS}.WithParams takes 2 positional argument(s) but the recipe passes 3 at "
        "runtime",
        "o.lr": f"the recipe passes this argument of {HELPERS}.WithParams at runtime; remove "
        "it from the config",
    }


def test_runtime_kwargs_count_as_present() -> None:
    node = {"b": {"_component_": f"{HELPERS}.Block"}}
    assert list(issues_of(node)) == ["b.dim"]
    assert issues_of(node, runtime_kwargs={"b": ["dim"]}) == {}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"lr": 1}, {}),  # an int is a fine float
        ({"lr": 0.1, "warmup": None}, {}),  # Optional[int]
        ({"lr": 0.1, "warmup": 5, "nesterov": True, "name": "x"}, {}),
        ({"lr": "fast"}, {"o.lr": "expected float, got str 'fast'"}),
        ({"lr": True}, {"o.lr": "expected float, got bool True"}),
        ({"lr": [0.1]}, {"o.lr": "expected float, got list"}),
        ({"lr": {"a": 1}}, {"o.lr": "expected float, got mapping"}),
        ({"lr": 0.1, "warmup": 0.5}, {"o.warmup": "expected int or None, got float 0.5"}),
        ({"lr": 0.1, "nesterov": "yes please"}, {"o.nesterov": "expected bool, got str"}),
        ({"lr": 0.1, "name": 3}, {"o.name": "expected str, got int 3"}),
        ({"lr": None}, {"o.lr": "expected float, got NoneType None"}),
    ],
)
def test_simple_type_checks(args: dict, expected: dict[str, str]) -> None:
    issues = issues_of({"o": {"_component_": f"{HELPERS}.Optim", **args}})
    assert set(issues) == set(expected)
    for path, start in expected.items():
        assert issues[path].startswith(start), issues[path]
        assert issues[path].endswith(f"(argument of {HELPERS}.Optim)")


def test_type_check_sees_through_interpolation_and_skips_components() -> None:
    node = {
        "base": "slow",
        "o": {"_component_": f"{HELPERS}.Optim", "lr": "${base}"},
        "b": {"_component_": f"{HELPERS}.Block", "dim": {"_component_": f"{HELPERS}.pair", "a": 1}},
    }
    assert issues_of(node) == {
        "o.lr": f"expected float, got str 'slow' (argument of {HELPERS}.Optim)"
    }


def test_unevaluable_annotations_fall_back_to_their_text() -> None:
    node = {"f": {"_component_": f"{HELPERS}.text_annotations", "count": "three", "thing": 1}}
    assert issues_of(node) == {
        "f.count": f"expected int, got str 'three' (argument of {HELPERS}.text_annotations)"
    }


def test_var_kwargs_accept_any_key_but_still_need_required() -> None:
    node = {"f": {"_component_": f"{HELPERS}.open_kwargs", "anything": 1, "else": [2]}}
    assert issues_of(node) == {"f.x": f"missing required argument of {HELPERS}.open_kwargs"}


def test_tensor_members_of_unions_are_ignored() -> None:
    # torch.optim.AdamW's lr is annotated `float | Tensor`: a YAML value is never a Tensor.
    node = {"o": {"_component_": "torch.optim.AdamW", "lr": "abc", "foreach": "no"}}
    issues = issues_of(node, runtime_args={"o": 1}, allow_any_component=None)
    assert issues == {
        "o.lr": "expected float, got str 'abc' (argument of torch.optim.AdamW)",
        "o.foreach": "expected bool or None, got str 'no' (argument of torch.optim.AdamW)",
    }


def test_helper_components_need_allow_any(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNESMITH_ALLOW_ANY_COMPONENT", raising=False)
    node = {"o": {"_component_": f"{HELPERS}.Optim", "lrr": 1}}
    refused = issues_of(node, allow_any_component=None)
    assert list(refused) == ["o._component_"]  # not imported, so its keys are not checked
    assert "not allowed" in refused["o._component_"]
    allowed = issues_of(node)
    assert allowed["o.lrr"] == f"unknown argument of {HELPERS}.Optim; did you mean 'lr'?"
    assert allowed["o.lr"] == f"missing required argument of {HELPERS}.Optim"


def test_not_callable_component() -> None:
    issues = issues_of({"x": {"_component_": f"{HELPERS}.NOT_CALLABLE"}})
    assert issues == {
        "x._component_": f"component '{HELPERS}.NOT_CALLABLE' is a int, not a callable"
    }


def test_problems_inside_plain_containers_are_found() -> None:
    node = {
        "data": {"sources": [{"path": "a"}, {"path": "${nowhere}"}]},
        "deep": {"list": [[{"_component_": f"{HELPERS}.Block", "dim": "x"}]]},
    }
    issues = issues_of(node)
    assert list(issues) == ["data.sources.1.path", "deep.list.0.0.dim"]
    assert issues["data.sources.1.path"].startswith("interpolation '${nowhere}' cannot be resolved")


def test_interpolated_component_is_checked_once_where_defined() -> None:
    node = {
        "a": {"_component_": f"{HELPERS}.Block", "dimm": 1},
        "b": "${a}",
        "c": {"_component_": f"{HELPERS}.Net", "head": "${a}"},
    }
    assert sorted(issues_of(node)) == ["a.dim", "a.dimm"]


def test_check_keys_reports_unknown_and_missing() -> None:
    cfg = OmegaConf.create({"epochs": 1, "bach_size": 8, "zzz": 0, "model": {}})
    issues = check_keys(cfg, ["epochs", "batch_size", "model", "seed"], required=["seed", "model"])
    assert [str(i) for i in issues] == [
        "bach_size: unknown key; did you mean 'batch_size'?",
        "zzz: unknown key; allowed keys: batch_size, epochs, model, seed",
        "seed: required key is missing",
    ]
    nested = check_keys(cfg.model, ["dim"], path="model", required=["dim"])
    assert nested == [ConfigIssue("model.dim", "required key is missing")]
    assert check_keys({"a": 1}, ["a"]) == []


def test_issues_become_one_error() -> None:
    issues = validate_config(OmegaConf.create({"a": "${b}", "c": "???"}))
    error = ConfigError.from_issues(issues)
    assert str(error).splitlines() == [
        "a: interpolation '${b}' cannot be resolved: Interpolation key 'b' not found",
        "c: value is missing (???); set it in the config or with an override",
    ]
