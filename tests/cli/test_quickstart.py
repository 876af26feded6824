"""The quick start, ``tunesmith sft | dpo | grpo MODEL_DIR DATA``, through the CLI's own
``main`` (in this process) on a tiny model: a run per recipe (SFT full and LoRA, DPO, GRPO with
chosen rewards), ``--print-config`` printing exactly the ``config.yaml`` the run saves, that
file rerun with ``tunesmith run`` to the same weights, a minimal config of yours (model, data,
output) laid over the shipped default, the data format detected from the columns, what wins
over what, ``--nproc-per-node`` handed to ``tunesmith run``'s launcher, and one line for each
mistake."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    checkpoint_weights,
    checkpoints,
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import make_prompts
from tunesmith.cli import catalog, main, quickstart
from tunesmith.cli.main import build_parser
from tunesmith.config.components import resolve_component

# The tiny world's data makes few rows: one per micro-batch, one micro-batch per step.
SMALL = ["batch_size=1", "gradient_accumulation_steps=1", "progress_bar=false"]
SMALL_RL = ["prompts_per_step=2", "group_size=2", "batch_size=4",
            "generation.max_new_tokens=4", "progress_bar=false"]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    return {
        "model": make_model_dir(root),
        "chat": make_chat_data(root / "chat.jsonl", rows=8),
        "pairs": make_preference_data(root / "pairs.jsonl", rows=4),
        "prompts": make_prompts(root / "prompts.jsonl", rows=4),
    }


def _printed(capsys, argv: list[str]) -> str:
    """What ``tunesmith ARGV --print-config`` prints (it must exit 0)."""
    capsys.readouterr()
    code = main.main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _config(capsys, argv: list[str]) -> dict:
    return yaml.safe_load(_printed(capsys, argv))


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("tunesmith: error: ") and "Traceback" not in err, err
    message = err.removeprefix("tunesmith: error: ").rstrip("\n")
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- runs


def test_sft_runs_prints_what_it_saves_and_the_saved_config_reruns_the_same(
    world, tmp_path, capsys
):
    out = tmp_path / "sft"
    argv = ["sft", str(world["model"]), str(world["chat"]), "--output-dir", str(out),
            "--max-steps", "2", *SMALL, "optimizer.lr=1e-3"]  # fmt: skip
    printed = _printed(capsys, argv)
    assert main.main(argv) == 0, capsys.readouterr().err
    console = capsys.readouterr().out
    saved = out / "config.yaml"
    assert f"tunesmith run sft --config {saved} overwrite=true" in console
    assert saved.read_text() == printed  # --print-config is the run's own config.yaml
    cfg = yaml.safe_load(printed)
    assert (cfg["model_dir"], cfg["dataset"]["source"], cfg["output_dir"], cfg["max_steps"]) == (
        str(world["model"]), str(world["chat"]), str(out), 2)  # fmt: skip
    assert cfg["dataset"]["format"] == "messages" and cfg["optimizer"]["lr"] == 1e-3
    first = final_weights(out)
    initial = checkpoint_weights(world["model"])
    assert any(not torch.equal(first[k], initial[k]) for k in initial)  # it trained

    # rerun as the console says: the first run's checkpoints move aside, the weights repeat
    assert main.main(["run", "sft", "--config", str(saved), "overwrite=true"]) == 0
    moved = list(out.glob("overwritten-*/checkpoints"))
    assert len(moved) == 1 and [p.name for p in checkpoints(out)] == ["step_000002"]
    for weights in (checkpoint_weights(moved[0] / "step_000002"), final_weights(out)):
        assert weights.keys() == first.keys()
        assert all(torch.equal(weights[k], first[k]) for k in first)
    rerun = yaml.safe_load(saved.read_text())
    assert {k: v for k, v in rerun.items() if cfg.get(k) != v} == {"overwrite": True}


def test_sft_lora_saves_adapters(world, tmp_path, capsys):
    out = tmp_path / "lora"
    argv = ["sft", str(world["model"]), str(world["chat"]), "--lora", "--output-dir", str(out),
            "--max-steps", "1", *SMALL]  # fmt: skip
    assert main.main(argv) == 0, capsys.readouterr().err
    step = checkpoints(out)[-1]
    assert (step / "adapter_config.json").is_file() and (
        step / "adapter_model.safetensors"
    ).is_file()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["model"]["_component_"] == "tunesmith.modules.peft.apply_lora"
    assert cfg["model"]["target_modules"] == "all-linear"


def test_dpo_runs_on_pairs(world, tmp_path, capsys):
    out = tmp_path / "dpo"
    argv = ["dpo", str(world["model"]), str(world["pairs"]), "--output-dir", str(out),
            "--max-steps", "2", *SMALL]  # fmt: skip
    assert main.main(argv) == 0, capsys.readouterr().err
    assert [p.name for p in checkpoints(out)] == ["step_000002"]
    assert "rewards/accuracy" in read_metrics(out)[2]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["dataset"]["_component_"] == "tunesmith.data.PreferenceDataset"
    assert (cfg["dataset"]["source"], cfg["dataset"]["format"]) == (str(world["pairs"]), "messages")


def test_grpo_runs_with_the_rewards_named(world, tmp_path, capsys):
    out = tmp_path / "grpo"
    argv = ["grpo", str(world["model"]), str(world["prompts"]), "--output-dir", str(out),
            "--max-steps", "1", "--reward", "character_match", "--reward", "think_answer_format",
            "--answer-column", "answer", *SMALL_RL]  # fmt: skip
    assert main.main(argv) == 0, capsys.readouterr().err
    assert [p.name for p in checkpoints(out)] == ["step_000001"]
    logged = read_metrics(out)[1]
    assert {"reward/character_match", "reward/think_answer_format"} <= set(logged)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["rewards"]["rewards"] == {
        "character_match": {"_component_": "tunesmith.rl.rewards.CharacterMatch"},
        "think_answer_format": {"_component_": "tunesmith.rl.rewards.ThinkAnswerFormat"},
    }
    assert cfg["prompts"]["source"] == str(world["prompts"])


def test_a_minimal_config_of_yours_is_laid_over_the_default(world, tmp_path, capsys):
    """model_dir, dataset.source and output_dir are all a config needs; the rest is the
    shipped default's (a missing key of a plain `tunesmith run` config is one line)."""
    mine = tmp_path / "mine.yaml"
    out = tmp_path / "mine"
    mine.write_text(
        f"model_dir: {world['model']}\ndataset:\n  source: {world['chat']}\noutput_dir: {out}\n"
    )
    argv = ["sft", "--config", str(mine), "--max-steps", "1", *SMALL]
    cfg = _config(capsys, argv)
    default = yaml.safe_load(catalog.config_path("default", "sft").read_text())
    assert cfg["loss"] == default["loss"] and cfg["lr_scheduler"] == default["lr_scheduler"]
    assert cfg["dataset"]["max_seq_len"] == default["dataset"]["max_seq_len"]
    assert main.main(argv) == 0, capsys.readouterr().err
    assert [p.name for p in checkpoints(out)] == ["step_000001"]
    # the same file given to `tunesmith run` lacks the recipe's required keys: said up front
    capsys.readouterr()
    assert main.main(["run", "sft", "--config", str(mine)]) == 1
    assert "batch_size: required key is missing" in capsys.readouterr().err


