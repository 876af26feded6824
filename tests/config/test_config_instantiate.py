"""instantiate(): nested components, runtime args, kwargs, plain containers, path-named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.config import configtest_components
from tests.config.configtest_components import Block, Net, Optim, WithParams
from tunesmith.config import (
    ALLOW_ANY_COMPONENT_ENV,
    ALLOWED_COMPONENT_PREFIXES,
    ConfigError,
    component,
    instantiate,
    load_config,
)

HELPERS = "tests.config.configtest_components"


def test_nested_components_in_dicts_and_lists_are_built_first() -> None:
    cfg = OmegaConf.create(
        {
            "dim": 8,
            "net": {
                "_component_": f"{HELPERS}.Net",
                "blocks": [
                    {"_component_": f"{HELPERS}.Block", "dim": "${dim}"},
                    {"_component_": f"{HELPERS}.Block", "dim": 16, "dropout": 0.1},
                ],
                "head": {
                    "_component_": "torch.nn.Linear",
                    "in_features": "${dim}",
                    "out_features": 3,
                },
                "options": {"tag": "x", "sizes": [1, 2], "inner": {"k": "${dim}"}},
                "depth": 2,
            },
        }
    )
    net = instantiate(cfg.net, allow_any_component=True)
    assert isinstance(net, Net)
    assert net.blocks == [Block(dim=8), Block(dim=16, dropout=0.1)]
    assert isinstance(net.head, torch.nn.Linear)
    assert net.head.weight.shape == (3, 8)
    assert net.options == {"tag": "x", "sizes": [1, 2], "inner": {"k": 8}}
    assert type(net.options) is dict and type(net.options["sizes"]) is list
    assert net.depth == 2


def test_list_of_components() -> None:
    cfg = OmegaConf.create(
        [
            {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3},
            {"_component_": "torch.nn.ReLU"},
            7,
        ]
    )
    built = instantiate(cfg)
    assert type(built) is list
    assert isinstance(built[0], torch.nn.Linear) and built[0].out_features == 3
    assert isinstance(built[1], torch.nn.ReLU)
    assert built[2] == 7


def test_positional_runtime_args_go_first() -> None:
    cfg = load_config(Path(__file__).parent / "good_config.yaml")
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer, model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    assert group["lr"] == 1e-3
    assert tuple(group["betas"]) == (0.9, 0.95)
    assert model.in_features == 4  # ${dim}


def test_kwargs_override_config_values_and_add_new_ones() -> None:
    cfg = OmegaConf.create({"opt": {"_component_": f"{HELPERS}.WithParams", "lr": 0.5}})
    built = instantiate(cfg.opt, [1, 2], lr=0.25, scale=3, allow_any_component=True)
    assert isinstance(built, WithParams)
    assert (built.params, built.lr, built.scale) == ([1, 2], 0.25, 3)
    # The config itself is untouched by the call.
    assert cfg.opt.lr == 0.5


def test_kwarg_replaces_an_invalid_config_value_without_reading_it() -> None:
    cfg = OmegaConf.create({"opt": {"_component_": f"{HELPERS}.Optim", "lr": "${nowhere}"}})
    assert instantiate(cfg.opt, lr=0.1, allow_any_component=True) == Optim(lr=0.1)


def test_node_without_component_becomes_plain_containers() -> None:
    cfg = OmegaConf.create({"data": {"a": 1, "b": [1, {"c": "${data.a}"}], "d": None}})
    built = instantiate(cfg.data)
    assert built == {"a": 1, "b": [1, {"c": 1}], "d": None}
    assert type(built) is dict and type(built["b"]) is list and type(built["b"][1]) is dict
    assert instantiate(cfg.data, a=5)["a"] == 5


def test_plain_python_input_and_none() -> None:
    built = instantiate({"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 1})
    assert isinstance(built, torch.nn.Linear)
    assert instantiate(None) is None
    assert instantiate(3) == 3


def test_error_names_dotted_path_and_keeps_cause() -> None:
    cfg = OmegaConf.create(
        {
            "net": {
                "_component_": f"{HELPERS}.Net",
                "blocks": [
                    {"_component_": f"{HELPERS}.Block", "dim": 4},
                    {"_component_": f"{HELPERS}.Block", "dimm": 4},
                ],
            }
        }
    )
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.net, allow_any_component=True)
    message = str(info.value)
    assert message.startswith("net.blocks.1: TypeError: ")
    assert "dimm" in message
    assert isinstance(info.value.__cause__, TypeError)
    assert info.value.path == "net.blocks.1"


def test_error_path_of_a_node_taken_from_inside_a_list() -> None:
    cfg = OmegaConf.create(
        {"stages": [{"heads": [{"_component_": "torch.nn.Linear", "in_features": 2}]}]}
    )
    with pytest.raises(ConfigError, match=r"^stages\.0\.heads\.0: TypeError: .*out_features"):
        instantiate(cfg.stages[0].heads[0])


def test_error_raised_by_the_component_itself() -> None:
    cfg = OmegaConf.create({"hooks": [{"_component_": f"{HELPERS}.explode", "reason": "no disk"}]})
    with pytest.raises(ConfigError, match=r"^hooks\.0: RuntimeError: no disk$") as info:
        instantiate(cfg, allow_any_component=True)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_runtime_arg_given_twice_names_the_node() -> None:
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.SGD", "params": [], "lr": 1}})
    with pytest.raises(ConfigError, match=r"^optimizer: TypeError: .*multiple values.*params"):
        instantiate(cfg.optimizer, torch.nn.Linear(2, 2).parameters())


@pytest.mark.parametrize(
    ("node", "path", "words"),
    [
        ({"opt": {"_component_": "torch.optim.SGD", "lr": "???"}}, "opt.lr", "value is missing"),
        ({"opt": {"_component_": "torch.optim.SGD", "lr": "${x}"}}, "opt.lr", "'${x}' cannot"),
        ({"opt": {"_component_": "torch.optim.Sgd"}}, "opt._component_", "torch.optim.SGD"),
        ({"opt": {"_component_": 3}}, "opt._component_", "dotted path string"),
    ],
    ids=["missing", "interpolation", "misspelt", "not-a-string"],
)
def test_config_problems_name_their_path(node: dict, path: str, words: str) -> None:
    cfg = OmegaConf.create(node)
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.opt, [torch.zeros(1, requires_grad=True)])
    assert str(info.value).startswith(f"{path}: ")
    assert words in str(info.value)


def test_positional_args_need_a_component() -> None:
    cfg = OmegaConf.create({"data": {"a": 1}, "xs": [1]})
    with pytest.raises(ConfigError, match=r"^data: got 1 positional argument"):
        instantiate(cfg.data, 5)
    with pytest.raises(ConfigError, match=r"^xs: got keyword argument"):
        instantiate(cfg.xs, a=1)


@pytest.mark.parametrize(
    "spec",
    [
        "os.system",
        "subprocess.run",
        "builtins.eval",
        "tests.config.configtest_components.Optim",
        # under allowed prefixes, but they load pickles / TorchScript / hub code
        "torch.load",
        "torch.hub.load",
        "torch.jit.load",
        "torch.package.PackageImporter",
    ],
)
def test_allow_list_refuses_other_components(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)
    cfg = OmegaConf.create({"hook": {"_component_": spec}})
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.hook)
    message = str(info.value)
    assert message.startswith(f"hook._component_: component '{spec}' is not allowed")
    assert "--allow-any-component" in message and "allow_any_component=True" in message


def test_refused_component_is_never_called(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cfg = OmegaConf.create({"a": {"_component_": "subprocess.run", "args": ["touch", str(marker)]}})
    with pytest.raises(ConfigError):
        instantiate(cfg.a)
    assert not marker.exists()
    instantiate(cfg.a, allow_any_component=True)  # the same node, explicitly allowed
    assert marker.exists()


def test_allow_any_by_environment_and_by_extending_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = OmegaConf.create({"o": {"_component_": f"{HELPERS}.Optim", "lr": 1}})
    monkeypatch.setenv(ALLOW_ANY_COMPONENT_ENV, "1")
    assert instantiate(cfg.o) == Optim(lr=1)
    with pytest.raises(ConfigError, match="not allowed"):
        instantiate(cfg.o, allow_any_component=False)  # an explicit choice wins
    monkeypatch.setenv(ALLOW_ANY_COMPONENT_ENV, "0")
    with pytest.raises(ConfigError, match="not allowed"):
        instantiate(cfg.o)
    ALLOWED_COMPONENT_PREFIXES.append(f"{HELPERS}.")
    try:
        assert instantiate(cfg.o) == Optim(lr=1)
    finally:
        ALLOWED_COMPONENT_PREFIXES.remove(f"{HELPERS}.")
    with pytest.raises(ConfigError, match="not allowed"):
        instantiate(cfg.o)


def test_trust_remote_code_is_refused_under_the_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allowed component (a hub loader, say) must not be told to run the model's own code."""
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)
    calls = []
    monkeypatch.setattr(
        configtest_components,
        "Loader",
        component(lambda **kw: calls.append(kw) or kw),  # marked: the prefix is added below
        raising=False,
    )
    cfg = OmegaConf.create(
        {"model": {"_component_": f"{HELPERS}.Loader", "path": "x", "trust_remote_code": True}}
    )
    ALLOWED_COMPONENT_PREFIXES.append("tests.config.")  # the stand-in is a lambda of this file
    try:
        with pytest.raises(ConfigError) as info:
            instantiate(cfg.model)
        assert str(info.value).startswith("model.trust_remote_code: trust_remote_code=true")
        assert "--allow-any-component" in str(info.value) and calls == []
        cfg.model.trust_remote_code = False  # an explicit false is fine
        assert instantiate(cfg.model) == {"path": "x", "trust_remote_code": False}
        cfg.model.trust_remote_code = True
        assert instantiate(cfg.model, allow_any_component=True)["trust_remote_code"] is True
    finally:
        ALLOWED_COMPONENT_PREFIXES.remove("tests.config.")
