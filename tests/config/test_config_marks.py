"""Every ``_component_`` that tunesmith ships (configs, docs, README, examples, benchmarks)
resolves without ``--allow-any-component``, so a component left unmarked fails here; and what
tunesmith does not mark (code runners, helpers, methods through their class) is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, ALLOWED_COMPONENT_PREFIXES, component_refusal
from tunesmith.config.registry import is_marked, marked_objects

ROOT = Path(__file__).resolve().parents[2]
# the configs, the docs and the package's own code (defaults a recipe builds, docstrings)
SHIPPED = ["tunesmith", "docs", "README.md", "examples", "benchmarks"]
SUFFIXES = {".yaml", ".yml", ".md", ".py", ".json"}
# `_component_: x.y`, `"_component_": "x.y"`, `loss._component_=x.y` (an override)
_COMPONENT = re.compile(r"""_component_['"]?\s*[:=]\s*['"]?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)""")


def _files() -> list[Path]:
    found: list[Path] = []
    for name in SHIPPED:
        path = ROOT / name
        found += [path] if path.is_file() else sorted(path.rglob("*"))
    return [f for f in found if f.is_file() and f.suffix in SUFFIXES]


def shipped_components() -> dict[str, list[str]]:
    """Every dotted ``_component_`` path of an allowed package written in the shipped files ->
    where it is written (``file:line``). Paths of other packages (a benchmark's own loggers,
    run with the opt-in) are a user's own, not tunesmith's to mark."""
    found: dict[str, list[str]] = {}
    for file in _files():
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            for path in _COMPONENT.findall(line):
                if not any(f"{path}.".startswith(p) for p in ALLOWED_COMPONENT_PREFIXES):
                    continue
                found.setdefault(path, []).append(f"{file.relative_to(ROOT)}:{number}")
    return found


SHIPPED_COMPONENTS = shipped_components()


def test_the_scan_finds_the_shipped_components() -> None:
    assert "tunesmith.data.Tokenizer.from_pretrained" in SHIPPED_COMPONENTS
    assert "torch.optim.AdamW" in SHIPPED_COMPONENTS
    assert len(SHIPPED_COMPONENTS) >= 30, sorted(SHIPPED_COMPONENTS)


@pytest.mark.parametrize("path", sorted(SHIPPED_COMPONENTS))
def test_every_shipped_component_resolves_without_the_flag(path: str, monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)
    refusal = component_refusal(path)
    assert refusal is None, f"{SHIPPED_COMPONENTS[path][0]}: {refusal}"


# ----------------------------------------------------------------------------- what is unmarked

UNMARKED = {  # tunesmith callables that run code, write files or are internals: never built
    "tunesmith.rl.rewards.run_sandboxed": "runs any Python it is given",
    "tunesmith.rl.rewards.sandbox.run_sandboxed": "the same, by its own module",
    "tunesmith.rl.rewards.code.harness": "builds the program CodeTests runs",
    "tunesmith.rl.rewards.code.extract_code": "a helper of CodeTests",
    "tunesmith.data.tokenizer.Tokenizer": "the class (only from_pretrained is a component)",
    "tunesmith.models.hf.save_hf_checkpoint": "writes a folder wherever it is told",
    "tunesmith.models.hf.load_hf_weights": "a helper of from_hf",
    "tunesmith.training.logging.loggers.append_record": "appends to any open file",
    "tunesmith.training.lr_schedules.set_schedule_params": "mutates a scheduler",
}


@pytest.mark.parametrize("path", sorted(UNMARKED))
def test_unmarked_tunesmith_callables_are_refused(path: str, monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ANY_COMPONENT_ENV, raising=False)
    refusal = component_refusal(path)
    assert refusal is not None and "which is not marked as a component" in refusal, refusal
    assert "@tunesmith.config.component" in refusal and "ALLOWED_COMPONENT_PREFIXES" in refusal


def test_no_code_runner_is_marked() -> None:
    """Every marked object, once the packages that define components are imported: none is
    defined in the sandbox module, none is the harness."""
    import tunesmith.data
    import tunesmith.models
    import tunesmith.modules.losses
    import tunesmith.rl.advantages
    import tunesmith.rl.prompts
    import tunesmith.rl.rewards
    import tunesmith.training  # noqa: F401

    marked = marked_objects()
    assert len(marked) >= 40, marked
    places = {(getattr(o, "__module__", ""), getattr(o, "__qualname__", "")) for o in marked}
    assert not [p for p in places if p[0].endswith(".sandbox") or "harness" in p[1]], places
    assert ("tunesmith.rl.rewards.code", "CodeTests") in places  # the reward class itself is


def test_the_mark_is_on_the_object_not_inherited() -> None:
    """A subclass, a ``functools.wraps`` wrapper (which copies ``__dict__``) and a method of a
    marked class are not marked; a re-export is the same object, so it is."""
    import functools

    from tunesmith.data import Tokenizer
    from tunesmith.modules.losses import CrossEntropyLoss
    from tunesmith.training import cosine_with_warmup
    from tunesmith.training.lr_schedules import cosine_with_warmup as defined

    class Sub(CrossEntropyLoss):
        pass

    wrapper = functools.wraps(cosine_with_warmup)(lambda *a, **k: None)
    assert is_marked(CrossEntropyLoss) and not is_marked(Sub)
    assert is_marked(cosine_with_warmup) and cosine_with_warmup is defined
    assert not is_marked(wrapper) and wrapper.__wrapped__ is cosine_with_warmup
    assert is_marked(Tokenizer.from_pretrained) and not is_marked(Tokenizer)
    assert not is_marked(Tokenizer.encode)
