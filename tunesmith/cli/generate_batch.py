"""Batch generation for ``tunesmith generate CKPT --input prompts.jsonl --output out.jsonl``.

Each input line is a JSON string (a prompt) or an object with ``"prompt"`` (a string) or
``"messages"`` (a list of ``{role, content}``); an object's other keys are copied to its output
line (ids, reference answers). Prompts go through the chat template (as one user message)
when the tokenizer has one, unless ``chat_template=False``; messages always do. Rows are
decoded in batches of similar length; each output line is the input row plus ``completion``,
``finish_reason`` (``stop`` or ``length``) and ``new_tokens``, in input order.

Sampling with a ``seed`` is keyed per row (see :mod:`tunesmith.generation.keyed`): a row's
completion depends on the seed, its line number and its prompt, not on the batch size.

Example::

    >>> rows = read_prompt_rows("prompts.jsonl")  # doctest: +SKIP
    >>> out = generate_rows(model, tokenizer, rows, max_new_tokens=64)  # doctest: +SKIP
    >>> out[0]["completion"]  # doctest: +SKIP
    '42'
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from tunesmith.data import Tokenizer
from tunesmith.generation import generate
from tunesmith.training.sample_prompts import prompt_ids

__all__ = ["generate_rows", "prompt_ids", "read_prompt_rows", "write_rows"]

_KEY_MULTIPLIER = 1_000_003  # spreads (seed, row) pairs over the 32-bit key space


def read_prompt_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a prompts JSONL file, each as ``{"prompt": str, ...}`` or
    ``{"messages": [...], ...}``; blank lines are skipped. A bad line is an error naming the
    file and line.

    Example::

        >>> read_prompt_rows("prompts.jsonl")  # doctest: +SKIP
        [{'prompt': 'Hi'}, {'messages': [{'role': 'user', 'content': 'Hi'}], 'id': 7}]
    """
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if isinstance(value, str):
            value = {"prompt": value}
        if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
            raise ValueError(f"{where}: expected a JSON string, or an object with exactly one "
                             f"of 'prompt' (a string) and 'messages' (a list)")  # fmt: skip
        if "prompt" in value and not isinstance(value["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string, got "
                             f"{type(value['prompt']).__name__}")  # fmt: skip
        messages = value.get("messages", [])
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        rows.append(value)
    return rows


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

    Example::

        >>> generate_rows(model, tok, [{"prompt": "Hi", "id": 1}], max_new_tokens=8)  # doctest: +SKIP
        [{'prompt': 'Hi', 'id': 1, 'completion': 'Hello!', 'finish_reason': 'stop', 'new_tokens': 3}]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    ids = [prompt_ids(tokenizer, r, chat_template=chat_template, system=system) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -len(ids[i]))
    results: list[dict[str, Any] | None] = [None] * len(rows)
    stops = set(tokenizer.stop_token_ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        keys = None
        if seed is not None and temperature > 0:
            keys = [(seed * _KEY_MULTIPLIER + i) % 2**32 for i in chunk]
        out = generate(
            model,
            [ids[i] for i in chunk],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_token_ids=tokenizer.stop_token_ids,
            pad_id=tokenizer.pad_id or 0,
            row_keys=keys,
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

        >>> write_rows("out.jsonl", [{"completion": "Hi"}])  # doctest: +SKIP
        PosixPath('out.jsonl')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
