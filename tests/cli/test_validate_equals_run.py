"""`tunesmith validate` refuses what `tunesmith run` refuses, with the same first line, and
`run` refuses it before the recipe starts (before any tokenising or model loading): a table of
broken configs (overrides of shipped configs pointed at a tiny local world), each run through
both commands of the CLI's own ``main`` in this process. ``run`` reaching the recipe is a
failure of its own (a tripwire in place of the recipe says so).

Every case also names what its first line must contain (the key, the file, the choices), and
the required keys of each recipe come from the recipe's own rules, not from a list here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import make_counting_data, make_model_dir
from tests.rl.rl_world import make_prompts
from tunesmith.cli import catalog
from tunesmith.cli.main import main
from tunesmith.recipes import Recipe
from tunesmith.recipes import catalog as recipe_catalog

# (recipe/config, overrides, what the first error line contains). NOWHERE is a folder (or
# file) that does not exist; DATA a file that is no model folder; EMPTY a folder holding
# nothing.
CASES: list[tuple[str, list[str], str]] = [
    # files and folders
    ("sft/tiny", ["model_dir=NOWHERE"], "tokenizer.folder: NOWHERE: no such tokenizer folder"),
    ("sft/tiny", ["model_dir=Qwen/Qwen3-0.6B"], "model_dir 'Qwen/Qwen3-0.6B' is not a local"),
    ("sft/tiny", ["dataset.source=NOWHERE.jsonl"], "dataset.source: NOWHERE.jsonl: no such file"),
    ("sft/tiny", ["tokenizer.folder=EMPTY"], "tokenizer.folder: EMPTY/tokenizer.json: missing"),
    ("sft/tiny", ["model.path=EMPTY"], "model.path: EMPTY/config.json not found"),
    ("sft/tiny", ["model.path=DATA"], "model.path: DATA: no such model folder"),
    ("dpo/tiny", ["dataset.source=NOWHERE.jsonl"], "dataset.source: NOWHERE.jsonl: no such"),
    ("kd/tiny", ["teacher_dir=NOWHERE"], "NOWHERE: no such model folder"),
    ("grpo/tiny", ["prompts.source=NOWHERE.jsonl"], "prompts.source: NOWHERE.jsonl: no such"),
    # choices of the built-in components, read from their signatures
    ("sft/tiny", ["dataset.format=mesages"], "dataset.format: expected one of 'messages'"),
    ("sft/tiny", ["dataset.train_on=assistent"], "did you mean 'assistant'?"),
    ("sft/tiny", ["dataset.truncation=rigth"], "dataset.truncation: expected one of 'right'"),
    ("sft/tiny", ["dataset.on_bad_row=skipp"], "dataset.on_bad_row: expected one of 'error'"),
    ("sft/tiny", ["dataset.prompt_style=alpacca"], "dataset.prompt_style: expected one of"),
    ("sft/tiny", ["dataset.text_sample_by=lines"], "did you mean 'line'?"),
    ("sft/tiny", ["model.dtype=float33"], "model.dtype: unknown dtype 'float33'"),
    ("sft/tiny", ["model.backend=nativ"], "model.backend: expected one of 'auto', 'native'"),
    ("sft/tiny_lora", ["model.adapter_dtype=bf17"], "model.adapter_dtype: unknown dtype"),
    ("sft/tiny_lora", ["model.quantize_base=nf5"], "model.quantize_base: quantize_base='nf5'"),
    ("dpo/tiny", ["dataset.truncation=keep"], "dataset.truncation: expected one of 'keep_end'"),
    ("dpo/tiny", ["dataset.format=pairs"], "dataset.format: expected one of 'messages'"),
    ("kd/tiny", ["loss.kind=forwad"], "loss.kind: expected one of 'forward'"),
    ("grpo/tiny", ["policy_loss.aggregation=tokn_mean"], "did you mean 'token_mean'?"),
    ("grpo/tiny", ["policy_loss.ratio=seq"], "policy_loss.ratio: expected one of 'token'"),
    ("grpo/tiny", ["rewards.rewards.correct.extract=autoo"], "did you mean 'auto'?"),
    ("grpo/tiny", ["prompts.on_bad_row=skp"], "prompts.on_bad_row: expected one of 'error'"),
    # arguments and components
    ("sft/tiny", ["dataset.sorce=x.jsonl"], "dataset.sorce: unknown argument"),
    ("sft/tiny", ["optimizer.lrr=0.1"], "did you mean 'lr'?"),
    ("sft/tiny", ["optimizer.lr=abc"], "optimizer.lr: expected float"),
    ("sft/tiny", ["dataset.max_seq_len=long"], "dataset.max_seq_len: expected int or None"),
    ("sft/tiny", ["loss._component_=tunesmith.modules.losses.CrossEntropyLos"], "CrossEntropyLos"),
    ("sft/tiny", ["optimizer._component_=torch.load"], "component 'torch.load' is not allowed"),
    ("sft/tiny", ["model.trust_remote_code=true"], "trust_remote_code=true would run Python"),
    ("sft/tiny", ["output_dir=${nowhere}"], "output_dir"),
    # the recipe's own keys and values
    ("sft/tiny", ["batch_sise=4"], "batch_sise: unknown key; did you mean 'batch_size'?"),
    ("sft/tiny", ["batch_size=0"], "batch_size: expected an int >= 1, got 0"),
    ("sft/tiny", ["shuffle=maybe"], "shuffle: expected true or false"),
    ("sft/tiny", ["max_steps=-1"], "max_steps: expected an int >= 1"),
    ("sft/tiny", ["on_nonfinite_loss=STOP"], "on_nonfinite_loss: expected one of 'stop'"),
    ("sft/tiny", ["attention_backend=ring"], "attention_backend: expected one of 'auto'"),
    ("sft/tiny", ["gradient_accumulation_steps=0"], "gradient_accumulation_steps: expected"),
    ("sft/tiny", ["packed=yes please"], "packed: expected true or false"),
    ("dpo/tiny", ["batch_size=-2"], "batch_size: expected an int >= 1"),
    ("grpo/tiny", ["group_size=0"], "group_size: expected an int >= 1"),
    ("grpo/tiny", ["generation.temperature=0"], "temperature must be > 0 for RL sampling"),
]

CONFIGS = sorted({config for config, _, _ in CASES})


def _required_cases() -> list[tuple[str, list[str], str]]:
    """``~key`` for every key the recipe of a tested config declares required (its rules)
    and the config sets, unless another value of the config refers to it (``${key}``): that
    one's first problem is the reference, which the table above covers."""
    cases = []
    for config in CONFIGS:
        text = catalog.config_path(config).read_text()
        rules = Recipe.load(catalog.recipe_path(config.split("/")[0])).rules
        for key, rule in rules.items():
            referred = re.search(r"\$\{" + re.escape(key) + r"[}.]", text)
            if rule.required and re.search(rf"^{key}:", text, re.MULTILINE) and not referred:
                cases.append((config, [f"~{key}"], f"{key}: required key is missing"))
    return cases


