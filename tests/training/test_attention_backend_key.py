"""The ``attention_backend`` config key: every recipe accepts it, a bad value is one line
naming it, and the value reaches every decoder the recipe builds (the trained model, a frozen
teacher or reference), so the forward really runs on that backend."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    make_chat_data,
    make_model_dir,
    recipe_config,
    run_config,
    run_sft_keeping_model,
)
from tunesmith.cli import catalog
from tunesmith.cli.main import main
from tunesmith.modules.decoder import DecoderModel
from tunesmith.recipes import Recipe
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import MODEL_RULES, RESUMABLE_KEYS
from tunesmith.training.setup import MODEL_KEYS, apply_attention_backend, frozen_model

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
TINY = {"_component_": "tunesmith.models.llama3.llama3_tiny"}


def _backends(model: torch.nn.Module) -> list[str]:
    return [m.attention_backend for m in model.modules() if isinstance(m, DecoderModel)]


@pytest.mark.parametrize("recipe", catalog.recipe_names())
def test_every_recipe_reads_the_key_and_checks_it(recipe):
    declared = Recipe.load(catalog.recipe_path(recipe))
    assert "attention_backend" in declared.keys and "attention_backend" in MODEL_KEYS
    assert declared.rules["attention_backend"] is MODEL_RULES["attention_backend"]
    assert "attention_backend" in RESUMABLE_KEYS  # speed only: may change on resume


BACKEND_RULE = {"attention_backend": MODEL_RULES["attention_backend"]}
"""The key's own rule (the others, such as the required ``model``, need a whole config)."""


@pytest.mark.parametrize("value", ["auto", "sdpa", "varlen", "flex", "loop", None])
def test_good_values_pass(value):
    assert check_rules(OmegaConf.create({"attention_backend": value}), BACKEND_RULE) == []


@pytest.mark.parametrize("value", ["ring", "SDPA", "flash", 3, True])
def test_a_bad_value_is_one_line_naming_it(value):
    issues = [
        str(i) for i in check_rules(OmegaConf.create({"attention_backend": value}), BACKEND_RULE)
    ]
    assert len(issues) == 1, issues
    assert issues[0].startswith(
        "attention_backend: expected one of 'auto', 'sdpa', 'varlen', 'flex', 'loop', or null"
    ), issues
    assert f"got {value!r}" in issues[0] or f"got {str(value).lower()}" in issues[0], issues


def test_validate_refuses_a_bad_value_in_one_line(capsys, tmp_path):
    model_dir, data = make_model_dir(tmp_path), make_chat_data(tmp_path / "d.jsonl", rows=2)
    fills = [f"model_dir={model_dir}", f"dataset.source={data}"]
    assert main(["validate", "sft/tiny", *fills, "attention_backend=ring"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("tunesmith: error: attention_backend: expected one of 'auto'"), err
    assert "got 'ring'" in err[0], err
    assert main(["validate", "sft/tiny", *fills, "attention_backend=loop"]) == 0


def test_apply_sets_every_decoder_and_none_leaves_them():
    from tunesmith.models import llama3

    model = llama3.llama3_tiny()
    assert _backends(model) == ["auto"]
    assert apply_attention_backend(model, None) is model and _backends(model) == ["auto"]
    apply_attention_backend(model, "loop")
    assert _backends(model) == ["loop"]
    with pytest.raises(ValueError, match="has no DecoderModel"):
        apply_attention_backend(torch.nn.Linear(2, 2), "sdpa")
    with pytest.raises(ValueError, match="'ring2'"):
        apply_attention_backend(model, "ring2")


def test_frozen_model_gets_the_key_too():
    cfg = OmegaConf.create({"teacher_model": TINY, "attention_backend": "varlen"})
    teacher = frozen_model(cfg, CTX, "teacher_model")
    assert _backends(teacher) == ["varlen"]
    cfg = OmegaConf.create({"teacher_model": TINY})  # no key: the model's own default
    assert _backends(frozen_model(cfg, CTX, "teacher_model")) == ["auto"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    return make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=8)


def test_the_sft_recipe_trains_on_the_chosen_backend(world, tmp_path):
    model_dir, data = world
    args = ("max_steps=2", "batch_size=2", "packed=true")
    _, model = run_sft_keeping_model(
        model_dir, data, tmp_path / "a", *args, "attention_backend=loop"
    )
    assert _backends(model) == ["loop"]
    # The forward runs on it: flex has no CPU backward, so a training step on it fails there.
    cfg = recipe_config(
        "sft", "tiny", model_dir, data, tmp_path / "b", *args, "attention_backend=flex"
    )
    with pytest.raises(NotImplementedError, match="'flex' has no backward on CPU"):
        run_config("sft", cfg)
