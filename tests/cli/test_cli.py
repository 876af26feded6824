"""The `tunesmith` command as a user runs it: the installed console script once, then its
function in a process of its own per command (forked from the suite's fork server,
:mod:`tests.forked`: exit code, stdout and stderr as a subprocess reports them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tunesmith.cli import catalog

ASSETS = Path(__file__).parent / "assets"
ECHO_RECIPE = ASSETS / "echo_recipe.py"
ECHO_CONFIG = ASSETS / "echo.yaml"
SUBCOMMANDS = ["ls", "cp", "cat", "validate", "run", "download", "generate", "export", "plot"]


def tunesmith(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``tunesmith ARGS`` in a process of its own, with ``env`` added to this one's."""
    return forked.run_cli(args, env={**os.environ, **(env or {})}, timeout=timeout)


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "tunesmith"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_every_subcommand_has_help(subcommand):
    result = tunesmith(subcommand, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tunesmith " + subcommand)


def test_ls_lists_every_recipe_and_config():
    result = tunesmith("ls")
    assert result.returncode == 0, result.stderr
    for recipe in catalog.recipe_names():
        line = next(ln for ln in result.stdout.splitlines() if ln.split()[0] == recipe)
        for config in catalog.config_names(recipe):
            assert config in line


def test_cp_copies_a_config_and_refuses_to_overwrite(tmp_path):
    recipe = catalog.recipe_names()[0]
    config = catalog.config_names(recipe)[0]
    dest = tmp_path / "mine.yaml"
    assert tunesmith("cp", f"{recipe}/{config}", str(dest)).returncode == 0
    source = (catalog.CONFIGS_DIR / recipe / f"{config}.yaml").read_text()
    assert dest.read_text() == catalog.recipe_header(recipe) + "\n" + source  # recipe named first
    again = tunesmith("cp", f"{recipe}/{config}", str(dest))
    assert again.returncode == 1 and "--force" in again.stderr
    assert tunesmith("cp", recipe, str(tmp_path)).returncode == 0
    assert (tmp_path / f"{recipe}.py").read_text() == catalog.recipe_path(recipe).read_text()


def test_cat_applies_overrides_and_resolves_interpolation(tmp_path):
    result = tunesmith("cat", str(ECHO_CONFIG), f"base_dir={tmp_path}", "message=a=b", "~steps")
    assert result.returncode == 0, result.stderr
    assert f"output_dir: {tmp_path}/out" in result.stdout
    assert "message: a=b" in result.stdout
    assert "steps" not in result.stdout


def test_validate_ok_and_reports_every_problem_with_its_path():
    ok = tunesmith("validate", str(ECHO_CONFIG))
    assert ok.returncode == 0, ok.stderr
    bad = tunesmith("validate", str(ECHO_CONFIG), "model.in_featres=3", "model.bias=maybe")
    assert bad.returncode == 1
    assert "model.in_featres" in bad.stderr and "in_features" in bad.stderr  # suggestion
    assert "model.bias" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_run_trivial_recipe_in_process(tmp_path):
    result = tunesmith(
        "run",
        str(ECHO_RECIPE),
        "--config",
        str(ECHO_CONFIG),
        f"base_dir={tmp_path}",
        "model.in_features=7",
        "message=x=1",
    )
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "out" / "result.json").read_text())
    assert record == {"message": "x=1", "in_features": 7, "steps": 3}


def test_run_bad_config_writes_nothing_and_prints_one_line(tmp_path):
    result = tunesmith(
        "run",
        str(ECHO_RECIPE),
        "--config",
        str(ECHO_CONFIG),
        f"base_dir={tmp_path}",
        "model._component_=torch.nn.Linearr",
    )
    assert result.returncode == 1
    assert "model" in result.stderr and "torch.nn.Linear" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = tunesmith("--debug", "run", str(ECHO_RECIPE), "--config", str(tmp_path / "no.yaml"))
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_unknown_recipe_is_one_clear_line():
    result = tunesmith("run", "no_such_recipe", "--config", "x")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "unknown recipe 'no_such_recipe'" in result.stderr


def test_run_two_gloo_ranks_through_torchrun(tmp_path):
    config = tmp_path / "dist.yaml"
    config.write_text(f"output_dir: {tmp_path}/out\n")
    result = tunesmith(
        "run",
        str(ASSETS / "allreduce_recipe.py"),
        "--config",
        str(config),
        "--nproc-per-node",
        "2",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in records] == [2, 2]
    assert [r["sum"] for r in records] == [3.0, 3.0]  # 1 + 2 from the two ranks
    assert sorted(r["local_rank"] for r in records) == [0, 1]


def test_download_offline_is_a_clear_error(tmp_path):
    result = tunesmith(
        "download",
        "Qwen/Qwen3-0.6B",
        "--output-dir",
        str(tmp_path / "m"),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 1
    assert "Qwen/Qwen3-0.6B" in result.stderr and "offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_prints_the_greedy_reply_of_the_library(tmp_path):
    import torch

    from tests.recipes.sft_world import make_model_dir
    from tunesmith.data import Tokenizer
    from tunesmith.generation import generate
    from tunesmith.models import from_hf

    model_dir = make_model_dir(tmp_path)
    result = tunesmith(
        "generate", str(model_dir), "--prompt", "add 2 and 3", "--max-new-tokens", "6"
    )
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_pretrained(model_dir)
    ids, _ = tokenizer.tokenize_conversation(
        [{"role": "user", "content": "add 2 and 3"}], add_generation_prompt=True
    )
    with torch.no_grad():
        out = generate(
            from_hf(model_dir), [ids], max_new_tokens=6, stop_token_ids=tokenizer.stop_token_ids
        )
    tokens = [t for t in out.sequences[0] if t not in tokenizer.stop_token_ids]
    assert result.stdout == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"


def test_plot_writes_a_png(tmp_path):
    rows = [{"step": s, "loss": 3.0 / s, "lr": 1e-3} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = tunesmith("plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    png = Path(result.stdout.strip())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = tunesmith("plot", str(tmp_path / "nothing"))
    assert missing.returncode == 1 and "metrics.jsonl" in missing.stderr


def test_export_merges_an_adapter_into_a_plain_checkpoint(tmp_path):
    import torch

    from tests.recipes.sft_world import make_model_dir
    from tunesmith.models import from_hf
    from tunesmith.models.peft_io import save_peft_adapter
    from tunesmith.modules.peft import adapter_modules, apply_lora

    model_dir = make_model_dir(tmp_path)
    model = apply_lora(from_hf(model_dir), target_modules=["q_proj", "v_proj"], rank=4, alpha=8)
    torch.manual_seed(0)
    for layer in adapter_modules(model).values():
        torch.nn.init.normal_(layer.lora_B.weight, std=0.05)  # a non-trivial adapter
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(model_dir))
    out = tmp_path / "merged"
    result = tunesmith("export", str(tmp_path / "adapter"), "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():
        expected, merged = model(ids), from_hf(out)(ids)
    assert not any("lora" in name for name, _ in from_hf(out).named_parameters())
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