def test_a_config_without_loss_is_refused_before_it_runs(world, tmp_path, capsys):
    tiny = yaml.safe_load(catalog.config_path("tiny", "sft").read_text())
    del tiny["loss"]
    path = tmp_path / "no_loss.yaml"
    path.write_text(yaml.safe_dump(tiny))
    argv = ["run", "sft", "--config", str(path), f"model_dir={world['model']}",
            f"dataset.source={world['chat']}", f"output_dir={tmp_path / 'o'}"]  # fmt: skip
    assert main.main(argv) == 1
    assert _error(capsys) == "loss: required key is missing (a mapping with _component_)"
    assert not (tmp_path / "o").exists()
    # RL recipes have no `loss` (theirs is policy_loss): a stray one is named
    argv = ["validate", "grpo/tiny", f"model_dir={world['model']}",
            f"prompts.source={world['prompts']}",
            "loss={_component_: tunesmith.modules.losses.CrossEntropyLoss}"]  # fmt: skip
    assert main.main(argv) == 1
    assert _error(capsys).startswith("loss: unknown key")


# ----------------------------------------------------------------------------- the config


def _write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FORMAT_ROWS = [
    ("alpaca", {"instruction": "add 1 and 2", "output": "3"}),
    ("prompt_completion", {"prompt": "add 1 and 2", "completion": "3"}),
    (
        "sharegpt",
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "3"}]},
    ),
    ("text", {"text": "one two three"}),
]


@pytest.mark.parametrize(("expected", "row"), FORMAT_ROWS, ids=[f for f, _ in FORMAT_ROWS])
def test_the_format_is_detected_from_the_columns(world, tmp_path, capsys, expected, row):
    data = _write(tmp_path / "data.jsonl", [row, row])
    cfg = _config(capsys, ["sft", str(world["model"]), str(data)])
    assert cfg["dataset"]["format"] == expected


