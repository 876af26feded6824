"""Model families as data: the family table, and a toy family added from a test.

The toy family is what a new family file holds: one :class:`Family` entry (its HF
``model_type``, what the type implies, its defaults, the code for its one real difference)
plus one chat template. Nothing else in tunesmith changes for ``from_hf`` to load it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import pkgutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

import tunesmith.models
from tunesmith.data.chat_template import TEMPLATE_NAMES, load_template, render_chat
from tunesmith.models import (
    Family,
    ModelSpec,
    UnsupportedModelError,
    build_model,
    families,
    family_for,
    register_family,
    spec_from_hf_config,
)
from tunesmith.models.family import unregister_family
from tunesmith.models.hf import from_hf, save_hf_checkpoint

SHIPPED = families()

# ----------------------------------------------------------------------------- the toy family
# Everything below up to the fixtures is what a family file would hold.


def _read_toy(config: Mapping[str, Any]) -> dict[str, Any]:
    # Its one real difference: the window is called "local_window" (0 = none).
    return {"sliding_window": config.get("local_window") or None}


def _write_toy(spec: ModelSpec) -> dict[str, Any]:
    return {"local_window": spec.sliding_window or 0}


TOY_TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def toy_family(template: str | None = None) -> Family:
    return Family(
        name="toy",
        model_type="toy_lm",
        architecture="ToyForCausalLM",
        implied={"qk_norm": True},
        flags=("attention_bias",),
        defaults={"max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2},
        from_hf_config=_read_toy,
        to_hf_config=_write_toy,
        template=template,
    )


TOY_CONFIG = {
    "model_type": "toy_lm",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_bias": True,
    "local_window": 4,
}


@contextmanager
def registered(family: Family) -> Iterator[Family]:
    """``family`` in the table for the duration (replacing a shipped one of its type)."""
    previous = None
    if family.model_type in {f.model_type for f in families()}:
        previous = unregister_family(family.model_type)
    register_family(family)
    try:
        yield family
    finally:
        unregister_family(family.model_type)
        if previous is not None:
            register_family(previous)


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[Family]:
    template = tmp_path / "toy.jinja"
    template.write_text(TOY_TEMPLATE)
    with registered(toy_family(str(template))) as family:
        yield family


def _write_hf_folder(folder: Path, config: dict[str, Any], model: torch.nn.Module) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, folder / "model.safetensors")


# ----------------------------------------------------------------------------- toy family


def test_toy_family_loads_from_hf_and_round_trips(toy, tmp_path):
    expected = ModelSpec(
        "toy_lm",
        64,
        32,
        64,
        2,
        4,
        2,
        8,
        qk_norm=True,
        attention_bias=True,
        sliding_window=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    source = build_model(expected).eval()
    _write_hf_folder(tmp_path / "hf", TOY_CONFIG, source)

    model = from_hf(tmp_path / "hf").eval()
    assert model.spec == expected  # implied, flag, hook and defaults all applied
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))

    save_hf_checkpoint(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["ToyForCausalLM"]
    assert config["model_type"] == "toy_lm"
    assert config["local_window"] == 4 and config["attention_bias"] is True
    assert "qk_norm" not in config  # implied by the model_type, never written
    again = from_hf(tmp_path / "out").eval()
    assert again.spec == expected.replace(torch_dtype="float32")  # saved with its dtype
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(again(ids), source(ids))


def test_toy_family_refuses_what_its_config_cannot_say(toy):
    spec = spec_from_hf_config(TOY_CONFIG)
    with pytest.raises(UnsupportedModelError, match=r"mlp_bias=True .*'toy_lm'.*can: .*llama"):
        spec.replace(mlp_bias=True).to_hf_config()
    with pytest.raises(UnsupportedModelError, match="qk_norm=False"):
        spec.replace(qk_norm=False).to_hf_config()
    with pytest.raises(UnsupportedModelError, match="toy_lm has no mixture-of-experts"):
        spec.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8).to_hf_config()
    assert spec.replace(sliding_window=None).to_hf_config()["local_window"] == 0


def test_toy_family_template_renders(toy):
    template = load_template(toy.template)
    chat = render_chat(
        template,
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        control_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
        end_tokens=["<|end|>"],
    )
    assert chat.text == "<|user|>Hi<|end|><|assistant|>Hello!<|end|>"
    assert [chat.text[s:e] for s, e in chat.assistant_spans] == ["Hello!<|end|>"]


def test_unknown_model_type_lists_the_registered_ones(toy):
    with pytest.raises(
        UnsupportedModelError, match=r"'gpt2' is not supported; supported: .*toy_lm"
    ):
        spec_from_hf_config({**TOY_CONFIG, "model_type": "gpt2"})
    assert "toy_lm" in tunesmith.models.SUPPORTED_MODEL_TYPES


def test_unregistered_family_is_gone():
    with registered(toy_family()):
        assert family_for("toy_lm").name == "toy"
    with pytest.raises(UnsupportedModelError, match="'toy_lm' is not supported"):
        spec_from_hf_config(TOY_CONFIG)
    assert families() == SHIPPED


# ----------------------------------------------------------------------------- the table


def test_nothing_is_registered_twice():
    names = [f.name for f in SHIPPED]
    types = [f.model_type for f in SHIPPED]
    assert len(set(names)) == len(names) and len(set(types)) == len(types)
    with pytest.raises(ValueError, match="clashes"):
        register_family(family_for("qwen3"))
    with pytest.raises(ValueError, match="clashes"):
        register_family(dataclasses.replace(toy_family(), name="qwen3"))
    with pytest.raises(ValueError, match="clashes"):
        register_family(dataclasses.replace(toy_family(), model_type="llama"))
    assert families() == SHIPPED


def test_family_entries_are_checked():
    with pytest.raises(ValueError, match="flags"):
        Family("x", "x", "XForCausalLM", flags=("sliding_window",))
    with pytest.raises(ValueError, match="both implied and read"):
        Family("x", "x", "XForCausalLM", implied={"qk_norm": True}, flags=("qk_norm",))
    with pytest.raises(ValueError, match="not read"):
        Family("x", "x", "XForCausalLM", defaults={"rms_eps": 1e-5})


def test_every_family_file_is_registered_once():
    found = {}
    for info in pkgutil.iter_modules(tunesmith.models.zoo.__path__):
        module = importlib.import_module(f"tunesmith.models.zoo.{info.name}")
        assert isinstance(module.FAMILY, Family), info.name  # the zoo holds family files only
        assert getattr(tunesmith.models, info.name) is module  # tunesmith.models.<name>
        found[info.name] = module.FAMILY
    assert sorted(found) == sorted(f.name for f in SHIPPED)
    for name, family in found.items():
        assert family_for(family.model_type) is family, name
    shipped_types = tuple(sorted(f.model_type for f in SHIPPED))
    assert shipped_types == tunesmith.models.SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("family", SHIPPED, ids=lambda f: f.name)
def test_shipped_template_loads(family):
    if family.template is not None:
        assert family.template in TEMPLATE_NAMES
        assert "{%" in load_template(family.template)


@pytest.mark.parametrize("family", SHIPPED, ids=lambda f: f.name)
def test_from_hf_uses_the_family_entry(family, hf_tiny, tmp_path):
    assert family.model_type in hf_tiny.families  # every family has a parity fixture
    seen: list[str] = []

    def spy(config: Mapping[str, Any]) -> dict[str, Any]:
        seen.append(config["model_type"])
        return family.from_hf_config(config)

    hf_tiny.write_checkpoint(tmp_path / "hf", family.model_type)
    with registered(dataclasses.replace(family, from_hf_config=spy)):
        model = from_hf(tmp_path / "hf")
        assert seen == [family.model_type]
        save_hf_checkpoint(model, tmp_path / "out")
    for name, value in family.implied.items():
        assert getattr(model.spec, name) == value
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [family.architecture]
    assert family_for(family.model_type) is family


def _code_strings(path: Path) -> set[str]:
    """String constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    }


@pytest.mark.parametrize("module", ["spec.py", "hf.py", "builder.py"])
def test_generic_code_names_no_family(module):
    strings = _code_strings(Path(tunesmith.models.__file__).parent / module)
    assert not strings & {f.model_type for f in SHIPPED}


@pytest.mark.parametrize("family", SHIPPED, ids=lambda f: f.name)
def test_the_reward_model_class_a_family_names_exists_in_transformers(family):
    """A reward model's config.json names ``classifier_architecture``: transformers must have
    it (or the family says it has none, and its reward folders load with tunesmith only)."""
    name = family.classifier_architecture
    assert name is None or hasattr(transformers, name), (family.name, name)
