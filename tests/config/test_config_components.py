"""The component allow-list decides on what a path resolves to, hop by hop: a module by its
name, a function by the module its code runs in (and what it wraps), a class by where it is
defined, anything else by its type; denied loaders and code runners are refused wherever they
are re-exported, and a package outside the list is never imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tunesmith.config import (
    ALLOW_ANY_COMPONENT_ENV,
    ALLOWED_COMPONENT_PREFIXES,
    ConfigError,
    component_refusal,
    instantiate,
    is_component_allowed,
    resolve_component,
    validate_config,
)
from tunesmith.config.components import unsafe_arguments

ALLOWED = [
    # what the shipped configs and the tests use
    "torch.optim.AdamW",
    "torch.optim.SGD",
    "torch.optim.lr_scheduler.LambdaLR",
    "torch.nn.Linear",
    "torch.nn.functional.cross_entropy",  # a Python function
    "torch.zeros",  # a builtin
    "tunesmith.models.from_hf",
    "tunesmith.data.Tokenizer.from_pretrained",  # a classmethod
    "tunesmith.data.SFTDataset",
    "tunesmith.data.PreferenceDataset",
    "tunesmith.modules.losses.CrossEntropyLoss",
    "tunesmith.modules.losses.DPOLoss",
    "tunesmith.modules.preference_losses.DPOLoss",  # the old path: a re-export
    "tunesmith.modules.peft.apply_lora",
    "tunesmith.training.JSONLLogger",
    "tunesmith.training.cosine_with_warmup",
    "transformers.AutoTokenizer.from_pretrained",  # through transformers' lazy modules
    "transformers.get_cosine_schedule_with_warmup",
]

REFUSED = {  # path -> words of the refusal
    "os.system": "'os.system' is outside the allowed packages",
    "builtins.eval": "'builtins.eval' is outside the allowed packages",
    "torch.os.system": "'torch.os' is the module 'os', outside the allowed packages",
    "torch.nn.modules.module.torch.load": "is the function 'torch.serialization.load', denied",
    "torch.load": "'torch.load' is the function 'torch.serialization.load', denied",
    "torch.save": "is the function 'torch.serialization.save', denied",
    "torch.hub.load": "'torch.hub.load' is denied: 'torch.hub' loads pickles",
    "torch.jit.load": "is denied: 'torch.jit'",
    "torch.CompilationUnit": "is the class 'torch.jit.CompilationUnit', denied",
    "torch.package.PackageImporter": "is denied: 'torch.package'",
    "torch.distributed.checkpoint.load": "is denied: 'torch.distributed.checkpoint'",
    "torch.distributed.broadcast_object_list": "'torch.distributed.distributed_c10d."
    "broadcast_object_list', denied",
    "torch.ops.load_library": "is the function 'torch._ops._Ops.load_library', denied",
    "torch.distributed.distributed_c10d.pickle.loads": "is the module 'pickle'",
    "torch.utils.collect_env.run": "is denied: 'torch.utils.collect_env'",
    "transformers.utils.import_utils.importlib.import_module": "is denied",
    "transformers.dynamic_module_utils.get_class_from_dynamic_module": "is denied",
    "tunesmith.config.resolve_component": "is denied: 'tunesmith.config'",
    "tunesmith.cli.main.main": "is denied: 'tunesmith.cli'",
    "tunesmith.training.checkpoint.checkpointer.os.system": "is the module 'os'",
    "torch.load.__globals__": "names the special attribute '__globals__'",
    "torch.nn.Module.__init__": "names the special attribute '__init__'",
    "torch.storage._load_from_bytes": "names the private attribute '_load_from_bytes'",
    # unbound methods through a class: a `self:` argument would call them on any object
    "torch.Tensor.add": "'torch.Tensor.add' is an unbound method of the class 'torch.Tensor'",
    "torch.nn.Module.register_forward_hook": "is an unbound method of the class "
    "'torch.nn.modules.module.Module'",
    "torch.nn.Linear.forward": "is an unbound method of the class",
    "torch.optim.AdamW.step": "is an unbound method of the class",
    "transformers.PreTrainedModel.save_pretrained": "is an unbound method of the class",
    "tunesmith.rl.rewards.CodeTests.score": "is an unbound method of the class "
    "'tunesmith.rl.rewards.code.CodeTests'",
    "tunesmith.data.Tokenizer.encode": "is an unbound method of the class",
    # tunesmith's own callables that carry no mark: code runners, helpers
    "tunesmith.rl.rewards.run_sandboxed": "is the function "
    "'tunesmith.rl.rewards.sandbox.run_sandboxed', which is not marked as a component",
    "tunesmith.rl.rewards.sandbox.run_sandboxed": "which is not marked as a component",
    "tunesmith.rl.rewards.code.harness": "'tunesmith.rl.rewards.code.harness', which is not marked",
    "tunesmith.rl.rewards.code.extract_code": "which is not marked as a component",
    "tunesmith.models.hf.load_hf_weights": "which is not marked as a component",
    "tunesmith.models.hf.save_hf_checkpoint": "which is not marked as a component",
    "tunesmith.training.logging.loggers.append_record": "which is not marked as a component",
    "tunesmith.data.tokenizer.Tokenizer": "the class 'tunesmith.data.tokenizer.Tokenizer', "
    "which is not marked",
}


@pytest.fixture(autouse=True)
def _no_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)


@pytest.mark.parametrize("path", ALLOWED)
def test_components_of_the_configs_resolve(path: str) -> None:
    assert component_refusal(path) is None
    assert callable(resolve_component(path)) and is_component_allowed(path)


@pytest.mark.parametrize("path", list(REFUSED))
def test_routes_out_of_the_allow_list_are_refused(path: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_component(path)
    message = str(info.value)
    assert message.startswith(f"component '{path}' is not allowed: "), message
    assert REFUSED[path] in message, message
    assert "--allow-any-component" in message and ALLOW_ANY_COMPONENT_ENV in message
    assert not is_component_allowed(path)


def test_refusal_names_the_config_path() -> None:
    cfg = OmegaConf.create({"loss": {"_component_": "torch.os.system", "command": "true"}})
    with pytest.raises(ConfigError, match=r"^loss\._component_: component 'torch.os.system'"):
        instantiate(cfg.loss)
    issues = validate_config(cfg)  # validate refuses it with the same message
    assert [(i.path, i.message) for i in issues] == [
        ("loss._component_", str(_error_of(cfg.loss)).split(": ", 1)[1])
    ]


def _error_of(node) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        instantiate(node)
    return info.value


def test_the_flag_lifts_the_checks() -> None:
    assert resolve_component("torch.load", allow_any_component=True) is torch.load
    assert resolve_component("torch.os.system", allow_any_component=True) is __import__("os").system


# ----------------------------------------------------------------------------- made-up packages


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tsallowed`` (added to the allow-list) and ``tsother`` (not), written fresh per test;
    ``tsother`` records its import in ``imported``."""
    root = tmp_path / "pkgs"
    monkeypatch.syspath_prepend(str(root))
    _write(
        root / "tsother" / "__init__.py",
        f"""
        open({str(tmp_path / "imported")!r}, "w").write("tsother")
        import os
        def helper():
            return os.system
        class Liar:
            pass
        Liar.__module__ = "tsallowed.nowhere"
        __import__("tunesmith.config").config.component(Liar)
        """,
    )
    _write(
        root / "tsallowed" / "__init__.py",
        """
        import functools
        import os
        import torch
        from tunesmith.config import component
        @component
        def fine(x=1):
            return x
        fine.__module__ = "tsallowed"
        def unmarked(x=1):
            return x
        wrapped = functools.wraps(fine)(lambda x=1: x)  # copies fine's __dict__, not its mark
        class Marked:
            pass
        component(Marked)
        class Sub(Marked):
            pass
        disguised = __import__("tsother").helper  # defined in tsother, whatever it claims
        disguised.__module__ = "tsallowed"
        system_partial = functools.partial(os.system, "true")
        fine_partial = functools.partial(torch.nn.Linear, 2)
        cached = component(functools.lru_cache(fine))
        @functools.wraps(torch.load)
        def load_wrapper(*args, **kwargs):
            return torch.load(*args, **kwargs)
        class Callable:
            def __call__(self):
                return 1
        instance = component(Callable())
        liar = __import__("tsother").Liar
        """,
    )
    _write(
        root / "tsallowed" / "safe.py",
        "import tunesmith.config\n@tunesmith.config.component\ndef ok():\n    return 1\n",
    )
    _write(root / "tsallowed" / "other.py", f"open({str(tmp_path / 'other')!r}, 'w')\n")
    ALLOWED_COMPONENT_PREFIXES.append("tsallowed.")
    try:
        yield tmp_path
    finally:
        ALLOWED_COMPONENT_PREFIXES.remove("tsallowed.")
        for name in [n for n in sys.modules if n.split(".")[0] in ("tsallowed", "tsother")]:
            del sys.modules[name]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("tsallowed.disguised", "is the function 'tsother.helper', outside the allowed packages"),
        ("tsallowed.system_partial", "is the builtin function 'posix.system', outside"),
        ("tsallowed.load_wrapper", "'torch.serialization.load', denied"),
        ("tsallowed.liar", "'tsallowed.nowhere' does not hold it under that name"),
    ],
)
def test_objects_are_judged_by_what_they_are(packages: Path, path: str, words: str) -> None:
    refusal = component_refusal(path)
    assert refusal is not None and words in refusal, refusal


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("tsallowed.unmarked", "is the function 'tsallowed.unmarked', which is not marked"),
        ("tsallowed.wrapped", "which is not marked as a component"),
        ("tsallowed.Sub", "is the class 'tsallowed.Sub', which is not marked"),
    ],
)
def test_a_package_of_ones_own_needs_the_mark(packages: Path, path: str, words: str) -> None:
    """In a package added to the list, only marked objects resolve: not an unmarked function,
    nor a wrapper or a subclass of a marked one (the mark is on the object, not inherited)."""
    assert component_refusal("tsallowed.fine") is None
    assert component_refusal("tsallowed.Marked") is None
    refusal = component_refusal(path)
    assert refusal is not None and words in refusal, refusal
    assert "ALLOWED_COMPONENT_PREFIXES" in refusal and "@tunesmith.config.component" in refusal