REQUIRED_CASES = _required_cases()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("validate_equals_run")
    (root / "empty").mkdir()
    return {
        "model": make_model_dir(root),
        "chat": make_counting_data(root / "chat.jsonl", rows=4),
        "pairs": make_preference_data(root / "pairs.jsonl", rows=4),
        "prompts": make_prompts(root / "prompts.jsonl", rows=4),
        "empty": root / "empty",
        "nowhere": root / "nowhere",
    }


@pytest.fixture()
def tripwire(monkeypatch, world):
    """Runs here refuse before the recipe starts, or say that they did not; the working
    folder is the world's (no `Qwen/` folder next to it)."""

    def reached(recipe_file, cfg):
        raise AssertionError(f"run reached the recipe {Path(recipe_file).stem}")

    monkeypatch.setattr(recipe_catalog, "run_recipe", reached)
    monkeypatch.chdir(world["empty"])


def _fills(config: str, world: dict[str, Path]) -> list[str]:
    """The `???` values of ``config`` (and its output folder), from the world."""
    recipe = config.split("/")[0]
    data = {"dpo": world["pairs"], "grpo": world["prompts"]}.get(recipe, world["chat"])
    source = "prompts.source" if recipe == "grpo" else "dataset.source"
    fills = [f"model_dir={world['model']}", f"{source}={data}", "progress_bar=false"]
    fills.append(f"output_dir={world['empty'] / 'out'}")
    return fills + ([f"teacher_dir={world['model']}"] if recipe == "kd" else [])


def _placed(text: str, world: dict[str, Path]) -> str:
    for name in ("NOWHERE", "EMPTY", "DATA"):
        key = {"NOWHERE": "nowhere", "EMPTY": "empty", "DATA": "chat"}[name]
        text = text.replace(name, str(world[key]))
    return text


def _first_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, (argv, err)
    return err.splitlines()[0]


def test_the_table_is_large_enough():
    assert len(CASES) + len(REQUIRED_CASES) >= 40
    assert {"sft/tiny", "dpo/tiny", "kd/tiny", "grpo/tiny"} <= set(CONFIGS)
    # each recipe's declaration reaches the table: loss for sft, policy_loss for grpo
    required = {(config, tuple(o)) for config, o, _ in REQUIRED_CASES}
    assert ("sft/tiny", ("~loss",)) in required and ("grpo/tiny", ("~policy_loss",)) in required


