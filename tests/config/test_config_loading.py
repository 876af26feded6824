"""load_config() and config_to_yaml(): files, overrides, interpolation, error locations."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from tunesmith.config import ConfigError, config_to_yaml, load_config

GOOD = Path(__file__).parent / "good_config.yaml"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_keeps_interpolation_lazy_and_types_right() -> None:
    cfg = load_config(GOOD)
    assert isinstance(cfg, DictConfig)
    assert OmegaConf.is_interpolation(cfg.model, "in_features")
    assert cfg.model.in_features == 4
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.data.prompt == "Question: 4?"


def test_load_applies_overrides_and_interpolations_follow() -> None:
    cfg = load_config(GOOD, ["dim=16", "optimizer.lr=5e-5", "~loss", "data.shuffle=true"])
    assert cfg.model.in_features == 16
    assert cfg.data.prompt == "Question: 16?"
    assert cfg.optimizer.lr == 5e-5
    assert "loss" not in cfg
    assert cfg.data.shuffle is True


def test_bad_override_in_load_names_it() -> None:
    with pytest.raises(ConfigError, match=r"^override '~nope': cannot delete 'nope'"):
        load_config(GOOD, ["~nope"])


def test_config_to_yaml_resolves_and_round_trips() -> None:
    cfg = load_config(GOOD, ["dim=8"])
    text = config_to_yaml(cfg)
    assert "${" not in text
    data = yaml.safe_load(text)
    assert data["model"] == {
        "_component_": "torch.nn.Linear",
        "in_features": 8,
        "out_features": 2,
        "bias": True,
    }
    assert data["data"]["prompt"] == "Question: 8?"
    assert "${dim}" in config_to_yaml(cfg, resolve=False)


def test_config_to_yaml_names_unresolvable_path(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "a: 1\nb:\n  - x\n  - ${nowhere.y}\n"))
    with pytest.raises(ConfigError, match=r"^b\.1: interpolation '\$\{nowhere\.y\}'"):
        config_to_yaml(cfg)


def test_config_to_yaml_keeps_values_still_to_be_given(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model:\n  path: ???\n  dim: 4\ncopy: ${model.dim}\n"))
    assert yaml.safe_load(config_to_yaml(cfg)) == {"model": {"path": "???", "dim": 4}, "copy": 4}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_is_an_empty_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "# nothing yet\n"), ["seed=3"])
    assert OmegaConf.to_container(cfg) == {"seed": 3}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a: 1\nb: [1, 2\n", ["cfg.yaml:3:", "YAML syntax error"]),
        ("a:\n  b: 1\n c: 2\n", ["cfg.yaml:3:2:", "YAML syntax error"]),
        ("a: 1\n---\nb: 2\n", ["cfg.yaml:2:", "single document"]),
        ("a: 'unclosed\n", ["cfg.yaml:2:", "YAML syntax error"]),
        ("just a string\n", ["cfg.yaml:1:", "top level", "got a single value"]),
        ("x: 1\nx: 2\n", ["cfg.yaml:2:", "duplicate key"]),
    ],
    ids=["flow", "indent", "two-documents", "quote", "scalar", "duplicate"],
)
def test_yaml_errors_name_file_and_line(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
