"""Batch generation for ``tunesmith generate CKPT --input prompts.jsonl --output out.jsonl``.

Each input line is a JSON string (a prompt) or an object with ``"prompt"`` (a string) or
``"messages"`` (a list of ``{role, content}``); an object's other keys are copied to its output
line (ids, reference answers). Prompts go through the chat template (as one user message)
when the tokenizer has one, unless ``chat_template=False``; messages always do. Rows are
decoded in batches of similar length; each output line is the input row plus ``completion``,
``finish_reason`` (``stop`` or ``length``) and ``new_tokens``, in input order.

Sampling with a ``seed`` is keyed per row (see :mod:`tunesmith.generation.keyed`): a row's
completion depends on the seed, its line number and its prompt, not on the batch size.

Example (a tiny untrained model, so the completions are noise)::

    >>> from tunesmith.data import Tokenizer
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> from tunesmith.models import build_model, qwen2_5
    >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=tok.vocab_size))
    >>> _ = write_rows("prompts.jsonl", [{"prompt": "add 2 and 3", "id": 7}])
    >>> out = generate_rows(model, tok, read_prompt_rows("prompts.jsonl"), max_new_tokens=4)
    >>> sorted(out[0]), out[0]["id"], out[0]["new_tokens"] <= 4
    (['completion', 'finish_reason', 'id', 'new_tokens', 'prompt'], 7, True)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from tunesmith.data import Tokenizer
from tunesmith.data.sources import MAX_ROW_BYTES
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.generation.generate import model_positions
from tunesmith.training.sample_prompts import prompt_ids

__all__ = [
    "PromptRows",
    "check_messages",
    "check_prompt_size",
    "fit_new_tokens",
    "generate_rows",
    "prompt_ids",
    "read_chat_file",
    "read_prompt_rows",
    "write_rows",
]

_KEY_MULTIPLIER = 1_000_003  # spreads (seed, row) pairs over the 32-bit key space


ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (as in datasets)."""
MAX_LINE_BYTES = MAX_ROW_BYTES
"""The longest ``--input`` line (or ``--chat`` file) read: 16 MiB, as for dataset rows."""
MAX_PROMPT_CHARS = 2**23
"""The most characters a prompt may have before it is tokenised (8 Mi)."""
CHARS_PER_POSITION = 256
"""A prompt longer than this many characters per model position cannot fit: refused before
it is tokenised (no tokenizer's tokens are that long)."""


class PromptRows(list):
    """Prompt rows, with ``where[i]``: the file and line of row ``i`` (for errors)."""

    def __init__(self, rows: Sequence[dict[str, Any]] = (), where: Sequence[str] = ()) -> None:
        super().__init__(rows)
        self.where = list(where)


def _lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """``(number, line)`` of a file, ``None`` for a line over :data:`MAX_LINE_BYTES` (whose
    bytes are skipped, never held)."""
    with open(path, "rb") as f:
        number = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass
                yield number, None
                continue
            yield number, line


def _parse_json(data: bytes, where: str) -> Any:
    """One JSON value from ``data`` (UTF-8); errors name ``where``."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); is it a binary file?"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deep to read") from None


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` if it is a list of ``{role, content}`` objects with known roles.

    Example::

        >>> check_messages([{"role": "hacker", "content": "hi"}], "chat.json")
        Traceback (most recent call last):
        ValueError: chat.json: message 0 has role 'hacker'; roles are system, user, assistant, tool
    """
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}: message {i} has role {message['role']!r}; roles are {', '.join(ROLES)}"
            )
    return messages