@pytest.mark.parametrize("config", CONFIGS)
def test_the_unbroken_configs_pass_both(config, world, tripwire, capsys):
    """The base of every case is sound: validate says OK and run gets as far as the recipe."""
    fills = _fills(config, world)
    assert main(["validate", config, *fills]) == 0, capsys.readouterr().err
    recipe, name = config.split("/")
    assert _first_line(capsys, ["run", recipe, "--config", name, *fills]) == (
        f"tunesmith: error: run reached the recipe {recipe}"
    )


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    CASES + REQUIRED_CASES,
    ids=[f"{c}:{' '.join(o)}" for c, o, _ in CASES + REQUIRED_CASES],
)
def test_validate_and_run_refuse_with_the_same_first_line(
    config, overrides, expected, world, tripwire, capsys
):
    argv = [*_fills(config, world), *(_placed(o, world) for o in overrides)]
    recipe, name = config.split("/")
    validated = _first_line(capsys, ["validate", config, *argv])
    ran = _first_line(capsys, ["run", recipe, "--config", name, *argv])
    assert validated == ran
    assert validated.startswith("tunesmith: error: ")
    assert _placed(expected, world) in validated, validated


# ----------------------------------------------------------------------------- data preview


def _error_lines(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 1, argv
    return capsys.readouterr().err.splitlines()


def test_data_preview_names_missing_values_as_validate_does(world, tripwire, capsys):
    """No value given: both list the same `???` values, `model_dir` (which only the
    tokenizer's folder refers to) included, in the same words and order."""
    validated = _error_lines(capsys, ["validate", "sft/tiny"])
    previewed = _error_lines(capsys, ["data", "preview", "--config", "sft/tiny"])
    assert validated == previewed
    assert validated == [
        "tunesmith: error: model_dir: value is missing (???); set it in the config or with an "
        "override",
        "dataset.source: value is missing (???); set it in the config or with an override",
    ]
    # and a broken choice of the dataset, before any row is read
    argv = [f"model_dir={world['model']}", f"dataset.source={world['chat']}"]
    choice = ["dataset.format=mesages"]
    assert _error_lines(capsys, ["data", "preview", "--config", "sft/tiny", *argv, *choice]) == (
        _error_lines(capsys, ["validate", "sft/tiny", *argv, *choice])
    )


# ----------------------------------------------------------------------------- hints and rows


def _bad_rows(path: Path) -> Path:
    """Two good conversations, a blank line, one with no assistant reply (line 4)."""
    good = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    )
    bad = '{"messages": [{"role": "user", "content": "hi"}]}'
    path.write_text(f"{good}\n{good}\n\n{bad}\n")
    return path


def test_skip_and_error_name_the_same_line(world, tmp_path, capsys):
    """One convention: the 1-based line, in the skipped-rows report and in the error; the
    error's hint is the override of the command line."""
    data = _bad_rows(tmp_path / "bad.jsonl")
    argv = ["data", "preview", "--config", "sft/tiny", f"model_dir={world['model']}"]
    argv.append(f"dataset.source={data}")
    assert main([*argv, "dataset.on_bad_row=skip", "--color", "never"]) == 0
    assert "skipped 1 x no_assistant_turn (lines 4;" in capsys.readouterr().out
    [line] = _error_lines(capsys, [*argv, "dataset.on_bad_row=error"])
    assert f"{data}: bad row at line 4: no_assistant_turn: " in line, line
    assert line.endswith("(set `dataset.on_bad_row=skip` to skip and count such rows)"), line


def test_hints_are_the_overrides_of_the_command_line(world, tmp_path, capsys):
    """A hint names the component's own argument as Python writes it; built from a config, it
    is the override a command line takes (the component's path, YAML values)."""
    from omegaconf import OmegaConf

    from tunesmith.config import ConfigError, instantiate
    from tunesmith.data import DataError
    from tunesmith.rl.prompts import PromptDataset

    prompts = tmp_path / "no_answers.jsonl"
    prompts.write_text('{"prompt": "add 1 and 2"}\n')
    with pytest.raises(DataError, match=r"set `answer_column=None` for data without answers"):
        PromptDataset(str(prompts))
    cfg = OmegaConf.create({"prompts": {"_component_": "tunesmith.rl.prompts.PromptDataset"}})
    cfg.prompts.source = str(prompts)
    with pytest.raises(ConfigError, match=r"set `prompts.answer_column=null` for data without"):
        instantiate(cfg.prompts)
    # a column the format needs, under another name: the mapping one key at a time
    other = tmp_path / "conversations.jsonl"
    other.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    argv = ["data", "preview", "--config", "sft/tiny", f"model_dir={world['model']}"]
    [line] = _error_lines(capsys, [*argv, f"dataset.source={other}"])
    assert line.endswith(
        "to read it from another column set `dataset.column_map.messages=<column>`"
    )
