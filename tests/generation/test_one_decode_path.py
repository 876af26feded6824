"""One decode path: only the engine calls generate() (or generate_paged()); greedy is a
GenerationConfig; the engine options the call sites need (per-row limits, a seeded generator)
decode as the function the engine calls does (generate_paged() by default, generate() for
``EngineSettings(paged=False)``)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import tunesmith
from tunesmith.generation import GenerationConfig, LocalEngine, generate, generate_with
from tunesmith.generation.config import EngineSettings
from tunesmith.generation.paged import generate_paged
from tunesmith.models import llama3
from tunesmith.rl.setup import generation_config

PACKAGE = Path(tunesmith.__file__).parent
ENGINE = "generation/engine.py"
GENERATION_MODULES = (
    "tunesmith.generation",
    "tunesmith.generation.generate",
    "tunesmith.generation.paged",
)
DECODERS = ("generate", "generate_paged")  # the decode functions only the engine may use
PROMPTS = [[1, 5, 7, 9], [1, 12], [1, 30, 31, 32, 33, 34]]


def generate_uses(source: str) -> list[int]:
    """Lines of ``source`` that use :func:`tunesmith.generation.generate` or
    :func:`tunesmith.generation.paged.generate_paged` (by any import name, called or passed
    on), imports excluded."""
    tree = ast.parse(source)
    functions, modules = set(), set()  # local names of the function and of its modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in GENERATION_MODULES:
            functions |= {a.asname or a.name for a in node.names if a.name in DECODERS}
            if node.module == "tunesmith.generation":
                modules |= {a.asname or a.name for a in node.names if a.name == "paged"}
        elif isinstance(node, ast.ImportFrom) and node.module == "tunesmith":
            modules |= {a.asname or a.name for a in node.names if a.name == "generation"}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in GENERATION_MODULES:
                    modules.add(alias.asname or alias.name)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in functions:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in DECODERS:
            owner = ast.unparse(node.value)
            if owner in modules or owner in GENERATION_MODULES:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_use_finder_sees_every_way_to_reach_generate():
    source = (
        "from tunesmith.generation import generate\n"
        "from tunesmith.generation.generate import generate as g2\n"
        "import tunesmith.generation.generate as gen\n"
        "from tunesmith import generation\n"
        "import tunesmith.generation\n"
        "generate(m, p)\n"
        "g2(m, p)\n"
        "gen.generate(m, p)\n"
        "generation.generate(m, p)\n"
        "tunesmith.generation.generate(m, p)\n"
        "fn = generate\n"
        "engine.generate(p)\n"  # an engine's method: fine
        "from tunesmith.generation.paged import generate_paged\n"
        "from tunesmith.generation import paged as pg\n"
        "generate_paged(m, p)\n"
        "pg.generate_paged(m, p)\n"
        "tunesmith.generation.paged.generate_paged(m, p)\n"
    )
    assert generate_uses(source) == [6, 7, 8, 9, 10, 11, 15, 16, 17]


def test_only_the_engine_calls_generate():
    """Every decode goes through a RolloutEngine (generate_with): a call site that calls
    generate() or generate_paged() itself would bypass the engine (and a vLLM engine)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        lines = generate_uses(path.read_text())
        if lines:
            found[relative] = lines
    assert set(found) == {ENGINE}, (
        f"generate() used outside {ENGINE}: "
        f"{ {k: v for k, v in found.items() if k != ENGINE} }; decode through "
        "tunesmith.generation.generate_with(engine, prompt_ids, row_keys, config, stop_ids)"
    )


def test_greedy_is_a_generation_config_and_bad_temperatures_are_refused():
    greedy = GenerationConfig(max_new_tokens=8, temperature=0.0)
    assert greedy.temperature == 0.0 and greedy.max_new_tokens == 8
    for bad in (-0.5, math.nan):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            GenerationConfig(temperature=bad)


def test_an_rl_config_still_refuses_greedy_decoding():
    cfg = OmegaConf.create({"generation": {"temperature": 0, "max_new_tokens": 4}})
    with pytest.raises(ValueError, match="must be > 0 for RL sampling"):
        generation_config(cfg)
    ok = generation_config(OmegaConf.create({"generation": {"temperature": 0.7}}))
    assert ok.temperature == 0.7


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3.llama3_tiny().eval()


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "plain"])
def test_greedy_config_with_row_limits_is_generate_called_directly(paged):
    model = tiny()
    limits = [3, 6, 1]
    call = generate_paged if paged else generate
    direct = call(model, PROMPTS, max_new_tokens=limits, stop_token_ids=[3], pad_id=0)
    greedy = GenerationConfig(max_new_tokens=99, temperature=0.0)
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(paged=paged))
    out = generate_with(engine, PROMPTS, None, greedy, [3], max_new_tokens=limits)
    assert out.sequences == direct.sequences and out.logprobs == direct.logprobs
    assert out.finish_reasons == direct.finish_reasons


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "plain"])
def test_a_seeded_generator_samples_as_generate_with_that_generator(paged):
    model = tiny()
    config = GenerationConfig(max_new_tokens=6, temperature=0.9, top_k=40)
    settings = dict(max_new_tokens=6, temperature=0.9, top_k=40, pad_id=0)
    mine, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    # without row keys the paged engine draws in its own order: compare it to generate_paged
    call = generate_paged if paged else generate
    engine = LocalEngine(
        model, None, pad_id=0, generator=mine, settings=EngineSettings(paged=paged)
    )
    for _ in range(2):  # the generator goes on between calls, as a chat's does
        direct = call(model, PROMPTS, generator=theirs, **settings)
        out = generate_with(engine, PROMPTS, None, config, [])
        assert out.sequences == direct.sequences and out.logprobs == direct.logprobs
