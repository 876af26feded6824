"""Outputs that work from anywhere (issue #38): a LoRA run started with a relative
``model_dir`` leaves adapters that load from another working directory, after a copy of the
adapter folder, after the base moved (found through ``$TUNESMITH_MODEL_PATH`` and checked by
its weights' fingerprint), and in peft; every command that takes a checkpoint takes a run
folder (its newest complete checkpoint); the demo prints the ``generate`` command that gives
its answer again."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli import lm_eval_adapter
from tunesmith.cli.checkpoint_loading import (
    CheckpointNotFoundError,
    adapter_base,
    load_checkpoint,
    resolve_checkpoint,
)
from tunesmith.cli.main import main
from tunesmith.demo.assets import AssetSettings
from tunesmith.demo.run import run_demo
from tunesmith.models import build_model, from_hf, qwen2_5
from tunesmith.models.base_record import (
    BASE_RECORD,
    MODEL_PATH_ENV,
    weights_fingerprint,
)
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, save_peft_adapter
from tunesmith.modules.peft import apply_lora

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 27]])
# Sampled: the text then depends on the exact logits (greedy decoding of the untrained tiny
# model repeats one token whatever the adapter does).
PROMPT = shlex.split("--prompt 'count 3 from 7' --max-new-tokens 8 --temperature 1 --seed 3")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A LoRA run started in ``root`` with ``model_dir=model`` (relative), checkpoints at
    steps 2 and 3, and the logits of its newest adapter loaded in place."""
    root = tmp_path_factory.mktemp("portable")
    make_model_dir(root)
    make_counting_data(root / "d.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        run_sft(
            Path("model"),
            Path("d.jsonl"),
            Path("lora"),
            "max_steps=3",
            "save_every_n_steps=2",
            config="tiny_lora",
        )
        in_place = _logits(load_checkpoint("lora/checkpoints/step_000003").model)
    step = root / "lora" / "checkpoints" / "step_000003"
    return {"root": root, "model": root / "model", "run": root / "lora", "step": step,
            "logits": in_place}  # fmt: skip


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def _stdout_of(argv: list[str], capsys) -> tuple[str, str]:
    assert main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return captured.out, captured.err


# ----------------------------------------------------------------------------- the record


def test_the_adapter_records_its_base_absolute_as_given_and_by_fingerprint(world):
    config = json.loads((world["step"] / ADAPTER_CONFIG_NAME).read_text())
    record = json.loads((world["step"] / BASE_RECORD).read_text())
    absolute = str(world["model"].resolve())
    assert config["base_model_name_or_path"] == absolute
    assert record == {
        "path": absolute,
        "given": "model",
        "fingerprint": weights_fingerprint(world["model"]),
    }


def test_the_adapter_loads_from_another_directory_and_after_a_copy(
    world, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # not where the run was started
    copy = shutil.copytree(world["step"], tmp_path / "elsewhere" / "adapter")
    base_only = _logits(from_hf(world["model"]))
    assert (world["logits"] - base_only).abs().max() > 1e-3  # the adapter matters
    for where in (world["run"], world["step"], copy):
        loaded = load_checkpoint(where)
        assert loaded.base == world["model"].resolve()
        assert torch.equal(_logits(loaded.model), world["logits"]), where
    monkeypatch.chdir(world["root"])
    in_place, _ = _stdout_of(["generate", "lora", *PROMPT], capsys)
    monkeypatch.chdir(tmp_path)
    for where in (world["run"], copy):
        out, err = _stdout_of(["generate", str(where), *PROMPT], capsys)
        assert out == in_place
        assert err.endswith(f"; base model: {world['model'].resolve()}\n")


def test_peft_loads_the_adapter_from_another_directory(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    copy = shutil.copytree(world["step"], tmp_path / "adapter")
    config = peft.PeftConfig.from_pretrained(copy)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        config.base_model_name_or_path, attn_implementation="eager", dtype=torch.float32
    )
    theirs = peft.PeftModel.from_pretrained(base, copy)
    with torch.no_grad():
        logits = theirs(input_ids=IDS).logits
    torch.testing.assert_close(logits, world["logits"], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- a moved base


def _adapter_on(base: str, seed: int = 0) -> Path:
    """An adapter (random B, so it changes the output) on the model folder ``base``, spelled
    relative to the working directory, saved in ``adapter/``."""
    model = apply_lora(from_hf(base), target_modules=["q_proj", "v_proj"], rank=4, alpha=8)
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    return save_peft_adapter(model, "adapter", base_model_name_or_path=base)


def _other_model(folder: Path, world) -> Path:
    """A model of the same architecture and vocabulary as the world's, other weights."""
    torch.manual_seed(1)
    vocab = from_hf(world["model"]).spec.vocab_size
    model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab))
    return save_hf_checkpoint(model, folder, source_dir=world["model"])


