"""The loop's config keys: every value checked up front (type, range, choices), in `validate`
and at run start; a resume with a changed config refused naming the keys, unless they may
change, and a new schedule length applied exactly; secrets from the environment never written;
the samples an epoch leaves out reported."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    make_chat_data,
    make_model_dir,
    read_metrics,
    recipe_config,
    run_config,
    run_sft,
)
from tunesmith.cli import catalog
from tunesmith.cli.main import main
from tunesmith.config import ConfigError, load_config, plain_config
from tunesmith.recipes import Recipe
from tunesmith.training import JSONLLogger, StdoutLogger, cosine_with_warmup
from tunesmith.training.loop import LOOP_KEYS, dropped_per_epoch, make_loader
from tunesmith.training.loop_config import (
    RECORD_KEY,
    RunRecord,
    check_resume,
    config_changes,
    read_record,
)
from tunesmith.training.lr_schedules import schedule_params, set_schedule_params
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import LOOP_RULES, RESUMABLE_KEYS

SHIPPED = [(r, c) for r in catalog.recipe_names() for c in catalog.config_names(r)]
SECRET_ENV = "TUNESMITH_TEST_SECRET_DIR"


# ----------------------------------------------------------------------------- the rules


def _issues(**values) -> list[str]:
    return [str(i) for i in check_rules(OmegaConf.create(values), LOOP_RULES) if i.path in values]


def test_every_loop_key_has_a_rule():
    assert set(LOOP_KEYS) == set(LOOP_RULES)
    model_keys = {"activation_checkpointing", "compile", "attention_backend"}
    from tunesmith.rl.settings import ASYNC_RULES  # asynchronous RL's worker keys

    assert set(LOOP_KEYS) | model_keys | set(ASYNC_RULES) >= RESUMABLE_KEYS


@pytest.mark.parametrize(("recipe", "config"), SHIPPED)
def test_shipped_configs_keep_their_rules(recipe, config):
    cfg = load_config(catalog.config_path(config, recipe))
    declared = Recipe.load(catalog.recipe_path(recipe))
    issues = [i for i in check_rules(cfg, declared.rules) if "value is missing" not in i.message]
    assert not issues, "\n".join(map(str, issues))


BAD = [  # key, value, words of the one line
    ("max_grad_norm", -1, "max_grad_norm: expected a number > 0, or null (no clipping), got -1"),
    ("max_grad_norm", 0, "got 0"),
    ("max_grad_norm", float("nan"), "got nan"),
    ("on_nonfinite_loss", "STOP", "expected one of 'stop', 'skip', got 'STOP'"),
    ("max_steps", 0, "max_steps: expected an int >= 1, or null (epochs decide), got 0"),
    ("max_steps", 2.5, "got 2.5"),
    ("save_every_n_steps", 0, "save_every_n_steps: expected an int >= 1"),
    ("stop_after_steps", -1, "stop_after_steps: expected an int >= 1, or null"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps: expected an int >= 1"),
    ("seed", "abc", "seed: expected an int >= 0, got 'abc' (a string)"),
    ("seed", True, "got true (a boolean)"),
    ("batch_size", 4.0, "batch_size: expected an int >= 1, got 4.0"),
    ("epochs", 0, "epochs: expected an int >= 1"),
    ("mixed_precision", "fp8", "expected one of 'bf16', 'fp16', or null (full precision)"),
    ("device", "gpu", "device: expected one of 'auto', 'cpu', 'cuda', got 'gpu'"),
    ("shuffle", "true", "got 'true' (a string: write true or false, unquoted)"),
    ("progress_bar", 1, "progress_bar: expected true, false or auto"),
    ("val_fraction", 1.0, "val_fraction: expected a number >= 0 and < 1, got 1.0"),
    ("keep_last", 0, "keep_last: expected an int >= 1, or null (keep every checkpoint)"),
    ("log_every_n_steps", None, "log_every_n_steps: expected an int >= 1, got null"),
    ("eval_every_n_steps", -2, "eval_every_n_steps: expected an int >= 1"),
    (
        "resume",
        "",
        "resume: expected true, false (or null), auto (resume when there is a "
        "checkpoint) or a checkpoint folder, got ''",
    ),
    ("resume", 3, "got 3"),
    ("distributed_timeout_s", 0, "expected a number of seconds > 0"),
    ("optimizer", "adamw", "optimizer: expected a mapping with _component_"),
    ("metric_loggers", [{"log_dir": "x"}], "expected a list of mappings with _component_"),
    ("output_dir", "", "output_dir: expected a non-empty string"),
    ("overwrite", "yes", "overwrite: expected true or false"),
    ("optimizer_in_backward", None, "optimizer_in_backward: expected true or false, got null"),
]


@pytest.mark.parametrize(("key", "value", "words"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_value_is_one_line_naming_key_value_and_what_is_allowed(key, value, words):
    issues = _issues(**{key: value})
    assert len(issues) == 1 and words in issues[0], issues


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_grad_norm", None),
        ("max_grad_norm", float("inf")),
        ("max_grad_norm", 1),
        ("max_steps", None),
        ("seed", 0),
        ("mixed_precision", None),
        ("resume", "out/step_1"),
        ("resume", True),
        ("resume", None),
        ("val_fraction", 0),
        ("distributed_timeout_s", 1.5),
        ("device", "cpu"),
    ],
)
def test_good_values_pass(key, value):
    assert _issues(**{key: value}) == []


def test_yaml_yes_is_a_boolean_and_every_problem_is_listed():
    cfg = OmegaConf.create("shuffle: yes\nseed: abc\nmax_steps: 0\nbatch_size: ???\n")
    issues = {i.path: i.message for i in check_rules(cfg, LOOP_RULES)}
    assert "shuffle" not in issues  # YAML 1.1 reads `yes` as true
    assert issues["seed"].startswith("expected an int") and issues["max_steps"].endswith("got 0")
    assert issues["batch_size"].startswith("value is missing")
    assert issues["output_dir"] == "required key is missing (a non-empty string)"


@pytest.mark.parametrize("available", [False, True])
def test_cuda_is_refused_only_where_there_is_none(monkeypatch, available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    issues = _issues(device="cuda")
    assert issues == (
        []
        if available
        else [
            "device: got 'cuda', but this machine has no CUDA device "
            "(torch.cuda.is_available() is false); use auto or cpu"
        ]
    )


def test_recipe_keys_have_rules_too():
    sft, dpo, kd = (Recipe.load(catalog.recipe_path(r)).rules for r in ("sft", "dpo", "kd"))
    assert check_rules(OmegaConf.create({"packed": "no"}), {"packed": sft["packed"]})
    assert check_rules(
        OmegaConf.create({"logprob_chunk_size": 0}),
        {"logprob_chunk_size": dpo["logprob_chunk_size"]},
    )
    [issue] = check_rules(OmegaConf.create({"kd_ratio": 1.5}), {"kd_ratio": kd["kd_ratio"]})
    assert str(issue) == "kd_ratio: expected a number >= 0 and <= 1, got 1.5"


def test_validate_runs_the_same_check(capsys, tmp_path):
    model_dir, data = make_model_dir(tmp_path), make_chat_data(tmp_path / "d.jsonl", rows=2)
    fills = [f"model_dir={model_dir}", f"dataset.source={data}"]
    assert main(["validate", "sft/tiny", *fills, "max_grad_norm=-1", "on_nonfinite_loss=STOP"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tunesmith: error: max_grad_norm: expected a number > 0"), err
    assert "on_nonfinite_loss: expected one of 'stop', 'skip', got 'STOP'" in err
    assert main(["validate", "sft/tiny", *fills, "output_dir=${nowhere}"]) == 1
    assert capsys.readouterr().err.count("output_dir:") == 1  # reported once, not per checker


# ----------------------------------------------------------------------------- secrets


def test_environment_reads_stay_interpolations(monkeypatch):
    monkeypatch.setenv("WANDB_KEY", "s3cret")
    cfg = OmegaConf.create(
        {
            "out": "runs/a",
            "logs": "${out}/logs",
            "key": "${oc.env:WANDB_KEY}",
            "copy": "${key}",
            "header": "Bearer ${oc.env:WANDB_KEY}",
            "opt": "${oc.env:NOT_SET_ANYWHERE,null}",
            "nested": "${oc.select:nowhere,${oc.env:WANDB_KEY}}",
            "items": ["${oc.env:WANDB_KEY}"],
        }
    )
    assert plain_config(cfg) == {
        "out": "runs/a",
        "logs": "runs/a/logs",
        "key": "${oc.env:WANDB_KEY}",
        "copy": "${oc.env:WANDB_KEY}",
        "header": "Bearer ${oc.env:WANDB_KEY}",
        "opt": "${oc.env:NOT_SET_ANYWHERE,null}",
        "nested": "${oc.env:WANDB_KEY}",
        "items": ["${oc.env:WANDB_KEY}"],
    }
    assert cfg.key == "s3cret" and cfg.header == "Bearer s3cret"  # the run still uses the value


def test_loggers_never_write_the_secret(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WANDB_KEY", "s3cret")
    cfg = OmegaConf.create({"wandb": {"api_key": "${oc.env:WANDB_KEY}"}})
    with JSONLLogger(tmp_path) as logger:
        logger.log_config(cfg)
    StdoutLogger(print_config=True).log_config(cfg)
    written = (tmp_path / "config.yaml").read_text() + capsys.readouterr().out
    assert "${oc.env:WANDB_KEY}" in written and "s3cret" not in written


# ----------------------------------------------------------------------------- resume, units


def _record(total_steps: int = 8, samples: int = 32, **config) -> RunRecord:
    base = {"seed": 0, "batch_size": 4, "max_steps": 8, "optimizer": {"lr": 1e-3},
            "dataset": {"source": "a.jsonl"}, "resume": False, "val_fraction": 0.0}  # fmt: skip
    return RunRecord(base | config, total_steps, samples)


def test_config_changes_are_dotted_paths_old_to_new():
    old = {"a": {"b": [1, 2]}, "flag": True, "gone": 1}
    new = {"a": {"b": [1, 3, 4]}, "flag": 1, "new": 0}
    assert [str(c) for c in config_changes(old, new)] == [
        "a.b.1: 2 -> 3",
        "a.b.2: (absent) -> 4",
        "flag: true -> 1",
        "new: (absent) -> 0",
        "gone: 1 -> (absent)",
    ]
    assert config_changes(old, old) == []


def test_null_and_absent_and_moved_components_are_no_change():
    """A key set to null where it was absent (its default) is no change, and neither is a
    ``_component_`` path that still resolves to the same class (a loss moved into a package);
    another class is."""
    old = {"loss": {"_component_": "tunesmith.modules.preference_losses.DPOLoss"}, "x": None}
    new = {"loss": {"_component_": "tunesmith.modules.losses.DPOLoss"}, "parallelism": None}
    assert config_changes(old, new) == []
    other = {"loss": {"_component_": "tunesmith.modules.losses.SimPOLoss"}}
    assert [c.path for c in config_changes(old, other)] == ["loss._component_"]


def test_changed_keys_that_may_not_change_are_refused_all_at_once():
    saved = _record()
    saved.step = 4
    new = _record(
        seed=1,
        batch_size=2,
        optimizer={"lr": 2e-3},
        dataset={"source": "b.jsonl"},
        save_every_n_steps=2,
    )
    with pytest.raises(ConfigError) as error:
        check_resume(Path("ckpt"), saved, new)
    lines = str(error.value).splitlines()
    assert lines[0].startswith("resume from ckpt: the config differs from the checkpoint's")
    assert lines[1:] == [
        "seed: 0 -> 1",
        "batch_size: 4 -> 2",
        "optimizer.lr: 0.001 -> 0.002",
        "dataset.source: 'a.jsonl' -> 'b.jsonl'",
    ]


def test_allowed_changes_are_logged_and_a_new_length_is_announced():
    saved = _record()
    saved.step = 4
    notes = check_resume(Path("c"), saved, _record(12, max_steps=12, keep_last=1, resume=True))
    assert notes == [
        "resume: keep_last (absent) -> 1",
        "max_steps 8 -> 12: the LR schedule now ends at step 12 (was 8)",
    ]
    with pytest.raises(
        ConfigError, match="max_steps: 8 -> 3 makes the run 3 steps long, but c is at step 4"
    ):
        check_resume(Path("c"), saved, _record(3, max_steps=3))
    with pytest.raises(ConfigError, match="lr_scheduler keeps its length"):
        check_resume(Path("c"), saved, _record(12, max_steps=12), resizable=False)
    assert check_resume(Path("c"), saved, _record(resume=True), resizable=False) == []
    both = _record(16, epochs=4, max_steps=16)  # max_steps decides the length, named first
    assert check_resume(Path("c"), saved, both)[-1].startswith("max_steps 8 -> 16: the LR")
    unused = check_resume(Path("c"), saved, _record(epochs=4), resizable=False)
    assert unused == ["resume: epochs (absent) -> 4 (the run stays 8 steps long)"]


def test_other_data_or_a_split_changing_val_dataset_is_refused():
    with pytest.raises(ConfigError, match="dataset: 32 training samples -> 30: the data changed"):
        check_resume(Path("c"), _record(), _record(samples=30))
    check_resume(Path("c"), _record(), _record(val_dataset={"source": "v.jsonl"}))
    with pytest.raises(ConfigError, match="val_dataset.source"):
        split = _record(val_fraction=0.1)
        check_resume(Path("c"), split, _record(val_fraction=0.1, val_dataset={"source": "v"}))


def test_a_checkpoint_record_is_read_back_without_loading_anything_else(tmp_path):
    state = tmp_path / "step_000004" / "training_state"
    state.mkdir(parents=True)
    record = _record()
    torch.save({RECORD_KEY: record.state_dict(), "progress": {"step": 4}}, state / "rank0.pt")
    back = read_record(tmp_path / "step_000004", 0)
    assert (back.config, back.total_steps, back.samples, back.step) == (record.config, 8, 32, 4)
    torch.save({"progress": {"step": 4}}, state / "rank0.pt")  # written before records existed
    assert read_record(tmp_path / "step_000004", 0) is False
    (state / "rank0.pt").write_bytes(b"junk")  # the checkpoint loader reports this one
    assert read_record(tmp_path / "step_000004", 0) is None
    assert read_record(tmp_path / "step_000004", 1) is None


def test_a_new_schedule_length_gives_the_new_schedule_from_the_resumed_step():
    def build(total: int):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return cosine_with_warmup(opt, num_warmup_steps=2, num_training_steps=total)

    old, fresh, reference = build(6), build(12), build(12)
    for _ in range(4):
        old.optimizer.step(), old.step()
        reference.optimizer.step(), reference.step()
    params = schedule_params(fresh)
    fresh.load_state_dict(old.state_dict())  # the saved length (6) comes back ...
    assert fresh.lr_lambdas[0].num_training_steps == 6
    set_schedule_params(fresh, params)  # ... and goes again
    for _ in range(8):
        assert fresh.get_last_lr() == reference.get_last_lr()
        assert fresh.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
        for s in (fresh, reference):
            s.optimizer.step(), s.step()
    plain = torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda step: 1.0)
    assert schedule_params(plain) is None


@pytest.mark.parametrize(
    ("samples", "world", "batch"), [(17, 1, 4), (16, 1, 4), (17, 2, 4), (18, 4, 3), (5, 2, 1)]
)
def test_the_samples_left_out_are_those_no_rank_loads(samples, world, batch, capsys):
    loaded = 0
    for rank in range(world):
        ctx = SimpleNamespace(dp_size=world, dp_rank=rank, is_rank_zero=rank == 0)
        loader, _ = make_loader(list(range(samples)), list, ctx, batch_size=batch, seed=0)
        loaded += sum(len(b) for b in loader)
    assert dropped_per_epoch(samples, world, batch) == samples - loaded
    said = capsys.readouterr().out
    assert (f"{samples - loaded} sample(s) left out of each epoch" in said) == (loaded < samples)


def test_samples_left_out_of_each_epoch_are_reported(capsys):
    ctx = SimpleNamespace(dp_size=1, dp_rank=0, is_rank_zero=True)
    make_loader(list(range(17)), list, ctx, batch_size=4, shuffle=False)
    assert capsys.readouterr().out == (
        "data: 17 samples, 1 data-parallel rank(s) x batch_size 4: 1 sample(s) left out of "
        "each epoch "
        "(drop_last; always the same ones: shuffle is off)\n"
    )
    make_loader(list(range(16)), list, ctx, batch_size=4, shuffle=False)
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- resume, runs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop_config")
    return root, make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=24)


def test_raising_max_steps_on_resume_follows_the_longer_schedule(world, tmp_path, capsys):
    _, model_dir, data = world
    short, long_ = "max_steps=4", "max_steps=10"
    out = run_sft(model_dir, data, tmp_path / "run", short, "stop_after_steps=3")
    shorter = read_metrics(run_sft(model_dir, data, tmp_path / "short", short))
    run_sft(model_dir, data, out, long_, "resume=true")
    assert (
        "max_steps 4 -> 10: the LR schedule now ends at step 10 (was 4)" in capsys.readouterr().out
    )
    fresh = read_metrics(run_sft(model_dir, data, tmp_path / "fresh", long_))
    resumed = read_metrics(out)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(4, 11):  # the longer schedule from the step resumed at, exactly
        assert resumed[step]["lr"] == fresh[step]["lr"], step
    assert shorter[4]["lr"] != fresh[4]["lr"]  # the two schedules do differ there
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 10  # what ran
    record = read_record(out / "checkpoints" / "step_000010", 0)
    assert record.total_steps == 10 and record.config["max_steps"] == 10 and record.step == 10


def test_resume_with_changed_lr_batch_size_seed_and_data_is_refused(world, tmp_path, capsys):
    root, model_dir, data = world
    out = run_sft(model_dir, data, tmp_path / "run", "max_steps=4", "stop_after_steps=2")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    other = Path(shutil.copy(data, tmp_path / "other.jsonl"))
    changed = ["optimizer.lr=0.002", "batch_size=2", "seed=1", f"dataset.source={other}"]
    cfg = recipe_config("sft", "tiny", model_dir, data, out, "max_steps=4", "resume=true", *changed)
    with pytest.raises(ConfigError) as error:
        run_config("sft", cfg)
    lines = str(error.value).splitlines()
    assert lines[1:] == [
        "seed: 0 -> 1",
        f"dataset.source: '{data}' -> '{other}'",
        "batch_size: 4 -> 2",
        "optimizer.lr: 0.001 -> 0.002",
    ]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_a_resume_refusal_lists_only_the_keys_of_the_runs_config():
    """What may change on resume is listed from the keys this run's config has: an RL run
    (no val_dataset, no dataset) is not told it may change an SFT run's val_dataset."""
    rl = {"seed": 0, "max_steps": 8, "prompts_per_step": 4, "eval_every_n_steps": 2}
    saved = RunRecord(rl, total_steps=8, samples=0, step=4)
    resumable = RESUMABLE_KEYS | {"prompts_per_step"}
    with pytest.raises(ConfigError) as error:
        check_resume(Path("ckpt"), saved, RunRecord(rl | {"seed": 1}, 8, 0), resumable=resumable)
    listed = str(error.value).split("may change: ", 1)[1].split(";", 1)[0].split(", ")
    assert "val_dataset" in RESUMABLE_KEYS and "val_dataset" not in listed
    assert {"max_steps", "prompts_per_step"} <= set(listed) <= set(rl)


