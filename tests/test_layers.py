"""The layers of docs/architecture.md, checked on the source: every import between tunesmith's
subpackages (function-level and ``TYPE_CHECKING`` imports included) points downwards, so there
is no import cycle between them; and no two modules import each other, even through others
(function-level imports included; ``TYPE_CHECKING`` imports, which never run, excluded).

Example of the check on one edge::

    >>> allowed("training", "models"), allowed("models", "training")
    (True, False)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tunesmith

PACKAGE = Path(tunesmith.__file__).parent

# Higher imports lower, never the other way; equal ranks are siblings that import neither.
# "tunesmith" is the package's own __init__ (``tunesmith.run``, imported lazily from recipes).
RANKS = {
    "tunesmith": 10,
    "cli": 9,
    "demo": 8,  # the demo app, beside the CLI: the CLI runs it, it never imports the CLI
    "recipes": 7,
    "rl": 6,
    "training": 5,
    "data": 4,
    "generation": 4,
    "models": 3,
    "modules": 2,
    "config": 1,
}

# Imports that break the order today, each with the reason it is tolerated: none.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def allowed(source: str, target: str) -> bool:
    """Whether subpackage ``source`` may import subpackage ``target``."""
    return source == target or RANKS[source] > RANKS[target]


def _layer(dotted: str) -> str:
    """``tunesmith.models.hf`` -> ``models``; the package itself (and any top-level module
    file of it) -> ``tunesmith``."""
    parts = dotted.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "tunesmith"


def _imports(text: str, module: tuple[str, ...]) -> list[tuple[str, int]]:
    """Every tunesmith module the source ``text`` of ``module`` (its dotted parts, ending in
    ``__init__`` for a package) imports, anywhere in the file, with its line."""
    package = list(module[:-1])
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        else:
            continue
        found += [(n, node.lineno) for n in names if n == "tunesmith" or n.startswith("tunesmith.")]
    return found


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        module = path.relative_to(PACKAGE.parent).with_suffix("").parts
        for name, line in _imports(path.read_text(encoding="utf-8"), module):
            target = _layer(name)
            if target != source:
                edges[(source, target)].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages - RANKS.keys() == set(), "add the new subpackage to RANKS (and the docs)"


def test_imports_point_downwards():
    edges = _edges()
    assert edges, "no imports found: the walk is broken"
    bad = [
        f"{source} -> {target} ({', '.join(where[:3])})"
        for (source, target), where in sorted(edges.items())
        if not allowed(source, target) and (source, target) not in EXCEPTIONS
    ]
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)


def test_the_exceptions_are_still_needed():
    edges = _edges()
    assert [e for e in EXCEPTIONS if e not in edges] == []


def test_the_walk_sees_function_level_and_relative_imports():
    """An upward import hidden in a function (the old demo -> cli cycle) is found."""
    text = "def f():\n    from tunesmith.cli.main import build_parser\nfrom ..models import hf\n"
    found = _imports(text, ("tunesmith", "demo", "run"))
    assert sorted(found) == [("tunesmith.cli.main", 2), ("tunesmith.models", 3)]
    assert [_layer(n) for n, _ in sorted(found)] == ["cli", "models"]
    assert not allowed("demo", "cli")


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that ``path`` imports when it runs: anywhere in the file but
    under ``if TYPE_CHECKING:``; ``from package import name`` counts the submodule ``name``
    when there is one, else the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If)
        and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in block.body
        for n in ast.walk(statement)
    }
    package = _module_name(path).split(".")
    package = package if path.name == "__init__.py" else package[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {
                f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                for a in node.names
            }
    return {name for name in found if name in modules}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (Tarjan's
    strongly connected components with more than one module, or a module importing itself).

    >>> import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_two_modules_import_each_other():
    modules = _modules()
    graph = {name: _runtime_imports(path, modules) - {name} for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 300, "few imports found: the walk is broken"
    assert import_cycles(graph) == [], "modules that import each other (move what both need "
    "into a module below them)"


def test_the_module_walk_sees_submodules_and_skips_type_checking():
    modules = _modules()
    setup = _runtime_imports(PACKAGE / "rl" / "setup.py", modules)
    assert {"tunesmith.rl.asynchronous.workers", "tunesmith.training.settings"} <= setup
    family = _runtime_imports(PACKAGE / "models" / "family.py", modules)
    assert "tunesmith.models.spec" not in family  # imported under TYPE_CHECKING only


# Inside the two largest subpackages the same rule holds between their parts: a part imports
# only parts of a lower rank (or itself). Each part is a set of first names under the package
# (a module or a folder); "*" is every other one.
PARTS = {
    "training": {
        "settings": (1, {"rules", "settings", "precision", "lr_schedules"}),  # the table
        "logging": (1, {"logging"}),
        "parallel": (2, {"parallel"}),
        "checkpoint": (3, {"checkpoint"}),
        "memory": (3, {"memory"}),
        "loop": (4, {"objectives", "*"}),  # trainer, sources, loop, setup, parallelize, ...
    },
    "rl": {
        # prompts, groups, rollout, advantages, source, envs (environments and tools), ...
        "pieces": (1, {"rewards", "envs", "*"}),
        "ppo": (2, {"ppo"}),
        "asynchronous": (2, {"asynchronous"}),
        "recipes' glue": (3, {"settings", "setup"}),
    },
}


def _part(package: str, dotted: str) -> str | None:
    """The part of ``package`` (a key of PARTS) that module ``dotted`` belongs to, or None
    outside it.

    >>> _part("training", "tunesmith.training.parallel.distributed"), _part("rl", "tunesmith.rl.source")
    ('parallel', 'pieces')
    """
    prefix = f"tunesmith.{package}."
    if not dotted.startswith(prefix):
        return None
    first = dotted.removeprefix(prefix).split(".")[0]
    named = [name for name, (_, members) in PARTS[package].items() if first in members]
    return named[0] if named else next(n for n, (_, m) in PARTS[package].items() if "*" in m)


def test_parts_of_training_and_rl_point_downwards():
    modules = _modules()
    bad, checked = [], 0
    for name, path in sorted(modules.items()):
        for package, parts in PARTS.items():
            source = _part(package, name)
            if source is None or name == f"tunesmith.{package}":
                continue
            for target in sorted(_runtime_imports(path, modules)):
                part = _part(package, target)
                if part is None or target == f"tunesmith.{package}" or part == source:
                    continue
                checked += 1
                if parts[source][0] <= parts[part][0]:
                    bad.append(f"{name} ({source}) -> {target} ({part})")
    assert checked > 50, "few imports between parts found: the walk is broken"
    assert bad == [], "imports against the parts' order:\n" + "\n".join(bad)


def test_every_folder_of_training_and_rl_has_a_part():
    for package, parts in PARTS.items():
        named = set().union(*(members for _, members in parts.values()))
        folders = {p.name for p in (PACKAGE / package).iterdir() if (p / "__init__.py").exists()}
        assert folders - named == set(), f"give the new folder of {package} a part in PARTS"