def test_a_moved_base_is_found_through_the_search_path_and_checked(
    world, tmp_path, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(world["model"], tmp_path / "model")
    adapter = _adapter_on("model").resolve()
    before = _logits(load_checkpoint(adapter).model)
    store = tmp_path / "store"
    store.mkdir()
    shutil.move(tmp_path / "model", store / "model")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    gone = tmp_path / "model"
    with pytest.raises(CheckpointNotFoundError) as err:
        adapter_base(adapter)
    assert str(err.value) == (
        f"{adapter / ADAPTER_CONFIG_NAME}: base model '{gone}' not found (tried {gone}, model, "
        f"{adapter / 'model'}); give the base model's folder (`tunesmith ... --base-dir DIR`, "
        f"or base_dir=DIR), or put it in a folder listed in ${MODEL_PATH_ENV}"
    )

    monkeypatch.setenv(MODEL_PATH_ENV, os.pathsep.join([str(tmp_path / "nothing"), str(store)]))
    assert adapter_base(adapter) == store / "model"
    assert torch.equal(_logits(load_checkpoint(adapter).model), before)

    # A different model at the recorded path is passed over; the search path's is taken.
    _other_model(gone, world)
    assert adapter_base(adapter) == store / "model"
    monkeypatch.delenv(MODEL_PATH_ENV)
    with pytest.raises(CheckpointNotFoundError, match=rf"\(tried {gone} \(other weights\), model,"):
        adapter_base(adapter)

    # --base-dir is used as given, with a warning when its weights are not the recorded ones.
    with caplog.at_level(logging.WARNING):
        assert adapter_base(adapter, gone) == gone
    assert f"--base-dir {gone}: other weights, not those of the base recorded in" in caplog.text


# ----------------------------------------------------------------------------- run folders


@pytest.fixture
def run_with_unfinished(world, tmp_path):
    """A copy of the world's run with an unfinished write (a ``step_000009`` without its
    manifest) and a temp folder of a newer one: neither is ever chosen."""
    run = shutil.copytree(world["run"], tmp_path / "run")
    partial = shutil.copytree(world["step"], run / "checkpoints" / "step_000009")
    (partial / "COMPLETE").unlink()
    shutil.copytree(world["step"], run / "checkpoints" / ".tmp-step_000010-1")
    return run


def test_a_run_folder_means_its_newest_complete_checkpoint(run_with_unfinished):
    newest = run_with_unfinished / "checkpoints" / "step_000003"
    assert resolve_checkpoint(run_with_unfinished) == newest
    assert resolve_checkpoint(run_with_unfinished / "checkpoints") == newest


def test_every_command_that_takes_a_checkpoint_takes_a_run_folder(
    world, run_with_unfinished, tmp_path, monkeypatch, capsys
):
    run = run_with_unfinished
    chosen = f"checkpoint: {run / 'checkpoints' / 'step_000003'} (the newest complete one of {run})"
    base = f"; base model: {world['model'].resolve()}"
    monkeypatch.chdir(tmp_path)

    _, err = _stdout_of(["generate", str(run), *PROMPT], capsys)
    assert err == f"{chosen}{base}\n"

    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    _, err = _stdout_of(["chat", str(run), "--max-new-tokens", "4"], capsys)
    assert err == f"{chosen}{base}\n"

    evaluated = []
    monkeypatch.setattr(
        lm_eval_adapter, "run_lm_eval", lambda loaded, *a, **k: evaluated.append(loaded)
    )
    _, err = _stdout_of(["eval", str(run), "--tasks", "my_task"], capsys)
    assert err == f"{chosen}{base}\n"
    assert evaluated[0].path == run / "checkpoints" / "step_000003"

    out, err = _stdout_of(["export", str(run), "--output-dir", "merged"], capsys)
    assert err == f"{chosen}{base}\n"
    assert out == f"exported {run} to merged\n"
    assert (tmp_path / "merged" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- the demo

TOY = AssetSettings(
    num_train=48,
    num_held_out=4,
    seed=3,
    model={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
)  # fmt: skip


def test_the_demo_prints_the_generate_command_that_gives_its_answer(tmp_path, capsys):
    steps = ["max_steps=60", "batch_size=8", "optimizer.lr=3e-2"]  # answers that differ
    result = run_demo(tmp_path / "demo", settings=TOY, overrides=steps, threads=1)
    lines = capsys.readouterr().out.splitlines()
    command = lines[lines.index(next(x for x in lines if x.startswith("the fine-tuned"))) + 1]
    words = shlex.split(command)
    assert words[:3] == ["tunesmith", "generate", str(tmp_path / "demo" / "sft")]
    assert words[words.index("--system") + 1] == "sort the letters"
    assert words[words.index("--prompt") + 1] == f"sort {result.held_out[0].letters}"
    out, err = _stdout_of(words[1:], capsys)
    assert out == result.replies_after[0] + "\n"
    assert err.startswith(f"checkpoint: {result.checkpoint} ")
    system = words.index("--system")
    without, _ = _stdout_of(words[1:system] + words[system + 2 :], capsys)
    assert without != out  # the system prompt is part of what gives the answer
