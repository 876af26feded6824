"""``tunesmith chat CKPT``: a multi-turn conversation with a model in the terminal.

Each line read is a user message; the whole conversation so far goes through the chat template
(with the generation prompt) and the model's reply is printed and kept for the next turn.
``/reset`` starts a new conversation (the system prompt stays), ``/exit`` (or end of input)
ends. It reads any stream, so a pipe works: ``printf 'hi\\n/exit\\n' | tunesmith chat CKPT``.
On a terminal a ``> `` prompt is shown; on a pipe only the replies are written, one per turn.

Example (a tiny untrained model, so its replies are noise)::

    >>> import io
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> from tunesmith.models import build_model, qwen2_5
    >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=tok.vocab_size))
    >>> session = ChatSession(model, tok, system="Be brief.", max_new_tokens=4)
    >>> isinstance(session.reply("add 2 and 3"), str), [m["role"] for m in session.messages]
    (True, ['system', 'user', 'assistant'])
    >>> chat_loop(session, io.StringIO("hi\\n/exit\\n"), io.StringIO())
    1
"""

from __future__ import annotations

from dataclasses import replace
from typing import IO

import torch
from torch import nn

from tunesmith.cli.generate_batch import check_prompt_size, fit_new_tokens
from tunesmith.data import Tokenizer
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.generation.generate import model_positions

__all__ = ["EXIT", "RESET", "ChatSession", "chat_loop"]

EXIT = "/exit"
RESET = "/reset"


class ChatSession:
    """A conversation with ``model``: :meth:`reply` adds the user's message and the model's
    answer to :attr:`messages`; :meth:`reset` forgets them (``system`` stays first).

    Sampling (``temperature`` > 0, ``top_k``, ``top_p``) draws from a generator seeded with
    ``seed``, so a scripted session repeats exactly.

    Example (``model`` and ``tok`` as in the module example)::

        session = ChatSession(model, tok, system="Be brief.", temperature=0.7, seed=0)
        session.reply("Hi")
        # -> 'Hello!'
        len(session.messages)
        # -> 3
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"{tokenizer.name}: has no chat template; give --chat-template "
                f"(llama3, qwen2_5, qwen3 or a .jinja file)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.system = system
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p
        )
        device = next(model.parameters()).device
        self.generator = torch.Generator(device)
        self.generator.manual_seed(0 if seed is None else seed)
        self.engine = LocalEngine(
            model, tokenizer, pad_id=tokenizer.pad_id or 0, generator=self.generator
        )
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (only the system prompt, if any)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> str:
        """Add ``text`` as the user's turn, generate the assistant's, keep both; returns it."""
        positions = model_positions(self.model)
        size = sum(len(m["content"]) for m in self.messages) + len(text)
        check_prompt_size(size, positions, "the conversation")
        messages = [*self.messages, {"role": "user", "content": text}]
        ids, _ = self.tokenizer.tokenize_conversation(messages, add_generation_prompt=True)
        where = "the conversation (/reset starts a new one)"
        config = replace(
            self.config,
            max_new_tokens=fit_new_tokens(len(ids), self.config.max_new_tokens, positions, where),
        )
        self.messages = messages
        out = generate_with(self.engine, [ids], None, config, self.tokenizer.stop_token_ids)
        tokens = out.sequences[0]
        if tokens and tokens[-1] in self.tokenizer.stop_token_ids:
            tokens = tokens[:-1]
        answer = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def _read_line(stdin: IO[str], number: int) -> str:
    """The next line of ``stdin`` ("" at the end), refusing one that is not UTF-8 text."""
    buffer = getattr(stdin, "buffer", None)  # read bytes: a text layer decodes whole chunks
    try:
        if buffer is not None:
            return buffer.readline().decode("utf-8")
        line = stdin.readline()
        line.encode("utf-8")  # undecodable bytes come as surrogates (surrogateescape)
    except UnicodeError:
        raise ValueError(
            f"stdin: input line {number} is not valid UTF-8 text; give UTF-8 input"
        ) from None
    return line


def chat_loop(session: ChatSession, stdin: IO[str], stdout: IO[str]) -> int:
    """Read user lines from ``stdin`` and write the replies to ``stdout`` until ``/exit`` or
    end of input (see the module docs); returns the number of replies.

    Example (any object with ``reply`` and ``reset`` serves as the session)::

        >>> import io, sys
        >>> class Shout:
        ...     def reply(self, text): return text.upper()
        ...     def reset(self): pass
        >>> chat_loop(Shout(), io.StringIO("hi\\n/reset\\nhello\\n/exit\\nignored\\n"), sys.stdout)
        HI
        HELLO
        2
    """
    interactive = stdin.isatty()
    replies = lines = 0
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        lines += 1
        line = _read_line(stdin, lines)
        if not line:  # end of input
            break
        text = line.rstrip("\r\n")
        if text.strip() == EXIT:
            break
        if text.strip() == RESET:
            session.reset()
            if interactive:
                stdout.write("(new conversation)\n")
            continue
        if not text.strip():
            continue
        stdout.write(session.reply(text) + "\n")
        stdout.flush()
        replies += 1
    return replies