def test_class_not_held_where_it_claims_is_refused(packages: Path) -> None:
    import tsother

    tsother.Liar.__module__ = "tsallowed"  # tsallowed holds it as `liar`: found there
    assert component_refusal("tsallowed.liar") is None
    tsother.Liar.__module__ = "tsallowed.safe"  # a module that does not hold it
    assert "does not hold it under that name" in component_refusal("tsallowed.liar")


@pytest.mark.parametrize(
    "path", ["tsallowed.fine", "tsallowed.fine_partial", "tsallowed.cached", "tsallowed.instance"]
)
def test_wrappers_and_instances_of_allowed_things_resolve(packages: Path, path: str) -> None:
    assert component_refusal(path) is None


def test_a_package_outside_the_list_is_never_imported(packages: Path) -> None:
    assert "is outside the allowed packages" in component_refusal("tsother.helper")
    assert "tsother" not in sys.modules and not (packages / "imported").exists()


def test_a_narrower_prefix_imports_nothing_else(packages: Path) -> None:
    ALLOWED_COMPONENT_PREFIXES.remove("tsallowed.")
    ALLOWED_COMPONENT_PREFIXES.append("tsallowed.safe.")
    try:
        assert component_refusal("tsallowed.safe.ok") is None
        assert "outside the allowed packages" in component_refusal("tsallowed.other.x")
        assert "tsallowed.other" not in sys.modules and not (packages / "other").exists()
    finally:
        ALLOWED_COMPONENT_PREFIXES.remove("tsallowed.safe.")
        ALLOWED_COMPONENT_PREFIXES.append("tsallowed.")


