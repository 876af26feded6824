"""Every ``_component_`` that tunesmith ships (configs, docs, README, examples, benchmarks)
resolves without ``--allow-any-component``, so a component left unmarked fails here; and what
tunesmith does not mark (code runners, helpers, methods through their class) is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, ALLOWED_COMPONENT_PREFIXES, component_refusal

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
