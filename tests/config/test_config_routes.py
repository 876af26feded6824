"""The config routes to code execution that validate and instantiate judge alike: nodes made by
``${oc.create:{...}}`` (a value, an argument, a list item) are checked under the key that uses
them; the safety keywords must be exactly their safe value (``weights_only: 0`` is not true);
an unbound method reached through a class is refused even with a ``self`` to call it on."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, ConfigError, instantiate, validate_config


@pytest.fixture(autouse=True)
def _no_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)


def _shell(marker: Path) -> str:
    return f'{{_component_: os.system, command: "touch {marker}"}}'


def _filled(value, shell: str):
    """``value`` with ``SHELL`` in its strings replaced by ``shell``."""
    if isinstance(value, dict):
        return {key: _filled(item, shell) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, shell) for item in value]
    return value.replace("SHELL", shell) if isinstance(value, str) else value


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({"loss": "${oc.create:SHELL}"}, "loss._component_"),
        (
            {"loss": {"_component_": "torch.nn.Identity", "inner": "${oc.create:SHELL}"}},
            "loss.inner._component_",
        ),
        ({"metric_loggers": ["${oc.create:SHELL}"]}, "metric_loggers.0._component_"),
        ({"a": {"b": ["${oc.create:{c: ${oc.create:SHELL}}}"]}}, "a.b.0.c._component_"),
        ({"metric_loggers": "${oc.create:[SHELL]}"}, "metric_loggers.0._component_"),
        ({"loss": "${oc.select:nowhere,${oc.create:SHELL}}"}, "loss._component_"),
    ],
)
def test_oc_create_nodes_are_validated_where_used(config, where, tmp_path) -> None:
    marker = tmp_path / "ran"
    cfg = OmegaConf.create(_filled(config, _shell(marker)))
    assert OmegaConf.to_container(cfg, resolve=True)  # the node really is built from it
    issues = validate_config(cfg)
    assert issues and issues[0].path == where, issues
    assert "component 'os.system' is not allowed" in issues[0].message
    assert not marker.exists()


def test_oc_create_made_node_is_not_named_none(tmp_path) -> None:
    cfg = OmegaConf.create({"loss": "${oc.create:" + _shell(tmp_path / "ran") + "}"})
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.loss)
    assert str(info.value).startswith("_component_: component 'os.system' is not allowed")
    assert "None" not in str(info.value)


def test_a_reference_to_a_node_is_reported_once() -> None:
    cfg = OmegaConf.create({"a": {"_component_": "os.system", "command": "x"}, "b": "${a}"})
    assert [i.path for i in validate_config(cfg)] == ["a._component_"]


FALSY = [0, 0.0, [], "", "false", None, {}, "0"]


@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_weights_only_must_be_exactly_true(value) -> None:
    node = {"_component_": "torch.nn.Identity", "weights_only": value}
    cfg = OmegaConf.create({"m": node, "deep": {"x": [{"kw": {"weights_only": value}}]}})
    paths = [i.path for i in validate_config(cfg) if "weights_only=" in i.message]
    assert paths == ["m.weights_only", "deep.x.0.kw.weights_only"]
    with pytest.raises(ConfigError, match=r"^m\.weights_only: weights_only=.* is not true"):
        instantiate(cfg.m)
    assert not [i for i in validate_config(cfg, allow_any_component=True) if "weights_" in i.path]


@pytest.mark.parametrize("value", [1, None, "yes", "false", [], 0], ids=repr)
def test_trust_remote_code_must_be_exactly_false(value) -> None:
    cfg = OmegaConf.create({"m": {"_component_": "torch.nn.Identity", "trust_remote_code": value}})
    issues = [i for i in validate_config(cfg) if "trust_remote_code=" in i.message]
    assert [i.path for i in issues] == ["m.trust_remote_code"]
    with pytest.raises(ConfigError, match=r"^m\.trust_remote_code: trust_remote_code="):
        instantiate(cfg.m)


def test_safe_values_and_interpolated_values() -> None:
    cfg = OmegaConf.create(
        {
            "zero": 0,
            "yes": True,
            "m": {
                "_component_": "torch.nn.Identity",
                "weights_only": True,
                "trust_remote_code": False,
                "kw": {"weights_only": "${yes}"},
            },
            "n": {"_component_": "torch.nn.Identity", "weights_only": "${zero}"},
        }
    )
    assert [i.path for i in validate_config(cfg) if "weights_only" in i.path] == [
        "n.weights_only"
    ]  # judged on the resolved value
    instantiate(cfg.m)
    with pytest.raises(ConfigError, match=r"^n\.weights_only: weights_only=0 is not true"):
        instantiate(cfg.n)


def test_runtime_keywords_are_judged_too() -> None:
    cfg = OmegaConf.create({"m": {"_component_": "torch.nn.Identity"}})
    with pytest.raises(ConfigError, match="weights_only=0 is not true"):
        instantiate(cfg.m, weights_only=0)


def test_nothing_nested_is_built_before_the_refusal(tmp_path) -> None:
    """``weights_only: 0`` is found before the node's nested (allowed) components are built: the
    logger would create its folder."""
    logs = tmp_path / "logs"
    inner = {"_component_": "tunesmith.training.JSONLLogger", "log_dir": str(logs)}
    cfg = OmegaConf.create(
        {"m": {"_component_": "torch.nn.Identity", "inner": inner, "weights_only": 0}}
    )
    instantiate(cfg.m.inner)  # built on its own, it creates the folder
    assert logs.is_dir()
    logs.joinpath("metrics.jsonl").unlink()
    logs.rmdir()
    with pytest.raises(ConfigError, match="weights_only=0"):
        instantiate(cfg.m)
    assert not logs.exists()


@pytest.mark.parametrize(
    "path",
    [
        "torch.nn.Module.register_forward_hook",
        "tunesmith.rl.rewards.CodeTests.score",
        "datasets.Dataset.to_json",
    ],
)
def test_an_unbound_method_with_self_is_refused(path, tmp_path) -> None:
    marker = tmp_path / "written"
    node = {"_component_": path, "self": {"_component_": "torch.nn.Identity"},
            "path_or_buf": str(marker)}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^m\._component_: .* is an unbound method of the class"):
        instantiate(OmegaConf.create({"m": node}).m)
    issues = validate_config(OmegaConf.create({"m": node}))
    assert issues[0].path == "m._component_" and "unbound method" in issues[0].message
    assert not marker.exists()