def test_a_refused_rollback_moves_nothing(world, tmp_path):
    """resume=<older step> with a changed lr: refused before the newer checkpoints move aside."""
    _, model_dir, data = world
    out = run_sft(
        model_dir, data, tmp_path / "run", "max_steps=3", "save_every_n_steps=1", "keep_last=null"
    )
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    older = out / "checkpoints" / "step_000001"
    cfg = recipe_config(
        "sft", "tiny", model_dir, data, out, "max_steps=3", f"resume={older}", "optimizer.lr=0.002"
    )
    with pytest.raises(ConfigError, match="optimizer.lr: 0.001 -> 0.002"):
        run_config("sft", cfg)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_secrets_from_the_environment_are_used_but_never_written(world, tmp_path, monkeypatch):
    _, model_dir, data = world
    hidden = Path(shutil.copytree(model_dir, tmp_path / "hidden-model"))
    monkeypatch.setenv(SECRET_ENV, str(hidden))
    env_dir = f"model_dir=${{oc.env:{SECRET_ENV}}}"
    out = run_sft(model_dir, data, tmp_path / "run", env_dir, "max_steps=3", "stop_after_steps=2")
    written = (out / "config.yaml").read_text()
    assert f"${{oc.env:{SECRET_ENV}}}" in written and str(hidden) not in written
    record = read_record(out / "checkpoints" / "step_000002", 0)
    assert record.config["tokenizer"]["folder"] == f"${{oc.env:{SECRET_ENV}}}"
    rank_file = out / "checkpoints" / "step_000002" / "training_state" / "rank0.pt"
    state = torch.load(rank_file, weights_only=True)
    assert str(hidden) not in repr(state[RECORD_KEY])

    moved = Path(shutil.copytree(hidden, tmp_path / "moved-model"))
    monkeypatch.setenv(SECRET_ENV, str(moved))  # another value: not a changed key
    literal = recipe_config(
        "sft", "tiny", model_dir, data, out, f"model_dir={moved}", "max_steps=3", "resume=true"
    )
    with pytest.raises(ConfigError, match=r"model_dir: '\$\{oc.env:" + SECRET_ENV):
        run_config("sft", literal)  # another interpolation: a changed key
    run_sft(model_dir, data, out, env_dir, "max_steps=3", "resume=true")
    assert sorted(read_metrics(out)) == [1, 2, 3]