def _prompt_row(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
        raise ValueError(
            f"{where}: expected a JSON string, or an object with exactly one "
            f"of 'prompt' (a string) and 'messages' (a list)"
        )
    if "prompt" in value and not isinstance(value["prompt"], str):
        raise ValueError(
            f"{where}: 'prompt' must be a string, got {type(value['prompt']).__name__}"
        )
    if "messages" in value:
        check_messages(value["messages"], where)
    return value


def read_prompt_rows(path: str | os.PathLike[str]) -> PromptRows:
    """The rows of a prompts JSONL file, each as ``{"prompt": str, ...}`` or
    ``{"messages": [...], ...}``; blank lines are skipped. A bad line (not UTF-8, not JSON,
    nested too deep, over :data:`MAX_LINE_BYTES`, an unknown role) is an error naming the
    file and line.

    Example::

        >>> _ = Path("prompts.jsonl").write_text(
        ...     '"Hi"\\n\\n{"messages": [{"role": "user", "content": "Hi"}], "id": 7}\\n')
        >>> read_prompt_rows("prompts.jsonl")
        [{'prompt': 'Hi'}, {'messages': [{'role': 'user', 'content': 'Hi'}], 'id': 7}]
    """
    rows = PromptRows()
    for number, line in _lines(Path(path)):
        where = f"{path}:{number}"
        if line is None:
            raise ValueError(f"{where}: the line is longer than {MAX_LINE_BYTES} bytes")
        if not line.strip():
            continue
        rows.append(_prompt_row(_parse_json(line, where), where))
        rows.where.append(where)
    return rows


def read_chat_file(path: str | os.PathLike[str]) -> PromptRows:
    """The one conversation of a ``--chat`` file (a JSON list of ``{role, content}``), as a
    prompt row; errors name the file.

    Example::

        >>> _ = Path("chat.json").write_text('[{"role": "user", "content": "Hi"}]')
        >>> read_chat_file("chat.json")
        [{'messages': [{'role': 'user', 'content': 'Hi'}]}]
    """
    path = Path(path)
    if path.stat().st_size > MAX_LINE_BYTES:
        raise ValueError(f"{path}: the file is larger than {MAX_LINE_BYTES} bytes")
    messages = check_messages(_parse_json(path.read_bytes(), str(path)), str(path))
    return PromptRows([{"messages": messages}], [str(path)])


def _text_size(row: Mapping[str, Any]) -> int:
    if "prompt" in row:
        return len(row["prompt"])
    return sum(
        len(m["content"])
        if isinstance(m.get("content"), str)
        else len(json.dumps(m.get("content")))
        for m in row["messages"]
    )


def check_prompt_size(size: int, positions: int | None, where: str) -> None:
    """Refuse a prompt of ``size`` characters that cannot fit the model's ``positions``
    (or is over :data:`MAX_PROMPT_CHARS`), before it is tokenised.

    Example::

        >>> check_prompt_size(10**6, 512, "prompts.jsonl:3")
        Traceback (most recent call last):
        ValueError: prompts.jsonl:3: the prompt is 1000000 characters, more than the 131072 ...
    """
    limit = MAX_PROMPT_CHARS
    if positions is not None:
        limit = min(limit, positions * CHARS_PER_POSITION)
    if size > limit:
        raise ValueError(
            f"{where}: the prompt is {size} characters, more than the {limit} that can fit "
            f"the model's {positions} positions; shorten it"
        )


def fit_new_tokens(n_prompt: int, max_new_tokens: int, positions: int | None, where: str) -> int:
    """``max_new_tokens`` cut so that prompt and completion fit the model's ``positions``
    (with a warning on stderr); a prompt that fills them all is refused, naming ``where``.

    Example::

        >>> fit_new_tokens(500, 64, 512, "prompt")  # stderr: ... leave room for 12 new tokens ...
        12
    """
    if positions is None:
        return max_new_tokens
    if n_prompt >= positions:
        raise ValueError(
            f"{where}: the prompt has {n_prompt} tokens; the model has {positions} positions "
            "(max_position_embeddings), which leaves no room to generate: shorten it"
        )
    room = positions - n_prompt
    if max_new_tokens > room:
        print(
            f"tunesmith: warning: {where}: {n_prompt} prompt tokens leave room for {room} "
            f"new tokens in the model's {positions} positions (not {max_new_tokens})",
            file=sys.stderr,
        )
        return room
    return max_new_tokens


def _where(rows: Sequence[Any], i: int) -> str:
    where = getattr(rows, "where", None)
    return where[i] if where and i < len(where) else f"prompt {i}"


def generate_rows(
    model: nn.Module,
    tokenizer: Tokenizer,
    rows: Sequence[Mapping[str, Any]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    batch_size: int = 8,
    chat_template: bool | None = None,
    system: str | None = None,
) -> list[dict[str, Any]]:
    """Complete every row (see the module docs); returns the output rows in input order.

    Example (a trained model; the module example runs an untrained one)::

        generate_rows(model, tok, [{"prompt": "Hi", "id": 1}], max_new_tokens=8)
        # -> [{'prompt': 'Hi', 'id': 1, 'completion': 'Hello!', 'finish_reason': 'stop',
        #      'new_tokens': 3}]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    positions = model_positions(model)
    for i, row in enumerate(rows):
        check_prompt_size(_text_size(row), positions, _where(rows, i))
    ids = [prompt_ids(tokenizer, r, chat_template=chat_template, system=system) for r in rows]
    limits = [
        fit_new_tokens(len(x), max_new_tokens, positions, _where(rows, i))
        for i, x in enumerate(ids)
    ]
    order = sorted(range(len(rows)), key=lambda i: -len(ids[i]))
    results: list[dict[str, Any] | None] = [None] * len(rows)
    stops = set(tokenizer.stop_token_ids)
    engine = LocalEngine(model, tokenizer, pad_id=tokenizer.pad_id or 0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k
    )
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        keys = None
        if seed is not None and temperature > 0:
            keys = [(seed * _KEY_MULTIPLIER + i) % 2**32 for i in chunk]
        prompts, row_limits = [ids[i] for i in chunk], [limits[i] for i in chunk]
        out = generate_with(
            engine, prompts, keys, config, tokenizer.stop_token_ids, max_new_tokens=row_limits
        )
        for i, tokens, reason in zip(chunk, out.sequences, out.finish_reasons):
            new_tokens = len(tokens)
            if tokens and tokens[-1] in stops:
                tokens = tokens[:-1]
            results[i] = {
                **rows[i],
                "completion": tokenizer.decode(tokens, skip_special_tokens=True),
                "finish_reason": reason,
                "new_tokens": new_tokens,
            }
    return results  # type: ignore[return-value]


def write_rows(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` as JSONL (UTF-8, one object a line, parent folders made); returns the
    path.

    Example::

        >>> write_rows("out/rows.jsonl", [{"completion": "Hi"}])
        PosixPath('out/rows.jsonl')
        >>> Path("out/rows.jsonl").read_text()
        '{"completion": "Hi"}\\n'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
