"""Batched autoregressive decoding for :class:`~tunesmith.modules.decoder.TransformerLM`.

Prompts of different lengths are left padded; a 2-D attention mask hides the padding and
per-row position ids count only real tokens (``cumsum(mask) - 1``, as transformers does), so
each row decodes exactly as it would alone. With ``use_cache=True`` the prompt is prefilled
into a KV cache once and each step feeds one token per row; ``use_cache=False`` recomputes
the whole sequence every step (slow; a reference for tests and benchmarks).

Example::

    >>> from tunesmith.models import llama3
    >>> model = llama3.llama3_tiny()
    >>> out = generate(model, [[1, 5, 7], [1, 9]], max_new_tokens=4, stop_token_ids=[2])
    >>> [len(s) <= 4 for s in out.sequences], out.prompt_lengths
    ([True, True], [3, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from tunesmith.generation.sampling import LogitsProcessor, build_processors, sample
from tunesmith.modules.decoder import TransformerLM
from tunesmith.modules.masks import padding_position_ids

__all__ = ["FinishReason", "GenerationOutput", "generate", "left_pad"]

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationOutput:
    """Result of :func:`generate`, one entry per prompt, in prompt order.

    ``sequences[i]`` holds only the new tokens (the stop token included when the row stopped,
    nothing after it). ``logprobs[i][j]`` is the raw policy log-prob of ``sequences[i][j]``
    (see :func:`tunesmith.generation.sampling.sample`). ``finish_reasons[i]`` is ``"stop"``
    when a stop token ended the row, else ``"length"``.
    """

    sequences: list[list[int]]
    logprobs: list[list[float]]
    prompt_lengths: list[int]
    finish_reasons: list[FinishReason]


def _as_token_lists(prompts: Sequence[Sequence[int]] | Tensor) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(
                f"prompts tensor must be 1-D or 2-D token ids, got shape {tuple(prompts.shape)}"
            )
        if prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(f"prompts tensor must hold integer token ids, got {prompts.dtype}")
        return prompts.tolist()
    rows = [list(map(int, row)) for row in prompts]
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    return rows


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask, position_ids)``, each ``[b, L]``.

    ``attention_mask`` is 1 on real tokens, 0 on padding (``torch.long``); ``position_ids``
    count real tokens only (``cumsum(mask) - 1``; 0 on padding).

    Example::

        >>> ids, mask, pos = left_pad([[5, 6, 7], [8]], pad_id=0)
        >>> ids.tolist(), mask.tolist(), pos.tolist()
        ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, row in enumerate(prompts):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    length = max(len(row) for row in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, row in enumerate(prompts):
        ids[i, length - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, length - len(row) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, padding_position_ids(mask)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _check_vocab(rows: list[list[int]], model: nn.Module) -> None:
    spec = getattr(model, "spec", None)
    vocab = getattr(spec, "vocab_size", None)
    for i, row in enumerate(rows):
        low, high = min(row), max(row)
        if low < 0 or (vocab is not None and high >= vocab):
            bad = low if low < 0 else high
            raise ValueError(
                f"prompt {i} holds token id {bad}, outside the model's vocabulary [0, {vocab})"
            )


def _last_logits(model: nn.Module, input_ids: Tensor, **kwargs: object) -> Tensor:
    """Logits ``[b, V]`` of the last position only.

    A ``TransformerLM`` projects only the last hidden state (``logits_to_keep=1``), so a long
    prefill never materialises ``[b, s, V]`` logits; other models run their full forward.
    """
    if isinstance(model, TransformerLM):
        return model(input_ids, logits_to_keep=1, **kwargs)[:, -1]
    return model(input_ids, **kwargs)[:, -1]


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: Sequence[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    processors: Sequence[LogitsProcessor] = (),
) -> GenerationOutput:
    """Decode up to ``max_new_tokens`` tokens for every prompt, batched.

    Args:
        model: a ``TransformerLM`` (``forward(input_ids, position_ids=, attention_mask=,
            kv_cache=)`` and ``init_kv_cache``); it runs on whatever device/dtype it is on.
        prompts: token lists of any lengths, or an integer tensor ``[b, s]`` / ``[s]`` whose
            entries are all real tokens (no padding).
        temperature: 0 is greedy; > 0 samples (with ``top_k``/``top_p`` filtering).
        stop_token_ids: a row ends after it emits any of these (kept in its sequence).
        pad_id: token fed for finished rows and used as left padding (always masked out).
        generator: ``torch.Generator`` on the model's device, for repeatable sampling.
        use_cache: KV cache (prefill, then one token per step) or full recompute per step.
        processors: extra logits processors applied after temperature/top-k/top-p.

    The model's train/eval mode is left as it is (call ``model.eval()`` if it has dropout).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    build_processors(temperature, top_k, top_p)  # validate the settings before any work
    rows = _as_token_lists(prompts)
    _check_vocab([r for r in rows if r], model)
    device = _model_device(model)
    input_ids, prompt_mask, prompt_pos = left_pad(rows, pad_id, device)
    batch, prompt_len = input_ids.shape
    prompt_lengths = [len(r) for r in rows]
    if max_new_tokens == 0:
        return GenerationOutput(
            [[] for _ in rows], [[] for _ in rows], prompt_lengths, ["length"] * batch
        )

    padded = not bool(prompt_mask.all())
    total_len = prompt_len + max_new_tokens
    # The full mask for every step: generated positions are always "real" (finished rows keep
    # decoding pad tokens whose outputs are discarded). ``None`` when there is no padding.
    full_mask = torch.ones((batch, total_len), dtype=torch.long, device=device)
    full_mask[:, :prompt_len] = prompt_mask
    next_pos = prompt_pos[:, -1] + 1
    full_pos = torch.cat(
        [prompt_pos, next_pos[:, None] + torch.arange(max_new_tokens, device=device)], dim=1
    )
    tokens = torch.full((batch, total_len), pad_id, dtype=torch.long, device=device)
    tokens[:, :prompt_len] = input_ids

    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)

    def mask_upto(end: int) -> Tensor | None:
        return full_mask[:, :end] if padded else None

    cache = model.init_kv_cache(batch, total_len, device=device) if use_cache else None
    logits = _last_logits(
        model,
        input_ids,
        position_ids=prompt_pos,
        attention_mask=mask_upto(prompt_len),
        kv_cache=cache,
    )
    for step in range(max_new_tokens):
        out = sample(
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            processors=processors,
            generator=generator,
        )
        new = torch.where(finished, torch.full_like(out.tokens, pad_id), out.tokens)
        cur = prompt_len + step
        tokens[:, cur] = new
        logprobs[:, step] = out.logprobs
        lengths += (~finished).long()
        if stop.numel():
            finished |= torch.isin(new, stop)
        # ``finished.all()`` is the only per-step host sync, and only when rows can stop.
        if step == max_new_tokens - 1 or (stop.numel() and bool(finished.all())):
            break
        if use_cache:
            logits = _last_logits(
                model,
                new[:, None],
                position_ids=full_pos[:, cur : cur + 1],
                attention_mask=mask_upto(cur + 1),
                kv_cache=cache,
            )
        else:
            logits = _last_logits(
                model,
                tokens[:, : cur + 1],
                position_ids=full_pos[:, : cur + 1],
                attention_mask=mask_upto(cur + 1),
            )

    generated = tokens[:, prompt_len:].tolist()
    lps = logprobs.tolist()
    n_new = lengths.tolist()
    done = finished.tolist()
    return GenerationOutput(
        sequences=[generated[i][: n_new[i]] for i in range(batch)],
        logprobs=[lps[i][: n_new[i]] for i in range(batch)],
        prompt_lengths=prompt_lengths,
        finish_reasons=["stop" if done[i] else "length" for i in range(batch)],
    )
