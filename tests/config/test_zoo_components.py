"""Every size builder of every family file (``tunesmith/models/zoo/*.py``) carries the
``@component`` mark, so a config may name it (``model: {_component_:
tunesmith.models.qwen3.qwen3_0_6b}``) without ``--allow-any-component``; nothing else of a
family file is marked. Each builder is named in a config, checked as ``tunesmith validate``
checks it, and built from that config: the real architecture on the meta device (no memory,
the same parameters as the Python call), the tiny ones for real with a size override."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from omegaconf import OmegaConf

from tunesmith.config import (
    ALLOW_ANY_COMPONENT_ENV,
    component_refusal,
    instantiate,
    validate_config,
)
from tunesmith.config.registry import is_marked, marked_objects
from tunesmith.models import zoo
from tunesmith.modules.decoder import TransformerLM

FAMILIES = sorted(zoo.FAMILY_FILES.items())
BUILDERS = [(name, module, size) for name, module in FAMILIES for size in module.SIZES]
# A family file's public callables that are not builders: `spec(size)` gives a ModelSpec (data
# for the Python API's build_model); a config names the size's builder instead.
NOT_BUILDERS = {"spec"}


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)


def _paths(family: str, size: str) -> list[str]:
    """The two dotted paths a config may use: ``tunesmith.models.qwen3.qwen3_8b`` (the family
    file by its short name, as in the README) and the module's own."""
    return [f"tunesmith.models.{family}.{size}", f"tunesmith.models.zoo.{family}.{size}"]


def test_every_family_is_covered() -> None:
    assert {"llama3", "mistral", "qwen2_5", "qwen3", "qwen3_moe"} <= set(zoo.FAMILY_FILES)
    assert len(BUILDERS) >= 28, BUILDERS


@pytest.mark.parametrize(("name", "module"), FAMILIES, ids=[n for n, _ in FAMILIES])
def test_public_callables_are_the_size_builders(name: str, module: ModuleType) -> None:
    """Each size has a public builder of its name, and the other public callables are the
    known non-builders: a new public function must be marked or listed here."""
    public = {n for n in module.__all__ if callable(getattr(module, n))}
    assert set(module.SIZES) <= public, sorted(set(module.SIZES) - public)
    assert public - set(module.SIZES) == NOT_BUILDERS, sorted(public)


@pytest.mark.parametrize(("name", "module"), FAMILIES, ids=[n for n, _ in FAMILIES])
def test_exactly_the_builders_are_marked(name: str, module: ModuleType) -> None:
    unmarked = [size for size in module.SIZES if not is_marked(getattr(module, size))]
    assert unmarked == [], f"{module.__name__}: not marked with @component: {unmarked}"
    marked = {
        o.__name__ for o in marked_objects() if getattr(o, "__module__", "") == module.__name__
    }
    assert marked == set(module.SIZES), sorted(marked ^ set(module.SIZES))
    for helper in NOT_BUILDERS:
        assert not is_marked(getattr(module, helper)), helper


@pytest.mark.parametrize(("name", "module"), FAMILIES, ids=[n for n, _ in FAMILIES])
def test_helpers_of_a_family_file_are_refused(name: str, module: ModuleType) -> None:
    refusal = component_refusal(f"tunesmith.models.{name}.spec")
    assert refusal is not None and "which is not marked as a component" in refusal, refusal
    refusal = component_refusal(f"tunesmith.models.{name}._COMMON")
    assert refusal is not None and "names the private attribute '_COMMON'" in refusal, refusal


@pytest.mark.parametrize(("name", "module", "size"), BUILDERS, ids=[s for _, _, s in BUILDERS])
def test_a_config_naming_the_builder_validates_and_builds(
    name: str, module: ModuleType, size: str
) -> None:
    expected = getattr(module, size)(device="meta")
    for path in _paths(name, size):
        assert component_refusal(path) is None, component_refusal(path)
        cfg = OmegaConf.create({"model": {"_component_": path, "device": "meta"}})
        assert [str(i) for i in validate_config(cfg)] == [], path
        model = instantiate(cfg.model)
        assert isinstance(model, TransformerLM) and model.spec == module.spec(size), path
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        assert shapes == {k: v.shape for k, v in expected.state_dict().items()}, path
        assert next(model.parameters()).device.type == "meta"


TINY = [(name, module, size) for name, module, size in BUILDERS if size.endswith("_tiny")]


@pytest.mark.parametrize(("name", "module", "size"), TINY, ids=[s for _, _, s in TINY])
def test_a_tiny_builder_from_a_config_runs(name: str, module: ModuleType, size: str) -> None:
    """Built for real on the CPU, with a size override passed through the config: the same
    weights as the Python call under the same seed, and a forward pass."""
    node = {"_component_": f"tunesmith.models.{name}.{size}", "num_hidden_layers": 1}
    cfg = OmegaConf.create({"model": node})
    assert [str(i) for i in validate_config(cfg)] == []
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    torch.manual_seed(0)
    direct = getattr(module, size)(num_hidden_layers=1)
    assert model.spec.num_hidden_layers == 1 and model.spec == direct.spec
    state, reference = model.state_dict(), direct.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)
    logits = model(torch.tensor([[1, 2, 3]]))
    logits = getattr(logits, "logits", logits)
    assert logits.shape == (1, 3, model.spec.vocab_size)
