"""`tunesmith chat`: a piped conversation keeps its history through the chat template, /reset
starts over, /exit ends."""

from __future__ import annotations

import io
import subprocess

import pytest

from tests.recipes.sft_world import cli_command, make_model_dir, subprocess_env
from tunesmith.cli.chat import ChatSession, chat_loop
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.generation import generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("chat"), initializer_range=0.2)


def _reply(loaded, messages: list[dict], n: int) -> str:
    """The greedy reply to ``messages``, computed directly."""
    tok = loaded.tokenizer
    ids, _ = tok.tokenize_conversation(messages, add_generation_prompt=True)
    tokens = generate(
        loaded.model, [ids], max_new_tokens=n, stop_token_ids=tok.stop_token_ids
    ).sequences[0]
    if tokens and tokens[-1] in tok.stop_token_ids:
        tokens = tokens[:-1]
    return tok.decode(tokens, skip_special_tokens=True)


def test_the_conversation_carries_over_turns_and_reset_forgets_it(model_dir):
    loaded = load_checkpoint(model_dir)
    session = ChatSession(loaded.model, loaded.tokenizer, system="Be brief.", max_new_tokens=6)
    out = io.StringIO()
    assert (
        chat_loop(session, io.StringIO("hello\n\nand then\n/reset\nhello\n/exit\nnever\n"), out)
        == 3
    )
    first, second, after_reset = out.getvalue().splitlines()
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "hello"}]
    assert first == _reply(loaded, history, 6)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then"}]
    assert second == _reply(loaded, history, 6)
    assert second != _reply(loaded, [system, {"role": "user", "content": "and then"}], 6)
    assert after_reset == first
    assert session.messages == [
        system,
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
    ]


def test_chat_command_through_a_pipe(model_dir):
    loaded = load_checkpoint(model_dir)
    result = subprocess.run(
        cli_command("chat", str(model_dir), "--max-new-tokens", "5"),
        input="hello\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == _reply(loaded, [{"role": "user", "content": "hello"}], 5) + "\n"
