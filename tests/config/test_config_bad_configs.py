"""A catalogue of bad configs: each must give a clear problem naming its dotted path.

Every YAML file in ``bad_configs/`` is one case. Load-stage cases fail in ``load_config`` (the
error names the file and line); validate-stage cases load and then ``validate_config`` must
return an issue at the expected path whose message holds the expected words.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tunesmith.config import ConfigError, ConfigIssue, instantiate, load_config, validate_config

HERE = Path(__file__).parent
BAD = HERE / "bad_configs"
RUNTIME_ARGS = {"optimizer": 1}  # the recipe passes the parameters to the optimizer

# (file, overrides, dotted path of the issue, words its message must contain)
VALIDATE_CASES = [
    ("unknown_key.yaml", [], "optimizer.colour", ["unknown argument", "torch.optim.AdamW"]),
    ("misspelt_key.yaml", [], "optimizer.lrr", ["unknown argument", "did you mean 'lr'"]),
    ("missing_required.yaml", [], "model.out_features", ["missing required", "Linear"]),
    (
        "bad_module.yaml",
        [],
        "optimizer._component_",
        ["'torch' has no attribute 'optimm'", "did you mean 'torch.optim.AdamW'"],
    ),
    ("unknown_module.yaml", [], "dataset._component_", ["has no attribute 'no_such_module'"]),
    (
        "bad_attribute.yaml",
        [],
        "optimizer._component_",
        ["has no attribute 'Adamw'", "did you mean 'torch.optim.AdamW'"],
    ),
    ("wrong_type.yaml", [], "optimizer.lr", ["expected float", "got str 'abc'"]),
    ("wrong_type_bool.yaml", [], "model.in_features", ["expected int", "got bool"]),
    ("circular.yaml", [], "a", ["circular interpolation", "${b}"]),
    (
        "missing_interpolation.yaml",
        [],
        "optimizer.lr",
        ["${training.base_lr}", "cannot be resolved", "not found"],
    ),
    (
        "component_not_string.yaml",
        [],
        "model._component_",
        ["must be a dotted path string", "got list"],
    ),
    (
        "not_allowed_os.yaml",
        [],
        "hook._component_",
        ["'os.system' is not allowed", "--allow-any-component"],
    ),
    (
        "not_allowed_subprocess.yaml",
        [],
        "hook._component_",
        ["'subprocess.run' is not allowed", "allow_any_component=True"],
    ),
    ("nested_list.yaml", [], "heads.1.in_feature", ["did you mean 'in_features'"]),
    (
        "nested_argument.yaml",
        [],
        "model.device._component_",
        ["has no attribute 'devic'", "did you mean 'torch.device'"],
    ),
    ("missing_value.yaml", [], "optimizer.lr", ["value is missing (???)"]),
    ("special_key_typo.yaml", [], "model._componet_", ["did you mean '_component_'"]),
    ("runtime_arg_in_config.yaml", [], "optimizer.params", ["passes this argument", "runtime"]),
    ("not_dotted.yaml", [], "optimizer._component_", ["not a full dotted path"]),
    ("not_callable.yaml", [], "precision._component_", ["not a callable"]),
    # A good config made bad by deleting a required argument on the command line.
    ("../good_config.yaml", ["~model.in_features"], "model.in_features", ["missing required"]),
]

# (file, words the load error must contain)
LOAD_CASES = [
    ("syntax_error.yaml", ["syntax_error.yaml:4:", "YAML syntax error", "',' or ']'"]),
    ("non_mapping.yaml", ["non_mapping.yaml:1", "top level", "mapping", "got a list"]),
    ("duplicate_key.yaml", ["duplicate_key.yaml:4:", "duplicate key"]),
]


def _case_id(case: tuple) -> str:
    return Path(case[0]).stem + ("-" + "-".join(case[1]) if case[1] else "")


@pytest.mark.parametrize(
    ("name", "overrides", "path", "words"), VALIDATE_CASES, ids=map(_case_id, VALIDATE_CASES)
)
def test_bad_config_reports_path_and_reason(
    name: str, overrides: list[str], path: str, words: list[str]
) -> None:
    cfg = load_config(BAD / name, overrides)
    issues = validate_config(cfg, runtime_args=RUNTIME_ARGS)
    at_path = [issue for issue in issues if issue.path == path]
    assert at_path, f"no issue at {path!r}; got {[str(i) for i in issues]}"
    message = " | ".join(issue.message for issue in at_path)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert str(at_path[0]).startswith(f"{path}: ")


@pytest.mark.parametrize(("name", "words"), LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_unloadable_config_names_file_and_line(name: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(BAD / name)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_every_fixture_is_in_the_catalogue() -> None:
    listed = {Path(c[0]).name for c in VALIDATE_CASES + LOAD_CASES} | {"many_errors.yaml"}
    on_disk = {path.name for path in BAD.glob("*.yaml")}
    assert on_disk <= listed, f"fixtures without a case: {sorted(on_disk - listed)}"
    assert len(VALIDATE_CASES) + len(LOAD_CASES) >= 12


def test_all_problems_are_reported_together() -> None:
    cfg = load_config(BAD / "many_errors.yaml")
    issues = validate_config(cfg)
    paths = {issue.path for issue in issues}
    assert {
        "seed",
        "model.in_feature",
        "model.in_features",
        "optimizer._component_",
        "loss.ignore_index",
        "hooks.0._component_",
    } <= paths, [str(i) for i in issues]
    # The error a CLI raises lists them all, one per line, in tree order.
    error = ConfigError.from_issues(issues, header="many_errors.yaml has problems:")
    lines = str(error).splitlines()
    assert lines[0] == "many_errors.yaml has problems:"
    assert lines[1:] == [str(issue) for issue in issues]
    assert [line.split(":")[0] for line in lines[1:3]] == ["seed", "model.in_feature"]
    assert error.issues == tuple(issues)


def test_bad_component_also_fails_instantiate_with_its_path(tmp_path: Path) -> None:
    marker = tmp_path / "hacked"
    cfg = load_config(BAD / "not_allowed_os.yaml", [f"hook.command='touch {marker}'"])
    with pytest.raises(ConfigError, match=r"^hook\._component_: component 'os\.system'"):
        instantiate(cfg.hook)
    assert not marker.exists()
    cfg = load_config(BAD / "nested_list.yaml")
    with pytest.raises(ConfigError, match=r"^heads\.1: TypeError: .*in_feature"):
        instantiate(cfg.heads)


def test_issue_and_error_formatting() -> None:
    issue = ConfigIssue("optimizer.lrr", "unknown argument")
    assert str(issue) == "optimizer.lrr: unknown argument"
    assert str(ConfigIssue("", "top level is empty")) == "<root>: top level is empty"
    error = ConfigError("unknown argument", path="optimizer.lrr")
    assert str(error) == "optimizer.lrr: unknown argument"
    assert error.path == "optimizer.lrr"
    with pytest.raises(ValueError):
        ConfigError.from_issues([])
