"""A tiny, fully local world for recipe tests: a HF model folder (our builder, a trained tiny
tokenizer with the Qwen2.5 chat template), synthetic chat datasets, and helpers that run the SFT
recipe (in this process or through the CLI) and read back what it wrote."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torch import nn

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


def make_model_dir(root: Path, seed: int = 0, **spec_overrides) -> Path:
    """A HF folder with a tiny Qwen2.5-style model and tokenizer; returns its path."""
    tok_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5")
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    spec = qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab, **spec_overrides)
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


def tiny_config(
    model_dir: Path, data: Path, output_dir: Path, *overrides: str, config: str = "tiny"
) -> DictConfig:
    """The shipped SFT ``config`` (`tiny`, `tiny_lora`) pointed at the local world, with
    ``overrides``."""
    base = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={output_dir}"]
    return load_config(catalog.config_path(config, "sft"), [*base, *overrides])


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


def run_sft(
    model_dir: Path, data: Path, output_dir: Path, *overrides: str, config: str = "tiny"
) -> Path:
    """Run the SFT recipe on the shipped ``config`` in this process on one intra-op thread (so
    runs compare bitwise whatever thread count the caller has); returns ``output_dir``."""
    _run_config(
        tiny_config(model_dir, data, output_dir, "progress_bar=false", *overrides, config=config)
    )
    return output_dir


def _run_config(cfg: DictConfig) -> None:
    from tunesmith.recipes import sft

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft.main(cfg)
    finally:
        torch.set_num_threads(previous)


_KEPT_MODELS: dict[str, nn.Module] = {}


def keep_model(model: nn.Module, key: str) -> nn.Module:
    """Test-only model component: remember ``model`` under ``key`` and return it unchanged.
    :func:`run_sft_keeping_model` wraps a config's model in it to get the trained model."""
    _KEPT_MODELS[key] = model
    return model


def run_sft_keeping_model(
    model_dir: Path, data: Path, output_dir: Path, *overrides: str, config: str = "tiny"
) -> tuple[Path, nn.Module]:
    """:func:`run_sft`, also returning the model object the recipe trained, as it left it."""
    cfg = tiny_config(model_dir, data, output_dir, "progress_bar=false", *overrides, config=config)
    key = str(output_dir)
    cfg.model = OmegaConf.create(
        {"_component_": f"{__name__}.keep_model", "model": cfg.model, "key": key}
    )
    previous = os.environ.get(ALLOW_ANY_COMPONENT_ENV)
    os.environ[ALLOW_ANY_COMPONENT_ENV] = "1"  # keep_model is outside the allow-list
    try:
        _run_config(cfg)
    finally:
        if previous is None:
            os.environ.pop(ALLOW_ANY_COMPONENT_ENV)
        else:
            os.environ[ALLOW_ANY_COMPONENT_ENV] = previous
    return output_dir, _KEPT_MODELS.pop(key)


def read_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """The JSONL logger's records by step (training metrics only; a later record wins)."""
    records: dict[int, dict[str, float]] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            records[record.pop("step")] = record
    return records


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


def sft_overrides(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> list[str]:
    """The CLI overrides that :func:`tiny_config` applies, plus ``overrides``."""
    base = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={output_dir}"]
    return [*base, "progress_bar=false", *overrides]


def free_port() -> int:
    """A TCP port nobody listens on right now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    overrides: list[str],
    log_dir: Path,
    *,
    config: str = "tiny",
    world_size: int = 2,
    timeout: float = 120,
) -> None:
    """Run the SFT recipe on ``world_size`` local ranks, started the way torchrun would (one
    ``python -m tunesmith.cli.launch`` process per rank with the torchrun environment), and
    wait for them; a failing rank fails with the tail of its log (``log_dir/rank<N>.log``)."""
    args = [
        "-m", "tunesmith.cli.launch", str(catalog.recipe_path("sft")),
        str(catalog.config_path(config, "sft")), *overrides,
    ]  # fmt: skip
    port = str(free_port())
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
    ranks = []
    for r, log in enumerate(logs):
        env = subprocess_env(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        with open(log, "w") as f:
            ranks.append(subprocess.Popen([sys.executable, *args], env=env, stdout=f, stderr=f))
    try:
        for p in ranks:
            p.wait(timeout=timeout)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(ranks, logs)):
        if p.returncode != 0:
            raise AssertionError(f"rank {r} failed ({p.returncode}):\n{log.read_text()[-3000:]}")
