"""Tiny Hugging Face tokenizer folders for tests, trained on the spot with ``tokenizers``.

Each family copies the real model's tokenizer layout at toy size: BPE (~640 ids) with the
family's pre-tokenizer regex, normalizer, post-processor and added tokens (special and not),
byte-level except Gemma's (SentencePiece-style "▁" spaces with byte fallback), a
``tokenizer_config.json`` like the Hub's (``tokenizer_class``, special tokens,
``added_tokens_decoder``, chat template) and a ``generation_config.json`` with the eos list.
``transformers.AutoTokenizer`` loads the folders (for Qwen and Gemma it rebuilds the tokenizer
from the vocab and merges with its own pipeline, which therefore must match ours; for Phi-4-mini
and OLMo 2 a ``config.json`` with the model type makes it read ``tokenizer.json`` as it is, as it
does for the real models), and so does :class:`tunesmith.data.tokenizer.Tokenizer`.

Training is cached per (family, vocab size), so a test session trains each family once.

Example::

    folder = make_tokenizer_folder(tmp_path / "tok", "qwen2_5")
    Tokenizer.from_pretrained(folder).encode("Hello")
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tunesmith.data.chat_template import load_template

FAMILIES = ("llama3", "qwen2_5", "qwen3")
"""The families ``test_tokenizer`` checks token by token (its special-id checks know these)."""
CHAT_FAMILIES = (*FAMILIES, "gemma", "phi4", "olmo2")
"""Every family here; each has a shipped chat template of the same name."""

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k_base (Phi-4-mini); OLMo 2 uses cl100k_base's, which is LLAMA3_SPLIT.
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Gemma's SentencePiece pieces: "▁"-led words, single digits, newline runs. Used for training
# only: the tokenizer itself (like transformers' GemmaTokenizer) does not pre-split, and the
# merges learned within pieces never join two of them.
GEMMA_TRAINING_SPLIT = r"\p{N}|\n+|▁*[^▁\n\p{N}]+|▁+"


@dataclass(frozen=True)
class Family:
    special: tuple[str, ...]  # added tokens with special=True
    plain: tuple[str, ...]  # added tokens with special=False (tool / think markers)
    config: dict[str, Any]  # tokenizer_config.json entries besides tokens and template
    generation_eos: tuple[str, ...]  # generation_config.json eos_token_id, as tokens
    generation_ids: tuple[tuple[str, str], ...] = ()  # other generation_config ids: (key, token)
    additional: tuple[str, ...] | None = None  # tokenizer_config.json additional_special_tokens
    model_type: str | None = None  # written to config.json, which decides transformers' class
    vocab_first: tuple[str, ...] = ()  # special tokens that open the vocabulary (ids 0, 1, ...)


_QWEN_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
)
_QWEN_CONFIG = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "errors": "replace",
    "model_max_length": 131072,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
    "unk_token": None,
}
_QWEN_ADDITIONAL = tuple(t for t in _QWEN_SPECIAL if t != "<|endoftext|>")

FAMILY_SPECS = {
    "llama3": Family(
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        plain=(),
        config={
            "bos_token": "<|begin_of_text|>",
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        generation_ids=(("bos_token_id", "<|begin_of_text|>"),),
    ),
    "qwen2_5": Family(
        special=_QWEN_SPECIAL,
        plain=("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>"),
        config=_QWEN_CONFIG,
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        generation_ids=(("pad_token_id", "<|endoftext|>"),),
        additional=_QWEN_ADDITIONAL,
    ),
    "qwen3": Family(
        special=_QWEN_SPECIAL,
        plain=(
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
        config=_QWEN_CONFIG,
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        generation_ids=(("pad_token_id", "<|endoftext|>"),),
        additional=_QWEN_ADDITIONAL,
    ),
    # Gemma 3: BOS added by the post-processor, <end_of_turn> closes a turn, <eos> a document.
    "gemma": Family(
        special=(
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<mask>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ),
        plain=(),
        config={
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<eos>",
            "model_max_length": 1000000000000000019884624838656,
            "pad_token": "<pad>",
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        },
        generation_eos=("<eos>", "<end_of_turn>"),
        generation_ids=(("bos_token_id", "<bos>"), ("pad_token_id", "<pad>")),
        vocab_first=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
    ),
    # Phi-4-mini: the role tags are special tokens; eos is <|endoftext|>, <|end|> closes a turn.
    # The Hub says GPT2Tokenizer; transformers reads tokenizer.json as it is for model type phi3.
    "phi4": Family(
        special=(
            "<|endoftext|>",
            "<|endofprompt|>",
            "<|assistant|>",
            "<|end|>",
            "<|user|>",
            "<|system|>",
            "<|tool|>",
            "<|/tool|>",
            "<|tool_call|>",
            "<|/tool_call|>",
            "<|tool_response|>",
            "<|tag|>",
        ),
        plain=(),
        config={
            "add_prefix_space": False,
            "bos_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "GPT2Tokenizer",
            "unk_token": "<|endoftext|>",
        },
        generation_eos=("<|end|>", "<|endoftext|>"),
        generation_ids=(("bos_token_id", "<|endoftext|>"), ("pad_token_id", "<|endoftext|>")),
        model_type="phi3",
    ),
    # OLMo 2 (dolma2 tokenizer): the role tags are plain text; <|endoftext|> is BOS and EOS.
    # The Hub says GPT2Tokenizer; transformers reads tokenizer.json as it is for model type olmo2.
    "olmo2": Family(
        special=(
            "<|endoftext|>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|endofprompt|>",
            "<|pad|>",
        ),
        plain=("|||PHONE_NUMBER|||", "|||EMAIL_ADDRESS|||", "|||IP_ADDRESS|||"),
        config={
            "bos_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "model_max_length": 4096,
            "pad_token": "<|pad|>",
            "tokenizer_class": "GPT2Tokenizer",
            "unk_token": "<|endoftext|>",
        },
        generation_eos=("<|endoftext|>",),
        generation_ids=(("bos_token_id", "<|endoftext|>"), ("pad_token_id", "<|pad|>")),
        model_type="olmo2",
    ),
}

_WORD_TEXT = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "user assistant system tool function weather city paris rome oslo add sum answer question "
    "hello hi thanks help think reason step result value name arguments parameters type string "
    "integer object properties required description date today knowledge cutting environment"
)
_WORDS = tuple(_WORD_TEXT.split())
_UNICODE = ("café", "naïve", "Grüße", "Köln", "日本語", "谢谢", "🌍", "✓", "—", "°C", "Ça")


def corpus(lines: int = 1500, seed: int = 0) -> list[str]:
    """Deterministic training text: words, numbers, punctuation, JSON, a little unicode."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), rng.choice(_UNICODE))
        text = " ".join(words)
        if rng.random() < 0.5:
            text = text.capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if rng.random() < 0.2:
            text = json.dumps({rng.choice(_WORDS): rng.choice(_WORDS), "n": rng.randint(0, 99)})
        if rng.random() < 0.2:
            text = "\n" + text + "\n\n"
        out.append(text)
    return out


