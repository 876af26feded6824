"""Every loss has one home, ``tunesmith.modules.losses``, and the paths of the modules the
losses lived in before still name the same classes (configs and checkpoints that name them
keep building, through the component allow-list)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import tunesmith.modules.losses as losses
from tunesmith.config import instantiate, is_marked
from tunesmith.config.components import resolve_component

KINDS = ("token", "preference", "kd", "rl")
OLD_MODULES = {  # old module -> the file of the package it re-exports
    "tunesmith.modules.preference_losses": "tunesmith.modules.losses.preference",
    "tunesmith.modules.kd_losses": "tunesmith.modules.losses.kd",
}
CONFIGS = Path(losses.__file__).parents[2] / "recipes" / "configs"


def test_the_package_re_exports_every_public_name_of_its_files() -> None:
    names = []
    for kind in KINDS:
        module = importlib.import_module(f"tunesmith.modules.losses.{kind}")
        names += module.__all__
        for name in module.__all__:
            assert getattr(losses, name) is getattr(module, name), name
    assert sorted(losses.__all__) == sorted(names)


@pytest.mark.parametrize("old_module", sorted(OLD_MODULES))
def test_old_paths_resolve_to_the_same_objects_as_the_new_ones(old_module: str) -> None:
    new_module = importlib.import_module(OLD_MODULES[old_module])
    old = importlib.import_module(old_module)
    assert sorted(old.__all__) == sorted(new_module.__all__)  # nothing public left behind
    for name in old.__all__:
        if name.isupper() or not is_marked(getattr(old, name)):  # a constant, a helper
            assert getattr(old, name) is getattr(losses, name)
            continue
        found = resolve_component(f"{old_module}.{name}")  # through the allow-list
        assert found is resolve_component(f"tunesmith.modules.losses.{name}"), name
        assert found is resolve_component(f"{OLD_MODULES[old_module]}.{name}"), name
        assert found.__module__ == OLD_MODULES[old_module]


@pytest.mark.parametrize(
    ("old", "new", "kwargs"),
    [
        (
            "tunesmith.modules.preference_losses.DPOLoss",
            "tunesmith.modules.losses.DPOLoss",
            {"beta": 0.1, "label_smoothing": 0.0},
        ),
        (
            "tunesmith.modules.preference_losses.BradleyTerryLoss",
            "tunesmith.modules.losses.BradleyTerryLoss",
            {},
        ),
        (
            "tunesmith.modules.kd_losses.KDLoss",
            "tunesmith.modules.losses.KDLoss",
            {"kind": "reverse", "temperature": 2.0},
        ),
    ],
)
def test_a_config_naming_an_old_path_builds_the_same_loss(old: str, new: str, kwargs) -> None:
    before = instantiate({"_component_": old, **kwargs})
    after = instantiate({"_component_": new, **kwargs})
    assert type(before) is type(after)
    assert repr(before) == repr(after)


def test_shipped_configs_name_losses_by_the_package_path() -> None:
    shipped = sorted(CONFIGS.rglob("*.yaml"))
    assert shipped
    for path in shipped:
        text = path.read_text(encoding="utf-8")
        for old in OLD_MODULES:
            assert old not in text, f"{path} names {old}: use tunesmith.modules.losses"
