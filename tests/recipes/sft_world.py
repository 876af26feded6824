"""A tiny, fully local world for recipe tests: a HF model folder (our builder, a trained tiny
tokenizer with the Qwen2.5 chat template), synthetic chat datasets, and helpers that run the SFT
recipe (in this process or through the CLI) and read back what it wrote."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.cli import catalog
from tunesmith.config import load_config
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.hf import save_hf_checkpoint
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


def tiny_config(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> DictConfig:
    """The shipped `tiny` SFT config pointed at the local world, with ``overrides``."""
    base = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={output_dir}"]
    return load_config(catalog.config_path("tiny", "sft"), [*base, *overrides])


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


def run_sft(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> Path:
    """Run the SFT recipe in this process on one intra-op thread (so runs compare bitwise
    whatever thread count the caller has); returns ``output_dir``."""
    from tunesmith.recipes import sft

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft.main(tiny_config(model_dir, data, output_dir, "progress_bar=false", *overrides))
    finally:
        torch.set_num_threads(previous)
    return output_dir


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
    """The exported HF weights of a checkpoint folder."""
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