def _pipeline(family: str) -> Tokenizer:
    if family == "gemma":  # the training pipeline; _gemma_pipeline() gives the final one
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(
            Regex(GEMMA_TRAINING_SPLIT), behavior="isolated", invert=False
        )
        return tok
    if family in ("llama3", "phi4", "olmo2"):
        split = {"llama3": LLAMA3_SPLIT, "phi4": O200K_SPLIT, "olmo2": LLAMA3_SPLIT}[family]
        tok = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=True, use_regex=False
                ),
            ]
        )
    else:
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                ),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma_pipeline(trained: Tokenizer) -> Tokenizer:
    """The trained Gemma-style tokenizer with the 256 byte-fallback pieces ``<0x00>``..
    ``<0xFF>`` in its vocabulary and transformers' ``GemmaTokenizer`` pipeline: no pre-split
    (a split on " ", which the normalizer has already replaced), "▁" decoded as a space."""
    data = json.loads(trained.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


@cache
def tokenizer_json(family: str, vocab_size: int = 640) -> str:
    """The trained ``tokenizer.json`` text of a family (cached)."""
    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {tuple(FAMILY_SPECS)}")
    spec = FAMILY_SPECS[family]
    tok = _pipeline(family)
    byte_level = family != "gemma"
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in spec.vocab_first],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if family == "gemma":
        tok = _gemma_pipeline(tok)
    # Added tokens come after the learned vocabulary, in the family's order, as on the Hub.
    for content in (*spec.special, *spec.plain):
        special = content in spec.special
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    if family in ("llama3", "gemma"):
        bos = spec.config["bos_token"]
        prepend_bos = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
        tok.post_processor = (
            prepend_bos
            if family == "gemma"
            else processors.Sequence(
                [
                    processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
                    prepend_bos,
                ]
            )
        )
    else:
        tok.post_processor = processors.ByteLevel(
            add_prefix_space=False, trim_offsets=False, use_regex=False
        )
    return tok.to_str()


def make_tokenizer_folder(
    folder: str | Path,
    family: str = "qwen2_5",
    *,
    chat_template: str | None = "shipped",
    template_file: bool = False,
    token_objects: bool = False,
    generation_config: bool = True,
    vocab_size: int = 640,
    **config_overrides: Any,
) -> Path:
    """Write a tiny tokenizer folder of ``family`` (one of :data:`CHAT_FAMILIES`) and return it.

    A family whose model type decides transformers' tokenizer class (Phi-4-mini, OLMo 2) also
    gets a ``config.json`` holding just that ``model_type``.

    Args:
        chat_template: ``"shipped"`` for tunesmith's template of the family, None for no
            template, or the source of any other template.
        template_file: write the template to ``chat_template.jinja`` (newer layout) instead of
            ``tokenizer_config.json``.
        token_objects: write the named special tokens as AddedToken objects, not strings.
        generation_config: write ``generation_config.json`` with the family's eos id list.
        config_overrides: extra or replaced ``tokenizer_config.json`` entries.
    """
    spec = FAMILY_SPECS[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = tokenizer_json(family, vocab_size)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    data = json.loads(text)
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}

    config: dict[str, Any] = {
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k]
                for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in data["added_tokens"]
        },
        **spec.config,
    }
    if spec.additional is not None:
        config["additional_special_tokens"] = list(spec.additional)
    if token_objects:
        for key in ("bos_token", "eos_token", "pad_token"):
            if isinstance(config.get(key), str):
                config[key] = {
                    "__type": "AddedToken",
                    "content": config[key],
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
    source = load_template(family) if chat_template == "shipped" else chat_template
    if source is not None and template_file:
        (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    elif source is not None:
        config["chat_template"] = source
    config.update(config_overrides)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if generation_config:
        eos = [ids[t] for t in spec.generation_eos]
        generation: dict[str, Any] = {"eos_token_id": eos}
        generation.update((key, ids[token]) for key, token in spec.generation_ids)
        (folder / "generation_config.json").write_text(
            json.dumps(generation, indent=2), encoding="utf-8"
        )
    if spec.model_type is not None:
        model_config = {"model_type": spec.model_type}
        (folder / "config.json").write_text(json.dumps(model_config, indent=2), encoding="utf-8")
    return folder