def test_a_denied_module_is_refused_before_it_is_imported() -> None:
    code = (
        "import sys; from tunesmith.config import component_refusal\n"
        "print(component_refusal('tunesmith.demo.run.run_demo'))\n"
        "print('tunesmith.demo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "'tunesmith.demo.run.run_demo' is denied: 'tunesmith.demo' loads pickles, TorchScript "
        "or downloaded code, or runs code or commands",
        "False",
    ]


# ----------------------------------------------------------------------------- arguments


def test_unsafe_arguments_are_found_nested() -> None:
    found = list(
        unsafe_arguments(
            {"a": 1, "kw": {"trust_remote_code": True}, "l": [{"weights_only": False}]}, "model"
        )
    )
    assert [path for path, _ in found] == ["model.kw.trust_remote_code", "model.l.0.weights_only"]
    assert list(unsafe_arguments({"trust_remote_code": False, "weights_only": True}, "m")) == []


def test_unsafe_arguments_are_refused_by_instantiate_and_validate() -> None:
    node = {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    cfg = OmegaConf.create({"m": {**node, "extra": {"inner": {"weights_only": False}}}})
    issues = validate_config(cfg)
    assert [i.path for i in issues if "weights_only=false" in i.message] == [
        "m.extra.inner.weights_only"
    ]
    with pytest.raises(ConfigError, match=r"^m\.extra\.inner\.weights_only: weights_only=false"):
        instantiate(cfg.m)
    allowed = validate_config(cfg, allow_any_component=True)  # the flag lifts it
    assert not [i for i in allowed if "weights_only" in i.path]
