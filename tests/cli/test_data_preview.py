"""`tunesmith data preview`: the config's own dataset, previewed exactly as
:func:`tunesmith.data.preview.preview` renders it; brackets off a terminal, colour on one."""

from __future__ import annotations

import os
import random

import pytest
import yaml

from tests import forked
from tests.recipes.sft_world import make_counting_data, make_model_dir
from tunesmith.cli.data_cmd import use_color
from tunesmith.cli.main import main
from tunesmith.data import DatasetMix, SFTDataset, Tokenizer
from tunesmith.data.preview import TRAINED_COLOR, preview


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_cli")
    model_dir = make_model_dir(root)
    data = make_counting_data(root / "chat.jsonl", rows=12)
    return root, model_dir, data


def _tiny_dataset(model_dir, data):
    """The dataset the shipped sft/tiny config builds (its dataset section, by hand)."""
    tok = Tokenizer.from_pretrained(model_dir)
    ds = SFTDataset(
        tok,
        source=str(data),
        format="messages",
        train_on="assistant",
        max_seq_len=128,
        on_bad_row="skip",
    )
    return tok, ds


def test_preview_of_a_shipped_config_in_a_process_of_its_own(world):
    root, model_dir, data = world
    command = [
        "data", "preview", "--config", "sft/tiny",
        f"model_dir={model_dir}", f"dataset.source={data}", "--n", "2", "--bins", "5",
        f"output_dir={root}/out",  # the config's token cache goes next to it
    ]  # fmt: skip
    result = forked.run_cli(command)  # its output is a file: not a terminal
    assert result.returncode == 0, result.stderr
    tok, ds = _tiny_dataset(model_dir, data)
    assert result.stdout == preview(tok, ds, n=2, bins=5)  # a file: [[brackets]], no colour
    assert "[[" in result.stdout and "\x1b[" not in result.stdout


def test_options_color_and_random(world, capsys):
    root, model_dir, data = world
    args = ["data", "preview", "--config", "sft/tiny", f"model_dir={model_dir}"]
    args += [f"output_dir={root}/out"]
    assert main([*args, f"dataset.source={data}", "--color", "always", "--n", "1"]) == 0
    tok, ds = _tiny_dataset(model_dir, data)
    out = capsys.readouterr().out
    assert out == preview(tok, ds, n=1, color=True) and TRAINED_COLOR in out
    assert main([*args, f"dataset.source={data}", "--random", "--n", "3", "seed=5"]) == 0
    drawn = random.Random(5).sample(range(len(ds)), 3)
    assert capsys.readouterr().out == preview(tok, ds, indices=drawn)


def test_a_mixed_dataset_config(world, capsys):
    root, model_dir, data = world
    text = root / "books.txt"
    text.write_text("the first line\nthe second line\n")
    config = root / "mix.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_dir": "???",
                "seed": 0,
                "tokenizer": {
                    "_component_": "tunesmith.data.Tokenizer.from_pretrained",
                    "folder": "${model_dir}",
                },
                "dataset": {
                    "_component_": "tunesmith.data.DatasetMix",
                    "parts": {
                        "chat": {"source": str(data)},
                        "books": {"source": str(text), "format": "text"},
                    },
                    "epochs": {"chat": 0.5},
                },
            },
            sort_keys=False,  # the parts in this order
        )
    )
    assert main(["data", "preview", "--config", str(config), f"model_dir={model_dir}"]) == 0
    tok = Tokenizer.from_pretrained(model_dir)
    mix = DatasetMix(
        tok,
        parts={"chat": {"source": str(data)}, "books": {"source": str(text), "format": "text"}},
        epochs={"chat": 0.5},
    )
    out = capsys.readouterr().out
    assert out == preview(tok, mix)
    assert out.startswith("mix of 2 parts -> 8 samples (seed 0)\n")


def test_errors_are_one_line(world, capsys):
    root, model_dir, data = world
    out = f"output_dir={root}/out"
    assert main(["data", "preview", "--config", "sft/tiny", f"dataset.source={data}", out]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tunesmith: error: ") and "model_dir" in err and err.count("\n") == 1
    assert (
        main(
            [
                "data",
                "preview",
                "--config",
                "sft/tiny",
                f"model_dir={model_dir}",
                f"dataset.source={data}",
                "--n",
                "0",
                out,
            ]
        )
        == 1
    )
    assert "--n and --bins must be >= 1" in capsys.readouterr().err


def test_help():
    parser_help = forked.run_cli(["data", "preview", "--help"])
    assert parser_help.returncode == 0, parser_help.stderr
    assert parser_help.stdout.startswith("usage: tunesmith data preview")
    for flag in ("--config", "--n", "--random", "--bins", "--color"):
        assert flag in parser_help.stdout


def test_color_auto_follows_the_terminal(monkeypatch):
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            monkeypatch.delenv("NO_COLOR", raising=False)
            assert use_color("auto", tty)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not use_color("auto", tty)
    finally:
        os.close(leader)
        os.close(follower)
    with open(os.devnull, "w") as pipe:
        monkeypatch.delenv("NO_COLOR", raising=False)
        assert not use_color("auto", pipe)
