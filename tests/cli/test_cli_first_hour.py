"""The first commands a new user types, and the mistakes they make, through the CLI's own
``main`` (in this process): a copied config knows its recipe, ``cat`` shows what is still to
be given, a misspelt recipe or a config of another recipe gets one line that says what to
type, a Hub id where a folder belongs says how to download it, ``max_steps=1`` runs on a
config with warmup, and a parallel layout that does not fit the world is refused before any
rank starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.sft_world import make_counting_data, make_model_dir, sft_overrides
from tunesmith.cli import catalog
from tunesmith.cli.main import build_parser, main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    return make_model_dir(root), make_counting_data(root / "data.jsonl", rows=8)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("tunesmith: error: ") and "Traceback" not in err, err
    return err.removeprefix("tunesmith: error: ").rstrip("\n")


def test_cp_writes_the_recipe_first_and_keeps_the_config(tmp_path, capsys):
    dest = tmp_path / "my_sft.yaml"
    assert main(["cp", "sft/tiny", str(dest)]) == 0
    first, rest = dest.read_text().split("\n", 1)
    assert first == catalog.recipe_header("sft") and first.startswith("# recipe: sft ")
    assert rest == (catalog.CONFIGS_DIR / "sft" / "tiny.yaml").read_text()
    assert catalog.recipe_of_config(dest) == "sft"


def test_validate_of_a_copied_config_knows_the_recipe_arguments(world, tmp_path, capsys):
    """Without the recipe, the optimizer's params, the dataset's tokenizer and the schedule's
    optimizer / num_training_steps (all passed by the recipe) would be reported missing."""
    model_dir, data = world
    dest = tmp_path / "my_sft.yaml"
    main(["cp", "sft/tiny", str(dest)])
    capsys.readouterr()
    assert main(["validate", str(dest), f"model_dir={model_dir}", f"dataset.source={data}"]) == 0
    assert capsys.readouterr().out == (
        "my_sft.yaml: OK\n  model: native backend (qwen2 is a native family)\n"
    )
    # no values given: only the two `???` are named, not the interpolations that use them
    assert main(["validate", str(dest)]) == 1
    assert _error(capsys).splitlines() == [
        "model_dir: value is missing (???); set it in the config or with an override",
        "dataset.source: value is missing (???); set it in the config or with an override",
    ]


def test_validate_infers_the_recipe_of_a_config_without_its_line(world, tmp_path, capsys):
    model_dir, data = world
    plain = tmp_path / "plain.yaml"
    plain.write_text((catalog.CONFIGS_DIR / "sft" / "tiny.yaml").read_text())
    assert main(["validate", str(plain), f"model_dir={model_dir}", f"dataset.source={data}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plain.yaml: OK (recipe sft, inferred from its keys"), out
    # a DPO config's own keys make it DPO's
    dpo = tmp_path / "pairs.yaml"
    dpo.write_text((catalog.CONFIGS_DIR / "dpo" / "tiny.yaml").read_text())
    assert main(["validate", str(dpo), f"model_dir={model_dir}", f"dataset.source={data}"]) == 0
    assert "(recipe dpo, inferred" in capsys.readouterr().out


def test_a_recipe_line_naming_no_recipe_is_one_clear_line(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("# recipe: stf\nseed: 0\n")
    assert main(["validate", str(config)]) == 1
    error = _error(capsys)
    assert "\n" not in error and "`# recipe: stf`" in error and "sft" in error


def test_cat_shows_unresolved_values_as_written(tmp_path, capsys):
    dest = tmp_path / "my_sft.yaml"
    main(["cp", "sft/tiny", str(dest)])
    capsys.readouterr()
    assert main(["cat", str(dest), "optimizer.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    for line in (
        "model_dir: ???",
        "  folder: ${model_dir}",
        "  path: ${model_dir}",
        "  lr: 0.0001",
        "  log_dir: outputs/sft-tiny",
    ):
        assert line in out.splitlines(), (line, out)
    assert main(["cat", "sft/tiny"]) == 0
    assert "  folder: ${model_dir}" in capsys.readouterr().out.splitlines()


def test_cat_resolves_what_it_can_and_never_shows_an_environment_value(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("H3_SECRET", "s3cr3t")
    config = tmp_path / "c.yaml"
    config.write_text("a: 1\nb: ${a}\nkey: ${oc.env:H3_SECRET}\nc: ${nope}\nd: ${d}\n")
    assert main(["cat", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ["a: 1", "b: 1", "key: ${oc.env:H3_SECRET}", "c: ${nope}", "d: ${d}"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "stf", "--config", "tiny"], "unknown recipe 'stf' (did you mean 'sft'?)"),
        (
            ["run", "sft", "--config", "tny"],
            "unknown config 'tny' of recipe 'sft' (did you mean 'tiny'?)",
        ),
        (["validate", "sft/tyni"], "unknown config 'sft/tyni' (did you mean 'sft/tiny'?)"),
        (
            ["run", "sft", "--config", "dpo/tiny"],
            "config 'dpo/tiny' is for recipe 'dpo', not 'sft': "
            "run `tunesmith run dpo --config dpo/tiny`",
        ),
    ],
)
def test_a_misspelt_or_mismatched_name_says_what_to_type(capsys, argv, expected):
    assert main(argv) == 1
    error = _error(capsys)
    assert "\n" not in error and error.startswith(expected), error


def test_a_copied_config_is_refused_under_another_recipe(tmp_path, capsys):
    dest = tmp_path / "my_dpo.yaml"
    main(["cp", "dpo/tiny", str(dest)])
    capsys.readouterr()
    assert main(["run", "sft", "--config", str(dest)]) == 1
    assert _error(capsys).startswith(f"config '{dest}' is for recipe 'dpo', not 'sft'")


def test_a_hub_id_as_model_dir_says_how_to_download_it(world, tmp_path, capsys, monkeypatch):
    _, data = world
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["run", "sft", "--config", "tiny", "model_dir=Qwen/Qwen3-0.6B", f"dataset.source={data}",
            f"output_dir={out}"]  # fmt: skip
    assert main(argv) == 1
    assert _error(capsys) == (
        "model_dir 'Qwen/Qwen3-0.6B' is not a local folder; models are read from local folders: "
        "if it is a Hub id, download it first with `tunesmith download Qwen/Qwen3-0.6B` (it "
        "writes models/Qwen3-0.6B), then give model_dir=models/Qwen3-0.6B"
    )
    assert not out.exists()
    # a local path whose first folder exists is a path, not a Hub id: the loader's own error
    (tmp_path / "models").mkdir()
    argv[4] = "model_dir=models/Qwen3-0.6B"
    assert main(argv) == 1
    assert "tunesmith download" not in _error(capsys)


def test_a_missing_model_dir_is_one_line(world, tmp_path, capsys):
    _, data = world
    argv = ["run", "sft", "--config", "tiny", f"dataset.source={data}", f"output_dir={tmp_path}/o"]
    assert main(argv) == 1
    assert _error(capsys) == (
        "model_dir: value is missing (???); set it in the config or with an override"
    )


def test_max_steps_1_runs_with_the_default_warmup(world, tmp_path, capsys):
    """sft/tiny warms up over 2 steps: a 1-step run is all warmup. Its one update has the
    learning rate 1e-3 * 0 / 2 = 0 (step 0 of a warmup has none, as in transformers), so with
    no weight decay the checkpoint holds the initial weights exactly."""
    model_dir, data = world
    out = tmp_path / "out"
    argv = ["run", "sft", "--config", "tiny", *sft_overrides(model_dir, data, out, "max_steps=1")]
    assert main(argv) == 0, capsys.readouterr().err
    trained = load_file(out / "checkpoints" / "step_000001" / "model.safetensors")
    initial = load_file(model_dir / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert all(torch.equal(trained[k], initial[k]) for k in initial)


def test_torchrun_spellings_of_the_launch_flags_are_accepted():
    args = build_parser().parse_args(
        [
            "run",
            "sft",
            "--config",
            "tiny",
            "--nproc_per_node",
            "2",
            "--node_rank",
            "0",
            "--nnodes",
            "2",
            "--rdzv_endpoint",
            "h:1",
        ]
    )
    assert (args.nproc_per_node, args.node_rank, args.rdzv_endpoint) == (2, 0, "h:1")


def test_a_layout_that_does_not_fit_the_world_is_refused_before_launching(world, tmp_path, capsys):
    model_dir, data = world
    out = tmp_path / "out"
    layout = ["--nproc_per_node", "4", "parallelism.dp_replicate=2", "parallelism.dp_shard=3"]
    argv = ["run", "sft", "--config", "tiny", *sft_overrides(model_dir, data, out), *layout]
    assert main(argv) == 1
    assert _error(capsys) == (
        "parallelism: dp_replicate 2 x dp_shard 3 x cp 1 x tp 1 = 6 rank(s), but the world has "
        "4: make the product 4, or set dp_shard: auto"
    )
    assert not out.exists()  # not even the log folder


@pytest.mark.parametrize(
    "repo_id",
    [
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "Qwen/Qwen3-30B-A3B",
        "meta-llama/Llama-3.2-1B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
        "google/gemma-3-1b-it",
        "allenai/OLMo-2-0425-1B-Instruct",
        "HuggingFaceTB/SmolLM3-3B",
        "microsoft/Phi-4-mini-instruct",
    ],
)
def test_download_writes_where_the_shipped_configs_read(repo_id):
    """`tunesmith download REPO` (no --output-dir) writes the folder a shipped config's
    model_dir names (the README downloads, then runs the configs as shipped)."""
    from tunesmith.cli.main import download_dir
    from tunesmith.config import load_config

    model_dirs = {
        str(load_config(catalog.config_path(c, r)).get("model_dir"))
        for r in catalog.recipe_names()
        for c in catalog.config_names(r)
    }
    assert str(download_dir(repo_id)) in model_dirs
