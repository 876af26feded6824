"""The shipped configs take the fastest exact path, and the equivalence tests run on exactly
the settings they ship:

- every AdamW node of every shipped config is torch's fused kernel (``fused: true``); the
  fused step equals the for-loop step for each distinct AdamW setting the configs ship
  (component level), and through the SFT recipe on the tiny config's settings;
- every SFT config's loss owns the head projection (``LinearCrossEntropyLoss``; KD's
  ``KDLoss`` too); for each distinct shipped SFT loss node the recipe's run equals the plain
  full-logits cross-entropy run;
- SFT configs for real models pack their samples (``packed: true``);
- what stays opt-in is listed in each config's comments with numbers found in the results
  file the comment cites.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    REPO_ROOT,
    checkpoint_weights,
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.cli import catalog
from tunesmith.config.components import resolve_component
from tunesmith.models import llama3
from tunesmith.modules.losses import LinearCrossEntropyLoss

SHIPPED = [(r, c) for r in catalog.recipe_names() for c in catalog.config_names(r)]
PLAIN_CE = "tunesmith.modules.losses.CrossEntropyLoss"


def _raw(recipe: str, config: str) -> dict[str, Any]:
    """The config file as written (no interpolation resolved, no override applied)."""
    path = catalog.config_path(config, recipe)
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _adamw_nodes(node: Any, path: str = "") -> list[tuple[str, dict]]:
    """``(dotted path, node)`` of every ``torch.optim.AdamW`` component in the tree."""
    found = []
    if isinstance(node, dict):
        if node.get("_component_") == "torch.optim.AdamW":
            found.append((path.rstrip("."), node))
        for key, value in node.items():
            found += _adamw_nodes(value, f"{path}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _adamw_nodes(value, f"{path}{i}.")
    return found


def _distinct(nodes: list[dict]) -> list[dict]:
    seen = {json.dumps(n, sort_keys=True): n for n in nodes}
    return [seen[k] for k in sorted(seen)]


# What the configs ship, read from the files themselves: the equivalence tests below are
# parametrized over these, so a new setting in a config is a new equivalence case.
SHIPPED_ADAMW = _distinct([node for r, c in SHIPPED for _, node in _adamw_nodes(_raw(r, c))])
SHIPPED_SFT_LOSSES = _distinct([_raw("sft", c)["loss"] for c in catalog.config_names("sft")])


def _ids(nodes: list[dict]) -> list[str]:
    return [",".join(f"{k}={v}" for k, v in n.items() if k != "_component_") for n in nodes]


# -- what the configs say ----------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "config"), SHIPPED, ids=[f"{r}/{c}" for r, c in SHIPPED])
def test_shipped_config_takes_the_fast_path(recipe, config):
    raw = _raw(recipe, config)
    optimizers = _adamw_nodes(raw)
    assert optimizers, f"{recipe}/{config}: no AdamW node"
    for path, node in optimizers:
        assert node.get("fused") is True, f"{recipe}/{config}: {path}.fused is {node.get('fused')}"
    if recipe in ("sft", "kd"):
        loss_class = resolve_component(raw["loss"]["_component_"])
        assert getattr(loss_class, "needs_hidden_states", False), (
            f"{recipe}/{config}: loss {raw['loss']['_component_']} projects full logits"
        )
    if recipe == "sft" and raw["dataset"]["max_seq_len"] >= 512:  # a real model's config
        assert raw["packed"] is True, f"sft/{config}: packed is {raw['packed']}"


def test_the_equivalence_cases_are_the_shipped_settings():
    """The sets the equivalence tests run over hold the fast settings, and only shipped ones:
    the fused kernel in every AdamW case, the linear loss in every SFT loss case."""
    assert SHIPPED_ADAMW and all(node["fused"] is True for node in SHIPPED_ADAMW)
    assert SHIPPED_SFT_LOSSES
    for node in SHIPPED_SFT_LOSSES:
        assert resolve_component(node["_component_"]) is LinearCrossEntropyLoss
    tiny = _raw("sft", "tiny")  # the config the recipe-level cases run on
    assert tiny["optimizer"] in SHIPPED_ADAMW and tiny["loss"] in SHIPPED_SFT_LOSSES


_CITED = re.compile(r"benchmarks/results/[\w.-]+\.md")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


@pytest.mark.parametrize(("recipe", "config"), SHIPPED, ids=[f"{r}/{c}" for r, c in SHIPPED])
def test_opt_in_switches_are_listed_with_measured_numbers(recipe, config):
    text = catalog.config_path(config, recipe).read_text()
    block = re.search(r"^# Opt-in.*?(?=^[^#])", text, flags=re.M | re.S)
    assert block, f"{recipe}/{config}: no '# Opt-in' comment block"
    block = block.group(0)
    for switch in ("compile", "activation_checkpointing", "optimizer_in_backward", "8-bit"):
        assert switch in block, f"{recipe}/{config}: opt-in block does not list {switch}"
    cited = _CITED.findall(block)
    assert cited, f"{recipe}/{config}: the opt-in block cites no results file"
    results = " ".join((REPO_ROOT / c).read_text() for c in cited)
    quoted = [n for n in _NUMBER.findall(block.split(cited[-1], 1)[1]) if n not in ("8", "100")]
    assert len(quoted) >= 8
    for number in quoted:  # every number quoted after the citation is in the cited file
        assert re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d,]|\.\d)", results), number


# -- fused AdamW == for-loop AdamW, for each shipped setting -----------------------------------


def _train(options: dict, steps: int = 4) -> tuple[dict, dict]:
    """A tiny Llama trained ``steps`` AdamW steps with ``options`` on fixed batches; returns
    its parameters and the optimizer's moments."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    opt = torch.optim.AdamW(model.parameters(), **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.spec.vocab_size, (2, 12), generator=gen)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    moments = {
        names[id(p)]: (s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for p, s in opt.state.items()
    }
    return params, moments