def test_a_csv_file_and_a_column_map_are_detected_too(world, tmp_path, capsys):
    csv = tmp_path / "pc.csv"
    csv.write_text("prompt,completion\nadd 1 and 2,3\n")
    assert _config(capsys, ["sft", str(world["model"]), str(csv)])["dataset"]["format"] == (
        "prompt_completion"
    )
    data = _write(tmp_path / "q.jsonl", [{"question": "add 1 and 2", "response": "3"}])
    argv = ["sft", str(world["model"]), str(data),
            "dataset.column_map={instruction: question, output: response}"]  # fmt: skip
    assert _config(capsys, argv)["dataset"]["format"] == "alpaca"


def test_data_no_format_fits_is_one_line_naming_its_columns(world, tmp_path, capsys):
    data = _write(tmp_path / "odd.jsonl", [{"question": "q", "response": "r"}])
    assert main.main(["sft", str(world["model"]), str(data), "--print-config"]) == 1
    error = _error(capsys)
    assert error.startswith(f"{data}: no sft data format fits its columns ['question', 'response']")
    assert "alpaca: instruction, output" in error and "dataset.column_map=" in error


def test_yours_wins_over_the_detected_format_and_the_arguments_over_your_file(
    world, tmp_path, capsys
):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "model_dir: elsewhere\noutput_dir: from_file\n"
        "optimizer: {_component_: torch.optim.SGD, lr: 0.1}\n"
        "lr_scheduler: {num_warmup_steps: 0}\n"
    )
    argv = ["sft", str(world["model"]), str(world["chat"]), "--config", str(mine),
            "--epochs", "3", "dataset.format=prompt_completion"]  # fmt: skip
    cfg = _config(capsys, argv)
    assert cfg["dataset"]["format"] == "prompt_completion"  # the override, not the detection
    assert cfg["model_dir"] == str(world["model"]) and cfg["epochs"] == 3  # arguments > file
    assert cfg["output_dir"] == "from_file"
    # another _component_ replaces the node; the same one merges key by key
    assert cfg["optimizer"] == {"_component_": "torch.optim.SGD", "lr": 0.1}
    default = yaml.safe_load(catalog.config_path("default", "sft").read_text())
    assert cfg["lr_scheduler"] == {**default["lr_scheduler"], "num_warmup_steps": 0}


def test_nproc_per_node_goes_to_the_run_launcher(world, tmp_path, capsys, monkeypatch):
    launched = []

    def fake_torchrun(args, cfg, recipe_file, config_file):
        launched.append((args.nproc_per_node, recipe_file.name, config_file.read_text()))
        return 0

    monkeypatch.setattr(main, "_run_torchrun", fake_torchrun)
    argv = ["sft", str(world["model"]), str(world["chat"]), "--output-dir", str(tmp_path / "o")]
    printed = _config(capsys, argv)
    assert main.main([*argv, "--nproc-per-node", "2"]) == 0, capsys.readouterr().err
    [(nproc, recipe, text)] = launched
    assert (nproc, recipe) == (2, "sft.py")
    assert text.startswith(catalog.recipe_header("sft") + "\n")
    from omegaconf import OmegaConf

    from tunesmith.config import plain_config

    assert plain_config(OmegaConf.create(yaml.safe_load(text))) == printed


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["sft", "--max-steps", "1"],
            "tunesmith sft needs MODEL_DIR (a Hugging Face model folder)",
        ),
        (["grpo", "m"], "tunesmith grpo needs DATA (prompts (a prompt or messages column)"),
        (["dpo", "m", "d.jsonl", "extra"], "tunesmith dpo takes MODEL_DIR and DATA, then"),
        (
            ["sft", "m", "d.jsonl", "--config", "dpo/tiny"],
            "--config dpo/tiny is a config of recipe 'dpo'",
        ),
    ],
)
def test_a_mistake_is_one_line(capsys, argv, expected):
    assert main.main([*argv, "--print-config"]) == 1
    assert _error(capsys).startswith(expected)


def test_the_quick_start_commands_parse_like_run():
    args = build_parser().parse_args(["grpo", "m", "p.jsonl", "seed=1", "--reward", "math_answer",
                                      "--nproc_per_node", "2"])  # fmt: skip
    assert (args.quick.name, args.reward, args.nproc_per_node) == ("grpo", ["math_answer"], 2)
    assert quickstart.split_words(args.overrides) == (["m", "p.jsonl"], ["seed=1"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["grpo", "m", "p.jsonl", "--epochs", "2"])  # no epochs in RL


@pytest.mark.parametrize("name", quickstart.REWARDS)
def test_every_reward_choice_is_the_built_in_reward_of_that_name(name):
    reward = resolve_component(quickstart.REWARDS[name])()  # no argument needed
    assert reward.name == name
