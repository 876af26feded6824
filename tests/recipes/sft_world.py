"""A tiny, fully local world for recipe tests: a HF model folder (our builder, a trained tiny
tokenizer with the Qwen2.5 chat template), synthetic chat datasets, and helpers that run any
recipe on its shipped config (in this process, or on several local ranks as torchrun would
start them) and read back what it wrote. Preference data lives in
:mod:`tests.recipes.preference_world`.

Example::

    model_dir = make_model_dir(tmp_path)
    data = make_chat_data(tmp_path / "chat.jsonl")
    out = run_recipe("sft", "tiny", model_dir, data, tmp_path / "out", "max_steps=2")
    read_metrics(out)[2]["loss"]
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import socket
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torch import nn

from tests import forked
from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.cli import catalog
from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, load_config
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, PEFT_KEY_PREFIX
from tunesmith.models.safetensors_io import find_weight_files
from tunesmith.training import CheckpointDirectory

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_model_dir(
    root: Path, seed: int = 0, family: ModuleType = qwen2_5, **spec_overrides
) -> Path:
    """A HF folder with a tiny model of ``family`` (a zoo module, e.g. ``qwen3_moe``; its
    ``<name>_tiny`` size; default Qwen2.5) and a tokenizer; returns its path. The model's
    vocabulary is the tokenizer's unless ``spec_overrides`` sets ``vocab_size`` (more rows than
    ids: padding rows no token reaches)."""
    tok_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5")
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    name = f"{family.__name__.rsplit('.', 1)[-1]}_tiny"
    spec = family.spec(name, **{"vocab_size": vocab, **spec_overrides})
    torch.manual_seed(seed)
    model = build_model(spec)
    return save_hf_checkpoint(model, root / "model", source_dir=tok_dir)


def make_chat_data(path: Path, rows: int = 32, seed: int = 0) -> Path:
    """JSONL of one-turn conversations: 'add A and B' -> 'A+B'."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            messages = [
                {"role": "user", "content": f"add {a} and {b}"},
                {"role": "assistant", "content": f"{a + b}"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def make_counting_data(path: Path, rows: int = 32, seed: int = 0) -> Path:
    """JSONL of one-turn conversations whose answers differ in length ('count 3 from 7' ->
    '7 8 9'), so samples train different numbers of tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            start, n = rng.randint(0, 40), rng.randint(1, 6)
            messages = [
                {"role": "user", "content": f"count {n} from {start}"},
                {"role": "assistant", "content": " ".join(str(start + i) for i in range(n))},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def sample_lengths(model_dir: Path, data: Path) -> list[int]:
    """Token length of every sample the recipe's dataset builds from ``data``."""
    dataset = SFTDataset(Tokenizer.from_pretrained(model_dir), source=str(data))
    return [len(s["input_ids"]) for s in dataset.samples]


def make_equal_length_data(path: Path, model_dir: Path, rows: int, seed: int = 0) -> int:
    """Write ``rows`` addition conversations that all tokenize to the same length L (the most
    common one among candidates); returns L. Packing such samples into ``k * L`` tokens puts
    exactly ``k`` consecutive samples in each pack."""
    candidates = make_chat_data(path.with_suffix(".candidates.jsonl"), rows=20 * rows, seed=seed)
    lines = candidates.read_text().splitlines()
    lengths = sample_lengths(model_dir, candidates)
    length = Counter(lengths).most_common(1)[0][0]
    chosen = [line for line, n in zip(lines, lengths) if n == length][:rows]
    if len(chosen) < rows:
        raise ValueError(f"only {len(chosen)} candidate rows have {length} tokens, need {rows}")
    path.write_text("\n".join(chosen) + "\n")
    return length


def recipe_overrides(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> list[str]:
    """The overrides that point a shipped config at the local world (no progress bar), plus
    ``overrides``; the same for every recipe, in this process or on the command line.

    Example::

        >>> recipe_overrides(Path("m"), Path("d.jsonl"), Path("out"), "max_steps=2")[-1]
        'max_steps=2'
    """
    base = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={output_dir}"]
    return [*base, "progress_bar=false", *overrides]


sft_overrides = recipe_overrides
"""The name the SFT and fault tests know :func:`recipe_overrides` by."""


def recipe_config(
    recipe: str,
    config: str,
    model_dir: Path,
    data: Path,
    output_dir: Path,
    *overrides: str,
    val: Path | None = None,
) -> DictConfig:
    """The shipped ``config`` of ``recipe`` pointed at the local world, with ``overrides``;
    ``val`` (a data file) becomes ``val_dataset``, built like the training set.

    Example::

        cfg = recipe_config("dpo", "tiny", model_dir, data, out, "max_steps=2")
    """
    cfg = load_config(
        catalog.config_path(config, recipe),
        recipe_overrides(model_dir, data, output_dir, *overrides),
    )
    if val is not None:
        cfg.val_dataset = OmegaConf.merge(cfg.dataset, {"source": str(val)})
    return cfg


def run_config(recipe: str, cfg: DictConfig) -> None:
    """Run the built-in ``recipe``'s ``main(cfg)`` in this process on one intra-op thread (so
    runs compare bitwise whatever thread count the caller has).

    Example::

        run_config("kd", recipe_config("kd", "tiny", m, d, out))
    """
    module = importlib.import_module(f"tunesmith.recipes.{recipe}")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.main(cfg)
    finally:
        torch.set_num_threads(previous)


def run_recipe(
    recipe: str,
    config: str,
    model_dir: Path,
    data: Path,
    output_dir: Path,
    *overrides: str,
    val: Path | None = None,
) -> Path:
    """Run ``recipe`` on its shipped ``config`` in this process (see :func:`recipe_config`
    for ``val``); returns ``output_dir``.

    Example::

        run_recipe("dpo", "tiny_lora", model_dir, data, out, "max_steps=4")
    """
    cfg = recipe_config(recipe, config, model_dir, data, output_dir, *overrides, val=val)
    run_config(recipe, cfg)
    return output_dir


def run_sft(
    model_dir: Path, data: Path, output_dir: Path, *overrides: str, config: str = "tiny"
) -> Path:
    """:func:`run_recipe` of the SFT recipe on its shipped ``config``; returns ``output_dir``.

    Example::

        run_sft(model_dir, data, tmp_path / "out", "max_steps=2")
    """
    return run_recipe("sft", config, model_dir, data, output_dir, *overrides)


_KEPT_MODELS: dict[str, nn.Module] = {}


def keep_model(model: nn.Module, key: str) -> nn.Module:
    """Test-only model component: remember ``model`` under ``key`` and return it unchanged.
    :func:`run_recipe_keeping_model` wraps a config's model in it to get the trained model."""
    _KEPT_MODELS[key] = model
    return model


@contextmanager
def _any_component_allowed() -> Iterator[None]:
    """Lift the component allow-list (test components such as :func:`keep_model` are outside
    it) for the duration, then restore the environment as it was."""
    previous = os.environ.get(ALLOW_ANY_COMPONENT_ENV)
    os.environ[ALLOW_ANY_COMPONENT_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ALLOW_ANY_COMPONENT_ENV)
        else:
            os.environ[ALLOW_ANY_COMPONENT_ENV] = previous


def run_recipe_keeping_model(
    recipe: str, config: str, model_dir: Path, data: Path, output_dir: Path, *overrides: str
) -> tuple[Path, nn.Module]:
    """:func:`run_recipe`, also returning the model object the recipe trained, as it left it
    (the config's model is wrapped in :func:`keep_model`).

    Example::

        out, policy = run_recipe_keeping_model("dpo", "tiny_lora", m, d, out)
    """
    cfg = recipe_config(recipe, config, model_dir, data, output_dir, *overrides)
    key = f"{recipe}:{output_dir}"
    cfg.model = OmegaConf.create(
        {"_component_": f"{__name__}.keep_model", "model": cfg.model, "key": key}
    )
    with _any_component_allowed():
        run_config(recipe, cfg)
    return output_dir, _KEPT_MODELS.pop(key)


def run_sft_keeping_model(
    model_dir: Path, data: Path, output_dir: Path, *overrides: str, config: str = "tiny"
) -> tuple[Path, nn.Module]:
    """:func:`run_recipe_keeping_model` of the SFT recipe on its shipped ``config``.

    Example::

        out, model = run_sft_keeping_model(m, d, out, config="tiny_lora")
    """
    return run_recipe_keeping_model("sft", config, model_dir, data, output_dir, *overrides)


def _records(output_dir: Path) -> list[dict[str, float]]:
    """Every record the JSONL logger wrote to ``output_dir/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """The JSONL logger's training records by step (those with ``loss``; a later record wins).

    Example::

        read_metrics(run_sft(m, d, out, "max_steps=2"))[2]["loss"]
    """
    return {r.pop("step"): r for r in _records(output_dir) if "loss" in r}


def read_eval_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """The JSONL logger's validation records (``val_loss`` and the other ``val_*`` keys) by
    step (a later record wins).

    Example::

        read_eval_metrics(out)[80]["val_rewards/accuracy"]
    """
    return {r.pop("step"): r for r in _records(output_dir) if "val_loss" in r}


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (housekeeping dirs are left alone)."""
    return CheckpointDirectory(output_dir / "checkpoints", clean_stale=False).list()


def checkpoint_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The exported weights of a checkpoint folder: the HF model's, or for a LoRA/DoRA run the
    PEFT adapter's tensors (under our names, without PEFT's ``base_model.model.`` prefix)."""
    if (step_dir / ADAPTER_CONFIG_NAME).is_file():
        tensors = load_file(step_dir / ADAPTER_WEIGHTS_NAME)
        return {k.removeprefix(PEFT_KEY_PREFIX): v for k, v in tensors.items()}
    files, _ = find_weight_files(step_dir)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the newest complete checkpoint of a run."""
    return checkpoint_weights(checkpoints(output_dir)[-1])


def assert_same_weights(
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    atol: float | Callable[[str], float],
) -> None:
    """``got`` holds exactly ``expected``'s tensors, each within ``atol`` of it (``rtol`` 0; a
    function of the tensor's name gives each its own); a mismatch names the tensor.

    Example::

        assert_same_weights(final_weights(accum), final_weights(big), 1e-6)
    """
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    for name in expected:
        torch.testing.assert_close(
            got[name],
            expected[name],
            atol=atol(name) if callable(atol) else atol,
            rtol=0,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def largest_change(weights: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    """The largest absolute change of any tensor of ``initial`` in ``weights``: how far training
    moved them (a comparison within a tolerance tests little unless this is well above it).

    Example::

        assert largest_change(final_weights(out), checkpoint_weights(model_dir)) > 1e-3
    """
    return max((weights[k] - initial[k]).abs().max().item() for k in initial)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for recipe subprocesses: this repo importable (test components, drivers),
    one intra-op thread like the in-process runs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def cli_command(*args: str) -> list[str]:
    """``tunesmith ARGS...`` as a subprocess command line (this interpreter)."""
    return [sys.executable, "-m", "tunesmith.cli.main", *args]


def free_port() -> int:
    """A TCP port nobody listens on right now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH = "tunesmith.cli.launch"
"""The module torchrun runs in every rank of ``tunesmith run --nproc-per-node N``."""


def launch_ranks(
    overrides: list[str],
    log_dir: Path,
    *,
    recipe: str = "sft",
    config: str = "tiny",
    world_size: int = 2,
    timeout: float = 120,
) -> None:
    """Run ``recipe`` on its shipped ``config`` on ``world_size`` local ranks, started the way
    torchrun would (``python -m tunesmith.cli.launch`` in each rank's process, with the torchrun
    environment; the processes are forked from the suite's fork server, :mod:`tests.forked`),
    and wait for them; a failing rank fails with the tail of its log (``log_dir/rank<N>.log``)
    and stops the others.

    Example::

        launch_ranks(recipe_overrides(m, d, out), tmp_path, recipe="dpo")
    """
    argv = [str(catalog.recipe_path(recipe)), str(catalog.config_path(config, recipe)), *overrides]
    for attempt in range(2):
        codes, logs = _start_ranks(argv, log_dir, world_size, timeout)
        failed = [r for r, code in enumerate(codes) if code != 0]
        if not failed:
            return
        # the first to fail by its own hand (the others were killed: -9)
        r = next((r for r in failed if codes[r] != -9), failed[0])
        tail = logs[r].read_text()[-3000:]
        if attempt == 0 and _not_the_runs_fault(codes[r], tail):
            warnings.warn(
                f"rank {r} failed ({codes[r]}) outside the run; launched again:\n{tail}",
                stacklevel=2,
            )
            continue
        raise AssertionError(f"rank {r} failed ({codes[r]}):\n{tail}")


def _start_ranks(
    argv: list[str], log_dir: Path, world_size: int, timeout: float
) -> tuple[list[int], list[Path]]:
    port = str(free_port())
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
    ranks = []
    for r, log in enumerate(logs):
        env = subprocess_env(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        log.write_text("")
        ranks.append(forked.start(forked.run_module, LAUNCH, argv, log=log, env=env))
    return forked.wait_all(ranks, timeout=timeout), logs


def _not_the_runs_fault(code: int, log: str) -> bool:
    """A rank that failed for a reason outside the run, worth one more launch: the rendezvous
    port taken by another process between :func:`free_port` and rank 0's bind (the suite's
    workers race for ports), or glibc aborting on a heap it found corrupt in native code
    (``malloc(): unaligned tcache chunk detected`` ended a TP rank once in a CI run of the
    suite; Python code cannot corrupt the heap). Anything else fails the test at once.

    >>> _not_the_runs_fault(1, "TCPStore: bind failed: EADDRINUSE")
    True
    >>> _not_the_runs_fault(-6, "malloc(): unaligned tcache chunk detected")
    True
    >>> _not_the_runs_fault(1, "AssertionError: weights differ"), _not_the_runs_fault(-6, "abort")
    (False, False)
    """
    port_taken = "EADDRINUSE" in log or "address already in use" in log.lower()
    heap = code == -signal.SIGABRT and ("malloc(" in log or "free(" in log)
    return port_taken or heap


def noise_tolerance(atol: float) -> Callable[[str], float]:
    """``atol`` for every tensor but a key bias (``k_proj.bias``), which gets 5e-5: softmax
    ignores a value added to every score of a query, so that bias's gradient is zero in exact
    arithmetic and what arrives is rounding noise, which Adam scales into steps of about
    ``lr x |g| / (|g| + eps)``; two layouts that round differently move it ~1e-5 apart.

    >>> tolerance = noise_tolerance(1e-6)
    >>> tolerance("model.layers.0.self_attn.k_proj.bias"), tolerance("lm_head.weight")
    (5e-05, 1e-06)
    """
    return lambda name: max(atol, 5e-5) if name.endswith("k_proj.bias") else atol


def assert_same_as_single(
    model_dir: Path,
    single: Path,
    distributed: Path,
    *,
    steps: int,
    ranks: int = 2,
    resumed: bool = False,
    lora: bool = False,
) -> None:
    """``distributed`` is one world of ``ranks`` ranks that logged the single process's
    losses, grad norms and token counts at each of ``steps`` steps and ended with its weights
    (which moved from ``model_dir``'s). ``resumed``: it stopped and resumed, so it kept an
    earlier checkpoint too (only the last must be step ``steps``); ``lora``: its checkpoints
    are LoRA adapters (PEFT folders), whose B matrices (zero at the start) moved.

    Example::

        assert_same_as_single(model_dir, single, fsdp, steps=3, resumed=True, lora=True)
    """
    if resumed:
        assert checkpoints(distributed)[-1].name == f"step_{steps:06d}"
    else:
        assert [p.name for p in checkpoints(distributed)] == [f"step_{steps:06d}"]
    assert (checkpoints(distributed)[-1] / ADAPTER_CONFIG_NAME).is_file() is lora
    state = checkpoints(distributed)[-1] / "training_state"
    assert sorted(p.name for p in state.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(ranks)]
    logged_1, logged_2 = read_metrics(single), read_metrics(distributed)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, steps + 1))
    for step in logged_1:
        one, two = logged_1[step], logged_2[step]
        assert one["trained_tokens_in_window"] == two["trained_tokens_in_window"]
        assert one["tokens_seen"] == two["tokens_seen"]
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-5), f"loss at step {step}"
        assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5), f"step {step}"
    weights_1, weights_2 = final_weights(single), final_weights(distributed)
    assert weights_1.keys() == weights_2.keys()
    assert_same_weights(weights_2, weights_1, noise_tolerance(1e-5))
    if lora:
        assert min(w.abs().max().item() for n, w in weights_1.items() if ".lora_B." in n) > 1e-4
        return
    initial = checkpoint_weights(model_dir)
    assert max((weights_1[k] - initial[k]).abs().max().item() for k in initial) > 1e-3


RESUME_COMPARED = ("loss", "lr", "grad_norm", "tokens_seen", "trained_tokens_in_window")
"""The metrics a resumed run logs exactly as the uninterrupted one."""


def assert_resumed_as_uninterrupted(
    resumed: Path,
    uninterrupted: Path,
    *,
    steps: int,
    from_step: int = 1,
    compared: tuple[str, ...] = RESUME_COMPARED,
) -> None:
    """A run stopped and resumed (``resumed``) ended with bitwise the weights of the
    ``uninterrupted`` one; both logged steps 1 to ``steps``, with the same ``compared``
    metrics from ``from_step`` on.

    Example::

        assert_resumed_as_uninterrupted(out, reference, steps=10, from_step=5)
    """
    assert_same_weights(final_weights(resumed), final_weights(uninterrupted), 0.0)  # bitwise
    logged, expected = read_metrics(resumed), read_metrics(uninterrupted)
    assert sorted(logged) == sorted(expected) == list(range(1, steps + 1))
    for step in range(from_step, steps + 1):
        for key in compared:
            assert logged[step][key] == expected[step][key], f"{key} at step {step}"