@pytest.mark.parametrize("node", SHIPPED_ADAMW, ids=_ids(SHIPPED_ADAMW))
def test_fused_adamw_equals_the_for_loop_step(node):
    fused = {k: v for k, v in node.items() if k != "_component_"}
    for_loop = {**fused, "fused": False, "foreach": False}
    got, got_moments = _train(fused)
    want, want_moments = _train(for_loop)
    torch.manual_seed(0)
    initial = dict(llama3.llama3_tiny().named_parameters())
    lr = float(fused["lr"])
    moved = [k for k in want if (want[k] - initial[k]).abs().max() > lr / 2]
    assert moved, "AdamW must move the weights"
    ulp = torch.finfo(torch.float32).eps
    for key in want:  # within 1% of one step (lr) plus the weights' own rounding
        bound = lr * 1e-2 + 2 * ulp * want[key].abs()
        worst = ((got[key] - want[key]).abs() - bound).max()
        assert worst <= 0, f"{key}: fused and for-loop AdamW differ by {worst:.3g} over bound"
        for g, w in zip(got_moments[key], want_moments[key]):
            torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-4, msg=key)


# -- through the SFT recipe, on the tiny config's shipped settings -----------------------------

SGD = ["optimizer=torch.optim.SGD", "~optimizer.fused", "optimizer.lr=0.5"]
STEPS = ["max_steps=3", "max_grad_norm=null", "lr_scheduler.num_warmup_steps=1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast_defaults")
    return make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=16)


def _assert_same_run(out: Path, expected_out: Path, model_dir: Path, atol: float) -> None:
    weights, expected = final_weights(out), final_weights(expected_out)
    initial = checkpoint_weights(model_dir)
    assert weights.keys() == expected.keys()
    assert any(not torch.equal(expected[k], initial[k]) for k in expected), "must train"
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], atol=atol, rtol=1e-5, msg=key)
    got, want = read_metrics(out), read_metrics(expected_out)
    assert [got[s]["loss"] for s in (1, 2, 3)] == pytest.approx(
        [want[s]["loss"] for s in (1, 2, 3)], rel=1e-5
    )


@pytest.mark.parametrize("loss", SHIPPED_SFT_LOSSES, ids=_ids(SHIPPED_SFT_LOSSES))
def test_shipped_sft_loss_gives_the_full_logits_run(world, tmp_path, loss):
    """SGD (as in test_sft_memory_switches): Adam would magnify rounding-level gradient
    differences into visible updates; the optimizer has its own case above and below."""
    model_dir, data = world
    node = json.dumps(loss).replace('"', "")
    fast = run_sft(model_dir, data, tmp_path / "fast", *STEPS, *SGD, f"loss={node}")
    plain = run_sft(
        model_dir, data, tmp_path / "plain", *STEPS, *SGD, f"loss={{_component_: {PLAIN_CE}}}"
    )
    _assert_same_run(fast, plain, model_dir, atol=2e-6)


def test_tiny_config_as_shipped_equals_the_for_loop_adamw_run(world, tmp_path):
    """The tiny config untouched (linear CE, fused AdamW) vs the same with the for-loop
    AdamW: the same gradients, so the same steps up to the kernels' rounding."""
    model_dir, data = world
    shipped = run_sft(model_dir, data, tmp_path / "shipped", *STEPS)
    for_loop = run_sft(
        model_dir,
        data,
        tmp_path / "loop",
        *STEPS,
        "optimizer.fused=false",
        "optimizer.foreach=false",
    )
    _assert_same_run(shipped, for_loop, model_dir, atol=1e-6)
