"""The override grammar: ``key=value``, ``~key``, component swaps, YAML-typed values."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from tunesmith.config import ConfigError, apply_overrides, parse_override, validate_config


def base() -> DictConfig:
    return OmegaConf.create(
        {
            "seed": 1,
            "batch_size": 8,
            "model": {"_component_": "torch.nn.Linear", "in_features": 4, "out_features": 2},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.001, "weight_decay": 0.0},
            "layers": [1, 2, 3],
            "data": {"prompt": "hello", "batch": "${batch_size}"},
        }
    )


def plain(cfg: DictConfig, path: str) -> Any:
    value = OmegaConf.select(cfg, path, throw_on_missing=True)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


# (overrides, dotted path to read back, expected value, expected exact type)
SET_CASES = [
    (["seed=3"], "seed", 3, int),
    (["seed=-3"], "seed", -3, int),
    (["seed=1.5"], "seed", 1.5, float),
    (["optimizer.lr=1e-5"], "optimizer.lr", 1e-5, float),
    (["optimizer.lr=3E-4"], "optimizer.lr", 3e-4, float),
    (["model.bias=false"], "model.bias", False, bool),
    (["data.shuffle=True"], "data.shuffle", True, bool),
    (["new.deep.key=1"], "new", {"deep": {"key": 1}}, dict),
    (["data.prompt=hello world"], "data.prompt", "hello world", str),
    (["data.prompt=hi # not a comment"], "data.prompt", "hi # not a comment", str),
    (["data.prompt=Answer: yes"], "data.prompt", "Answer: yes", str),
    (["data.prompt='5'"], "data.prompt", "5", str),
    (['data.prompt="true"'], "data.prompt", "true", str),
    (["data.prompt=a=b"], "data.prompt", "a=b", str),
    (['data.prompt="a=b"'], "data.prompt", "a=b", str),
    (["data.url=http://x?a=b&c=d"], "data.url", "http://x?a=b&c=d", str),
    (["data.prompt="], "data.prompt", "", str),
    (["data.prompt=null"], "data.prompt", None, type(None)),
    (["data.prompt=None"], "data.prompt", None, type(None)),
    (["data.prompt=~"], "data.prompt", None, type(None)),
    (["layers=[4, 5]"], "layers", [4, 5], list),
    (["layers=[]"], "layers", [], list),
    (["data.extra={a: 1, b: [2, x]}"], "data.extra", {"a": 1, "b": [2, "x"]}, dict),
    (["layers.0=5"], "layers", [5, 2, 3], list),
    (["layers.2=seven"], "layers", [1, 2, "seven"], list),
    (["data.prompt=${seed}"], "data.prompt", 1, int),
    (["batch_size=16"], "data.batch", 16, int),  # interpolation follows the override
    (["seed=2", "seed=4"], "seed", 4, int),  # applied in order
    (["data.date=2024-01-02"], "data.date", "2024-01-02", str),  # no YAML dates
    (["data=null", "data.x=1"], "data", {"x": 1}, dict),  # a null node becomes a mapping
    (["~seed"], "seed", None, type(None)),
    (
        ["~optimizer.weight_decay"],
        "optimizer",
        {"_component_": "torch.optim.AdamW", "lr": 0.001},
        dict,
    ),
    (["~layers.0"], "layers", [2, 3], list),
    (
        ["optimizer=torch.optim.SGD"],
        "optimizer",
        {"_component_": "torch.optim.SGD", "lr": 0.001, "weight_decay": 0.0},
        dict,
    ),
    (
        ["optimizer._component_=torch.optim.SGD"],
        "optimizer",
        {"_component_": "torch.optim.SGD", "lr": 0.001, "weight_decay": 0.0},
        dict,
    ),
    (
        ["optimizer={_component_: torch.optim.SGD, lr: 0.5}"],
        "optimizer",
        {"_component_": "torch.optim.SGD", "lr": 0.5},
        dict,
    ),
]


@pytest.mark.parametrize(
    ("overrides", "path", "expected", "kind"), SET_CASES, ids=[" ".join(c[0]) for c in SET_CASES]
)
def test_override_sets_value(overrides: list[str], path: str, expected: Any, kind: type) -> None:
    cfg = apply_overrides(base(), overrides)
    got = plain(cfg, path)
    assert got == expected
    assert type(got) is kind


def test_deleted_key_is_gone_not_null() -> None:
    cfg = apply_overrides(base(), ["~seed", "~data.prompt"])
    assert "seed" not in cfg
    assert list(cfg.data.keys()) == ["batch"]


def test_overrides_leave_the_input_unchanged() -> None:
    cfg = base()
    before = OmegaConf.to_container(cfg)
    apply_overrides(cfg, ["seed=9", "~layers", "optimizer=torch.optim.SGD", "new.key=1"])
    assert OmegaConf.to_container(cfg) == before


def test_component_swap_keeps_args_and_validation_reports_the_unaccepted_ones() -> None:
    swapped = apply_overrides(base(), ["optimizer=torch.optim.Adagrad", "optimizer.lr_decay=0.1"])
    assert OmegaConf.to_container(swapped.optimizer) == {
        "_component_": "torch.optim.Adagrad",
        "lr": 0.001,
        "weight_decay": 0.0,
        "lr_decay": 0.1,
    }
    assert validate_config(swapped, runtime_args={"optimizer": 1}) == []
    cfg = apply_overrides(base(), ["model=torch.nn.Bilinear"])
    issues = {i.path: i.message for i in validate_config(cfg, runtime_args={"optimizer": 1})}
    assert sorted(issues) == ["model.in1_features", "model.in2_features", "model.in_features"]
    assert issues["model.in_features"].startswith("unknown argument of torch.nn.Bilinear")
    assert issues["model.in1_features"] == "missing required argument of torch.nn.Bilinear"


def test_swapped_component_with_unaccepted_arg_names_it() -> None:
    cfg = apply_overrides(base(), ["optimizer=torch.optim.Rprop"])
    issues = validate_config(cfg, runtime_args={"optimizer": 1})
    assert [str(i) for i in issues] == [
        "optimizer.weight_decay: unknown argument of torch.optim.Rprop"
    ]
    fixed = apply_overrides(cfg, ["~optimizer.weight_decay"])
    assert validate_config(fixed, runtime_args={"optimizer": 1}) == []


def test_parse_override_splits_at_first_equals_only() -> None:
    parsed = parse_override("data.url=http://h/p?a=b=c")
    assert parsed.keys == ("data", "url")
    assert parsed.path == "data.url"
    assert parsed.value == "http://h/p?a=b=c"
    assert not parsed.delete
    assert parse_override("~a.b").delete


# (override, words the error must contain besides the override text)
BAD_CASES = [
    ("optimizer.lr", ["has no '='", "~key"]),
    ("=5", ["not a dotted key path"]),
    ("a..b=1", ["not a dotted key path"]),
    ("a b=1", ["not a dotted key path"]),
    ("~seed=1", ["takes no"]),
    ("~optimizer.betas", ["cannot delete 'optimizer.betas'", "not found"]),
    ("~optimizer.wieght_decay", ["not found", "did you mean 'weight_decay'"]),
    ("~nothere.x", ["cannot delete 'nothere.x'", "'nothere' is not set"]),
    ("layers.7=1", ["index 7 is out of range", "length 3"]),
    ("~layers.3", ["index 3 is out of range"]),
    ("layers.x=1", ["'x' is not an index"]),
    ("seed.x=1", ["'seed' holds a int"]),
    ("data.batch.x=1", ["'data.batch' is an interpolation"]),
    ("layers=[1, 2", ["cannot parse value"]),
    ("data.extra={a: 1", ["cannot parse value"]),
    ('data.prompt="unclosed', ["cannot parse value"]),
]


@pytest.mark.parametrize(("override", "words"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_override_raises_naming_it(override: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(base(), [override])
    message = str(info.value)
    assert f"override {override!r}" in message
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_every_bad_override_is_reported_at_once() -> None:
    overrides = ["seed=2", "oops", "~missing", "layers.9=0"]
    with pytest.raises(ConfigError) as info:
        apply_overrides(base(), overrides)
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    for line, bad in zip(lines, overrides[1:]):
        assert line.startswith(f"override {bad!r}")
