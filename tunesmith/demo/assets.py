"""The demo's local world: task data, a small tokenizer and a randomly initialised base model.

Nothing is downloaded. :func:`make_assets` writes, under one folder:

- ``data/train.jsonl`` and ``data/held_out.jsonl``: the task (:mod:`tunesmith.demo.task`);
- ``tokenizer/``: a byte-level BPE tokenizer trained with ``tokenizers`` on the task's chat
  text, with the Qwen2.5 special tokens and tunesmith's shipped Qwen2.5 chat template. Its
  pre-tokenizer keeps every capital letter and digit a token of its own (so the letters to
  sort are single tokens) while lowercase words such as ``assistant`` merge into one;
- ``base_model/``: a Hugging Face folder (``config.json`` + safetensors + the tokenizer files)
  holding a tiny Qwen2.5-style model built by tunesmith with random weights.

A ``manifest.json`` records the settings; a second call with the same settings reuses the files.

Example::

    >>> from tunesmith.models import from_hf
    >>> assets = make_assets("outputs/demo", AssetSettings(num_train=100, num_held_out=10))
    >>> sorted(p.name for p in assets.model_dir.iterdir())  # doctest: +NORMALIZE_WHITESPACE
    ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json',
     'tokenizer_config.json']
    >>> type(from_hf(assets.model_dir)).__name__
    'TransformerLM'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from tunesmith.data import Tokenizer, load_template, render
from tunesmith.demo.task import Example, make_splits, write_jsonl
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.hf import save_hf_checkpoint

__all__ = [
    "DEFAULT_MODEL",
    "SPECIAL_TOKENS",
    "AssetSettings",
    "DemoAssets",
    "build_base_model",
    "build_tokenizer",
    "is_built",
    "make_assets",
]

# Capital letters and digits alone; lowercase words (with one leading non-letter) together;
# then Qwen's rules for punctuation runs, newlines and spaces.
SPLIT_PATTERN = (
    r"\p{Lu}|\p{N}|[^\r\n\p{L}\p{N}]?\p{Ll}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS, PAD = "<|im_end|>", "<|endoftext|>"
TEMPLATE = "qwen2_5"
MANIFEST = "manifest.json"

DEFAULT_MODEL: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
"""Size overrides of ``qwen2_5.spec("qwen2_5_tiny")`` for the demo's base model."""


@dataclass(frozen=True)
class AssetSettings:
    """What the assets depend on; a folder built with other settings is rebuilt."""

    num_train: int = 4000
    num_held_out: int = 200
    seed: int = 0
    vocab_size: int = 320
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))


@dataclass(frozen=True)
class DemoAssets:
    """Paths of the demo's files (see :func:`make_assets`)."""

    root: Path
    train_file: Path
    held_out_file: Path
    tokenizer_dir: Path
    model_dir: Path

    @classmethod
    def under(cls, root: str | os.PathLike[str]) -> DemoAssets:
        root = Path(root)
        return cls(
            root=root,
            train_file=root / "data" / "train.jsonl",
            held_out_file=root / "data" / "held_out.jsonl",
            tokenizer_dir=root / "tokenizer",
            model_dir=root / "base_model",
        )


def _chat_pieces(examples: Iterable[Example]) -> Iterable[str]:
    """The rendered conversations, cut at the special tokens (which BPE must not learn)."""
    template = load_template(TEMPLATE)
    specials = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    for ex in examples:
        yield from (p for p in specials.split(render(template, ex.messages())) if p)


def build_tokenizer(
    folder: str | os.PathLike[str], examples: Iterable[Example], vocab_size: int = 320
) -> Path:
    """Train a byte-level BPE tokenizer on the chat text of ``examples``; write a HF folder.

    The folder has ``tokenizer.json``, ``tokenizer_config.json`` (eos ``<|im_end|>``, pad
    ``<|endoftext|>``, the Qwen2.5 chat template) and ``generation_config.json``; both
    :class:`tunesmith.data.Tokenizer` and ``transformers.AutoTokenizer`` load it.

    Example::

        >>> build_tokenizer("tok", make_splits(100, 0)[0])
        PosixPath('tok')
        >>> tok = Tokenizer.from_pretrained("tok")
        >>> [tok.decode([i]) for i in tok.encode("sort CBA", add_special_tokens=False)]
        ['sort', ' ', 'C', 'B', 'A']
    """
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_chat_pieces(examples), trainer=trainer)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    ids = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in ids.items()
        },
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        # Not "Qwen2Tokenizer": transformers would rebuild that one with Qwen's own
        # pre-tokenizer; the fast class reads our tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": load_template(TEMPLATE),
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"eos_token_id": [ids[EOS], ids[PAD]], "pad_token_id": ids[PAD]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), "utf-8")
    return folder


def build_base_model(
    folder: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    **spec_overrides: Any,
) -> Path:
    """Save a randomly initialised tiny Qwen2.5-style model (and the tokenizer) as a HF folder.

    The vocabulary is the tokenizer's; ``spec_overrides`` change the size
    (default :data:`DEFAULT_MODEL`).

    Example::

        >>> _ = build_tokenizer("tok", make_splits(100, 0)[0])
        >>> build_base_model("base", "tok", seed=0, num_hidden_layers=3)
        PosixPath('base')
        >>> json.loads(Path("base/config.json").read_text())["num_hidden_layers"]
        3
    """
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    sizes = {**DEFAULT_MODEL, **spec_overrides}
    spec = qwen2_5.spec(
        "qwen2_5_tiny",
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_id,
        bos_token_id=None,
        **sizes,
    )
    torch.manual_seed(seed)
    model = build_model(spec)
    return save_hf_checkpoint(model, folder, source_dir=tokenizer_dir)


def make_assets(
    root: str | os.PathLike[str], settings: AssetSettings | None = None, *, force: bool = False
) -> DemoAssets:
    """Write the task data, tokenizer and base model under ``root`` unless already there.

    Files from an earlier call with the same ``settings`` are reused (``force`` rebuilds).
    """
    settings = settings or AssetSettings()
    assets = DemoAssets.under(root)
    if not force and is_built(root, settings):
        return assets
    train, held_out = make_splits(settings.num_train, settings.num_held_out, seed=settings.seed)
    write_jsonl(train, assets.train_file)
    write_jsonl(held_out, assets.held_out_file)
    build_tokenizer(assets.tokenizer_dir, train, settings.vocab_size)
    build_base_model(assets.model_dir, assets.tokenizer_dir, seed=settings.seed, **settings.model)
    (assets.root / MANIFEST).write_text(json.dumps(asdict(settings), indent=2), encoding="utf-8")
    return assets


def is_built(root: str | os.PathLike[str], settings: AssetSettings | None = None) -> bool:
    """Whether ``root`` holds assets that :func:`make_assets` built with ``settings``."""
    try:
        recorded = json.loads((Path(root) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == asdict(settings or AssetSettings())
