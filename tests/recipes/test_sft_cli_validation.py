"""The command line checks an SFT config before anything runs: `tunesmith validate tiny` names
the values the user must supply, and `tunesmith run` stops on a misspelt key, with a
suggestion, before it writes anything."""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import make_chat_data, make_model_dir, sft_overrides
from tunesmith.cli.main import main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=8)


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert err.startswith("tunesmith: error: ") and "Traceback" not in err, err
    return err.removeprefix("tunesmith: error: ").splitlines()


def test_validate_names_the_missing_required_values(capsys):
    assert main(["validate", "sft/tiny"]) == 1
    errors = _errors(capsys)
    for path in ("model_dir", "dataset.source"):
        assert any(e.startswith(f"{path}: value is missing (???)") for e in errors), errors


def test_validate_accepts_the_config_once_they_are_given(world, tmp_path, capsys):
    model_dir, data = world
    assert main(["validate", "sft/tiny", *sft_overrides(model_dir, data, tmp_path / "out")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tiny.yaml: OK",
        "  model: native backend (qwen2 is a native family)",
    ]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("bach_size=4", "bach_size: unknown key; did you mean 'batch_size'?"),  # the recipe's
        (
            "optimizer.lrr=0.1",
            "optimizer.lrr: unknown argument of torch.optim.AdamW; did you mean 'lr'?",
        ),  # a component's
    ],
)
def test_run_with_a_misspelt_key_fails_before_writing_anything(
    world, tmp_path, capsys, override, expected
):
    model_dir, data = world
    out = tmp_path / "out"
    argv = ["run", "sft", "--config", "tiny", *sft_overrides(model_dir, data, out, override)]
    assert main(argv) == 1
    assert expected in _errors(capsys)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
