"""The one checkpoint loader of generate/chat/eval (and export's path resolution): run folders
pick their newest checkpoint, an adapter finds its base from any working directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli.checkpoint_loading import (
    CheckpointNotFoundError,
    adapter_base,
    load_checkpoint,
    resolve_checkpoint,
)
from tunesmith.cli.main import main
from tunesmith.models.base_record import BASE_RECORD
from tunesmith.models.export import export_merged


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    model_dir = make_model_dir(root)
    data = make_counting_data(root / "d.jsonl")
    lora = run_sft(
        model_dir, data, root / "lora", "max_steps=2", "save_every_n_steps=1", config="tiny_lora"
    )
    return {"root": root, "model": model_dir, "lora": lora}


def test_a_run_folder_and_its_checkpoints_folder_mean_the_newest_checkpoint(world):
    newest = world["lora"] / "checkpoints" / "step_000002"
    assert (world["lora"] / "checkpoints" / "step_000001").is_dir()
    assert resolve_checkpoint(world["lora"]) == newest
    assert resolve_checkpoint(world["lora"] / "checkpoints") == newest
    assert resolve_checkpoint(newest) == newest
    assert resolve_checkpoint(world["model"]) == world["model"]
    loaded = load_checkpoint(world["lora"])
    assert (loaded.kind, loaded.path, loaded.base) == ("adapter", newest, world["model"])
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert not loaded.model.training


def test_a_folder_without_a_checkpoint_says_what_it_expected(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="neither a model folder"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)  # an unfinished write
    with pytest.raises(CheckpointNotFoundError, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path)


def _copy_run(world, tmp_path, base_name: str, keep_config: bool):
    run = tmp_path / "run"
    shutil.copytree(world["lora"], run)
    if not keep_config:
        (run / "config.yaml").unlink()
    step = run / "checkpoints" / "step_000002"
    config = json.loads((step / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_name
    (step / "adapter_config.json").write_text(json.dumps(config))
    (step / BASE_RECORD).unlink()  # an adapter without a record (peft's, or an older one)
    return run, step


def test_a_relative_or_stale_base_is_found_from_anywhere(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not where the run was started
    shutil.copytree(world["model"], tmp_path / "model")
    run, step = _copy_run(world, tmp_path, "../model", keep_config=False)
    assert adapter_base(step) == run / "../model"  # relative to the run folder
    _, step = _copy_run(world, tmp_path / "b", "/gone/model", keep_config=True)
    assert adapter_base(step) == world["model"]  # the run's config.yaml model_dir
    _, step = _copy_run(world, tmp_path / "c", "/gone/model", keep_config=False)
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"base model '/gone/model' not found "
        r"\(tried /gone/model\); give the base model's folder \(`tunesmith ... --base-dir DIR`",
    ):
        adapter_base(step)
    assert adapter_base(step, world["model"]) == world["model"]


def test_export_takes_a_run_folder_from_another_directory(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run, _ = _copy_run(world, tmp_path, "/gone/model", keep_config=True)
    assert main(["export", str(run), "--output-dir", str(tmp_path / "merged")]) == 0
    expected = export_merged(
        world["lora"] / "checkpoints" / "step_000002", tmp_path / "ref", base_dir=world["model"]
    )
    got, want = (load_file(p / "model.safetensors") for p in (tmp_path / "merged", expected))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    base = load_file(world["model"] / "model.safetensors")
    assert max((got[k] - base[k]).abs().max().item() for k in base) > 1e-4  # merged, moved


def test_export_replaces_an_existing_folder_only_with_force(world, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["export", str(world["lora"]), "--output-dir", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"tunesmith: error: --output-dir {out} already exists: pass --force to replace it"
    ]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # untouched
    assert main([*argv, "--force"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()


def test_export_never_replaces_the_folder_it_reads_even_with_force(world, tmp_path, capsys):
    run, _ = _copy_run(world, tmp_path, str(world["model"]), keep_config=True)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for out in (run, run / "checkpoints"):  # the run folder, and the one holding the adapter
        assert main(["export", str(run), "--output-dir", str(out), "--force"]) == 1
        err = capsys.readouterr().err
        assert f"--output-dir {out} holds {run.resolve()}/checkpoints/step_000002" in err, err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
