"""Tokenizer: loading a Hugging Face folder, encode/decode and special tokens == transformers."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.data.tokenizer_factory import FAMILIES, FAMILY_SPECS, make_tokenizer_folder
from tunesmith.data.chat_template import load_template
from tunesmith.data.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "Grüße aus Köln 🌍 — 日本語 ✓ café",
    "line one\n\n  indented\tline two\r\n",
    '{"name": "add", "arguments": {"a": 1, "b": 22}} 12345',
    "text with <|im_end|> and <|eot_id|> and <think> inside",
    "",
]
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: make_tokenizer_folder(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(folders: dict[str, Path]) -> dict[str, tuple[Tokenizer, Any]]:
    return {
        f: (Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder))
        for f, folder in folders.items()
    }


def copy_folder(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_matches_transformers(loaded: dict, family: str) -> None:
    ours, hf = loaded[family]
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_bos_like_transformers(loaded: dict, family: str) -> None:
    ours, hf = loaded[family]
    plain = ours.encode("Hello", add_special_tokens=False)
    if family == "llama3":  # the tokenizer.json post-processor prepends <|begin_of_text|>
        assert ours.bos_id == ours.token_to_id("<|begin_of_text|>") == hf.bos_token_id
        assert ours.encode("Hello") == [ours.bos_id, *plain]
    else:  # Qwen has no BOS and adds nothing
        assert ours.bos_id is None and hf.bos_token_id is None
        assert ours.encode("Hello") == plain


@pytest.mark.parametrize(
    "family, config",
    [
        ("llama3", {"add_bos_token": False}),
        ("llama3", {"add_eos_token": True}),
        ("qwen2_5", {"add_bos_token": True, "bos_token": "<|endoftext|>"}),
    ],
)
def test_add_bos_token_config_like_transformers(tmp_path: Path, family: str, config: dict) -> None:
    # transformers 5 ignores add_bos_token / add_eos_token when tokenizer.json exists: its
    # post-processor decides. So do we.
    folder = make_tokenizer_folder(tmp_path / "tok", family, **config)
    ours = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.encode("Hi there") == hf.encode("Hi there")
    plain = ours.encode("Hi there", add_special_tokens=False)
    assert ours.encode("Hi there") == ([ours.bos_id] if family == "llama3" else []) + plain


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_round_trip(loaded: dict, family: str) -> None:
    ours, hf = loaded[family]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == hf.decode(ids)
    ids, _ = ours.tokenize_conversation(CHAT)
    assert ours.decode(ids) == ours.apply_chat_template(CHAT)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    for token in FAMILY_SPECS[family].special:
        assert token not in ours.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_vocabulary_matches_transformers(loaded: dict, family: str) -> None:
    ours, hf = loaded[family]
    assert ours.vocab_size == len(ours) == len(hf)
    for token in (*FAMILY_SPECS[family].special, *FAMILY_SPECS[family].plain):
        token_id = ours.token_to_id(token)
        assert token_id == hf.convert_tokens_to_ids(token)
        assert ours.id_to_token(token_id) == token
    assert ours.token_to_id("<|not a token|>") is None
    assert set(ours.added_tokens) == set(FAMILY_SPECS[family].special) | set(
        FAMILY_SPECS[family].plain
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_special_ids(loaded: dict, folders: dict, family: str) -> None:
    ours, hf = loaded[family]
    assert ours.eos_id == hf.eos_token_id
    generation_eos = json.loads((folders[family] / "generation_config.json").read_text())[
        "eos_token_id"
    ]
    if family == "llama3":
        assert ours.eos_id == ours.token_to_id("<|eot_id|>")
        assert hf.pad_token_id is None and ours.pad_id == ours.eos_id  # documented fallback
        ends = ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
    else:
        assert ours.eos_id == ours.token_to_id("<|im_end|>")
        assert ours.pad_id == hf.pad_token_id == ours.token_to_id("<|endoftext|>")
        ends = ["<|im_end|>", "<|endoftext|>"]
    assert ours.stop_token_ids[0] == ours.eos_id
    assert (
        set(ours.stop_token_ids)
        == {ours.token_to_id(t) for t in ends}
        == {ours.eos_id, *generation_eos}
    )
    assert ours.model_max_length == 131072


def test_stop_tokens_without_generation_config(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok", "llama3", generation_config=False)
    tok = Tokenizer.from_pretrained(folder)
    # <|end_of_text|>, <|eom_id|>, <|eot_id|> are known end-of-turn tokens of the vocabulary.
    assert tok.stop_token_ids[0] == tok.token_to_id("<|eot_id|>")
    assert set(tok.stop_token_ids) == {
        tok.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
    }


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_added_token_objects_and_template_file(tmp_path: Path, loaded: dict, family: str) -> None:
    ours, _ = loaded[family]
    folder = make_tokenizer_folder(tmp_path / "tok", family, token_objects=True, template_file=True)
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    assert tok.eos_id == hf.eos_token_id
    assert tok.tokenize_conversation(CHAT)[0] == list(
        hf.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    )


def test_template_file_wins_over_config(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(
        tmp_path / "tok", "qwen2_5", chat_template="CONFIG {{ messages[0].content }}"
    )
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert Tokenizer.from_pretrained(folder).apply_chat_template(CHAT) == "FILE Hi"
    assert hf.apply_chat_template(CHAT, tokenize=False) == "FILE Hi"


def test_named_templates_like_transformers(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "default: {{ messages[0].content }}"},
        {
            "name": "tool_use",
            "template": "tools: {{ (tools or []) | length }} {{ messages[0].content }}",
        },
    ]
    folder = make_tokenizer_folder(tmp_path / "tok", "qwen2_5", chat_template=None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = templates
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        assert tok.apply_chat_template(CHAT, **kwargs) == hf.apply_chat_template(
            CHAT, tokenize=False, **kwargs
        )
    assert tok.apply_chat_template(CHAT, tools=tools) == "tools: 1 Hi"
    chosen = Tokenizer.from_pretrained(folder, chat_template="tool_use")
    assert chosen.apply_chat_template(CHAT) == "tools: 0 Hi"


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    # An older folder: no added_tokens_decoder in the config, special tokens in their own file.
    folder = make_tokenizer_folder(tmp_path / "tok", "qwen2_5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "<|im_end|>"}
        )
    )
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.eos_id == hf.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.pad_id == hf.pad_token_id == tok.token_to_id("<|im_end|>")


def test_shipped_template_option(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok", "qwen3", chat_template=None)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    by_name = Tokenizer.from_pretrained(folder, chat_template="qwen3")
    path = tmp_path / "mine.jinja"
    path.write_text(load_template("qwen3"), encoding="utf-8")
    by_path = Tokenizer.from_pretrained(folder, chat_template=path)
    expected = hf.apply_chat_template(CHAT, chat_template=load_template("qwen3"), tokenize=True)[
        "input_ids"
    ]
    assert (
        by_name.tokenize_conversation(CHAT)[0]
        == by_path.tokenize_conversation(CHAT)[0]
        == list(expected)
    )
    with pytest.raises(ValueError, match="not a shipped template"):
        Tokenizer.from_pretrained(folder, chat_template="qwen4")


def test_missing_template_error_names_folder(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok", "llama3", chat_template=None)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.encode("still works") == transformers.AutoTokenizer.from_pretrained(folder).encode(
        "still works"
    )
    for use in (tok.tokenize_conversation, tok.apply_chat_template):
        with pytest.raises(ValueError, match="no chat template") as error:
            use(CHAT)
        assert str(folder) in str(error.value) and "chat_template=" in str(error.value)


def test_missing_tokenizer_json(tmp_path: Path, folders: dict) -> None:
    folder = copy_folder(folders["qwen2_5"], tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as error:
        Tokenizer.from_pretrained(folder)
    assert str(folder / "tokenizer.json") in str(error.value)
    with pytest.raises(FileNotFoundError, match="no such tokenizer folder"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("content", ['{"model": ', '{"model": {"type": "BPE"}}', "\udcff"])
def test_corrupt_tokenizer_json_names_the_file(tmp_path: Path, folders: dict, content: str) -> None:
    folder = copy_folder(folders["qwen2_5"], tmp_path)
    (folder / "tokenizer.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match="not a valid tokenizer.json") as error:
        Tokenizer.from_pretrained(folder)
    assert str(folder / "tokenizer.json") in str(error.value)


def test_bad_config_errors_name_the_file(tmp_path: Path, folders: dict) -> None:
    folder = copy_folder(folders["llama3"], tmp_path)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as error:
        Tokenizer.from_pretrained(folder)
    assert str(config_file) in str(error.value)

    config = {"eos_token": "<|no such token|>"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token") as error:
        Tokenizer.from_pretrained(folder)
    assert str(config_file) in str(error.value)

    config_file.write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(ValueError, match="eos_token must be a string"):
        Tokenizer.from_pretrained(folder)

    config_file.write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_pretrained(folder)


def test_pickles_for_dataloader_workers(loaded: dict) -> None:
    ours, _ = loaded["qwen3"]
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.tokenize_conversation(CHAT, return_spans=True) == ours.tokenize_conversation(
        CHAT, return_spans=True
    )
