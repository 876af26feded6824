"""A tiny, fully local world for recipe tests: a HF model folder (our builder, a trained tiny
tokenizer with the Qwen2.5 chat template) and a synthetic chat dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

from omegaconf import DictConfig

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.cli import catalog
from tunesmith.config import load_config
from tunesmith.data import Tokenizer
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.hf import save_hf_checkpoint


def make_model_dir(root: Path, seed: int = 0, **spec_overrides) -> Path:
    """A HF folder with a tiny Qwen2.5-style model and tokenizer; returns its path."""
    tok_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5")
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    spec = qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab, **spec_overrides)
    import torch

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
