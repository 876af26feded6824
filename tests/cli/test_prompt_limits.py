"""Prompts to `generate` and `chat` within what the model can take: a prompt too long for the
model's positions is refused before it is tokenised (by its characters) or after (by its
tokens), naming the prompt or the file and line; one that leaves less room than
``max_new_tokens`` is generated with fewer new tokens and a warning. ``--input`` lines and
``--chat`` files that are too large, not UTF-8, nested too deep or hold an unknown role are
refused naming the file (and line); a chat whose stdin is not UTF-8 says so."""

from __future__ import annotations

import io
import json

import pytest

from tests.recipes.sft_world import make_model_dir
from tunesmith.cli import generate_batch
from tunesmith.cli.chat import ChatSession, chat_loop
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.cli.generate_batch import (
    PromptRows,
    check_prompt_size,
    fit_new_tokens,
    generate_rows,
    prompt_ids,
    read_chat_file,
    read_prompt_rows,
)
from tunesmith.generation.generate import generate, model_positions


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(make_model_dir(tmp_path_factory.mktemp("limits")))


def test_the_tiny_model_has_512_positions(loaded):
    assert model_positions(loaded.model) == 512


def test_characters_that_cannot_fit_are_refused_before_tokenising():
    check_prompt_size(512 * 256, 512, "x")
    with pytest.raises(
        ValueError,
        match=r"^p:3: the prompt is 131073 characters, more than "
        r"the 131072 that can fit the model's 512 positions",
    ):
        check_prompt_size(512 * 256 + 1, 512, "p:3")
    with pytest.raises(ValueError, match="more than the 8388608"):
        check_prompt_size(2**23 + 1, None, "p")


def test_new_tokens_are_cut_to_the_room_left_with_a_warning(capsys):
    assert fit_new_tokens(100, 64, 512, "p") == 64
    assert fit_new_tokens(500, 64, 512, "p") == 12
    assert "p: 500 prompt tokens leave room for 12 new tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="p: the prompt has 512 tokens; the model has 512"):
        fit_new_tokens(512, 1, 512, "p")


def test_generate_refuses_a_prompt_that_fills_the_positions(loaded):
    with pytest.raises(ValueError, match="prompt 1 has 512 tokens; the model has 512 positions"):
        generate(loaded.model, [[1, 2], [1] * 512], max_new_tokens=1)


def test_rows_name_their_line(loaded, tmp_path, capsys):
    rows = PromptRows([{"prompt": "hi"}, {"prompt": "add 1 and 2 " * 300}], ["f:1", "f:2"])
    with pytest.raises(ValueError, match="^f:2: the prompt has .* tokens; the model has 512"):
        generate_rows(loaded.model, loaded.tokenizer, rows, max_new_tokens=2)
    near = PromptRows([{"prompt": "add 1 and 2 " * 60}], ["f:1"])
    n_prompt = len(prompt_ids(loaded.tokenizer, near[0]))
    assert 300 < n_prompt < 512 - 20
    out = generate_rows(loaded.model, loaded.tokenizer, near, max_new_tokens=512)
    assert out[0]["new_tokens"] <= 512 - n_prompt
    assert (
        f"f:1: {n_prompt} prompt tokens leave room for {512 - n_prompt}" in capsys.readouterr().err
    )


def _write(tmp_path, data: bytes, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD_LINES = {  # second line -> words of the error
    "binary": (b"\x89PNG\r\n\x1a\n\xff", "not UTF-8 text"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deep"),
    "role": (
        json.dumps({"messages": [{"role": "hacker", "content": "x"}]}).encode(),
        "message 0 has role 'hacker'; roles are system, user, assistant, tool",
    ),
    "not-json": (b"{oops", "not valid JSON"),
}


@pytest.mark.parametrize("line, words", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_input_line_is_named(tmp_path, line, words):
    path = _write(tmp_path, b'"hello"\n' + line + b"\n")
    with pytest.raises(ValueError) as error:
        read_prompt_rows(path)
    assert str(error.value).startswith(f"{path}:2: ") and words in str(error.value)


def test_an_input_line_over_the_limit_is_named_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(generate_batch, "MAX_LINE_BYTES", 100)
    path = _write(tmp_path, b'"hello"\n"' + b"x" * 500 + b'"\n"bye"\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: the line is longer than 100 bytes"):
        read_prompt_rows(path)
    rows = read_prompt_rows(_write(tmp_path, b'"a"\n\n{"prompt": "b", "id": 3}\n', "ok.jsonl"))
    assert rows == [{"prompt": "a"}, {"prompt": "b", "id": 3}]
    assert rows.where == [f"{tmp_path / 'ok.jsonl'}:1", f"{tmp_path / 'ok.jsonl'}:3"]


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\xff\xfe\x00", "not UTF-8 text"),
        (b"[" * 100_000, "JSON nested too deep"),
        (json.dumps([{"role": "hacker", "content": "x"}]).encode(), "role 'hacker'"),
        (json.dumps({"role": "user"}).encode(), "'messages' must be a list"),
    ],
)
def test_a_bad_chat_file_is_named(tmp_path, data, words):
    path = _write(tmp_path, data, "chat.json")
    with pytest.raises(ValueError) as error:
        read_chat_file(path)
    assert str(error.value).startswith(f"{path}: ") and words in str(error.value)


def test_a_chat_file_reads_one_conversation(tmp_path):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rows = read_chat_file(_write(tmp_path, json.dumps(messages).encode(), "chat.json"))
    assert rows == [{"messages": messages}] and rows.where == [str(tmp_path / "chat.json")]


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_chat_stdin_that_is_not_utf8_is_one_line(loaded, errors):
    session = ChatSession(loaded.model, loaded.tokenizer, max_new_tokens=2)
    stdin = io.TextIOWrapper(io.BytesIO(b"hi\ncaf\xe9\n"), encoding="utf-8", errors=errors)
    with pytest.raises(ValueError, match="^stdin: input line 2 is not valid UTF-8 text"):
        chat_loop(session, stdin, io.StringIO())


def test_a_chat_conversation_that_outgrows_the_positions_is_refused(loaded):
    session = ChatSession(loaded.model, loaded.tokenizer, max_new_tokens=2)
    with pytest.raises(ValueError, match="the conversation: the prompt is 200000 characters"):
        session.reply("x" * 200_000)
    assert session.messages == []  # the refused turn is not kept
    with pytest.raises(ValueError, match="the conversation .*: the prompt has .* tokens"):
        session.reply("add 1 and 2 " * 300)
    assert session.messages == []
