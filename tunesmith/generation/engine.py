"""Rollout engines: the narrow interface every decode of the library goes through.

A rollout worker needs two things from whatever decodes for it: completions with the sampling
log-prob of every token (:meth:`RolloutEngine.generate`), and new policy weights by Hugging
Face name after each update (:meth:`RolloutEngine.load_weights`). :class:`LocalEngine` is the
project's own engine (:mod:`~tunesmith.generation.paged`, CPU or GPU, the default);
:class:`~tunesmith.generation.vllm_engine.VLLMEngine` is the same interface over vLLM. RL
rollouts, held-out rewards, in-training samples, ``tunesmith generate``/``chat``, lm-eval and
the demos all decode through :func:`generate_with` (a :class:`GenerationConfig`, greedy or
sampled); nothing else calls :func:`~tunesmith.generation.generate` itself.

Example::

    >>> from tunesmith.models import llama3
    >>> engine = LocalEngine(llama3.llama3_tiny(), tokenizer=None, pad_id=0)
    >>> out = engine.generate([[1, 5, 7]], row_keys=[3], max_new_tokens=4, temperature=1.0,
    ...                       top_p=None, top_k=None, min_p=None, stop_token_ids=[],
    ...                       stop_strings=[])
    >>> len(out.sequences[0]), len(out.logprobs[0])
    (4, 4)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tunesmith.generation.config import EngineSettings, GenerationConfig
from tunesmith.generation.generate import GenerationOutput, generate
from tunesmith.generation.paged import generate_paged, supports_paged
from tunesmith.generation.prefix_cache import PrefixCache

__all__ = ["LocalEngine", "RolloutEngine", "check_named_weights", "generate_with"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout worker calls: :class:`LocalEngine` and ``VLLMEngine`` implement it.

    ``generate`` answers each prompt (token ids) once; ``row_keys`` (one int in
    ``[0, 2**32)`` per row, or None) make each row's sampling reproducible on its own.
    ``GenerationOutput.logprobs`` are the sampled tokens' log-probs under the tempered
    distribution ``log_softmax(logits / T)`` (``log_softmax(logits)`` when greedy), the numbers
    the trainer recomputes. ``load_weights`` copies tensors into the running policy by Hugging
    Face name; a partial update (e.g. only a LoRA policy's adapter weights) is allowed, but
    every name must exist with the sent shape. ``max_new_tokens`` is one limit for every
    prompt or one per prompt (a row whose limit is 0 is answered empty). Within
    ``keep_prefixes()`` the engine may keep the KV cache of what it prefilled and decoded for
    the calls that follow (a multi-turn rollout's next turn continues its conversation's
    cache); the results are the same up to float rounding.

    Example::

        >>> from tunesmith.models import llama3
        >>> isinstance(LocalEngine(llama3.llama3_tiny(), None, pad_id=0), RolloutEngine)
        True
    """

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        row_keys: Sequence[int] | None,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        min_p: float | None,
        stop_token_ids: Sequence[int],
        stop_strings: Sequence[str],
    ) -> GenerationOutput: ...

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None: ...

    def keep_prefixes(self) -> contextlib.AbstractContextManager[None]: ...


def check_named_weights(
    named_tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], where: str
) -> None:
    """Raise unless every name of ``named_tensors`` is in ``shapes`` with the same shape.

    The error names the first bad key (and both shapes, or up to five known names that look
    alike); ``where`` says whose names these are. Nothing is copied, so a caller that checks
    first updates all tensors or none.

    Example::

        >>> check_named_weights({"w": torch.zeros(2, 3)}, {"w": (2, 3)}, "the model")
        >>> check_named_weights({"v": torch.zeros(1)}, {"w": (2, 3)}, "the model")
        Traceback (most recent call last):
        ...
        KeyError: "load_weights: 'v' is not a parameter of the model (it has 1 names, e.g. ['w'])"
    """
    for name, tensor in named_tensors.items():
        if name not in shapes:
            tail = name.rsplit(".", 1)[-1]
            alike = [n for n in shapes if n.endswith(tail)][:5] or list(shapes)[:5]
            raise KeyError(
                f"load_weights: {name!r} is not a parameter of {where} "
                f"(it has {len(shapes)} names, e.g. {alike})"
            )
        sent, have = tuple(tensor.shape), tuple(shapes[name])
        if sent != have:
            raise ValueError(
                f"load_weights: {name!r} has shape {list(sent)} but {where} holds {list(have)}"
            )


class LocalEngine:
    """The project's own rollout engine: :func:`~tunesmith.generation.paged.generate_paged`
    (paged cache, shared prompts, continuous batching) on ``model``, or the plain
    :func:`~tunesmith.generation.generate` when ``settings.paged`` is false or the model keeps
    its own cache (the transformers backend).

    ``generate`` runs the model in eval mode (its previous mode restored after) under
    ``torch.no_grad()``, with keyed sampling when ``row_keys`` are given, ``tokenizer.decode``
    to find stop strings, and ``torch.autocast`` to ``autocast_dtype`` when set.
    ``load_weights`` copies tensors into the model's parameters by name (HF names: the
    identity map), cast to each parameter's dtype and device; every name and shape is checked
    before anything is copied. ``keep_prefixes()``: a block within which the paged cache
    and its full blocks outlive each call (:mod:`~tunesmith.generation.prefix_cache`), so a
    prompt that extends an earlier one (prompt, reply, observation: a conversation's next
    turn) prefills only what is new; released at the block's end, dropped by ``load_weights``.

    Args:
        model: a ``TransformerLM`` (plain, not sharded: a rollout worker holds a whole copy).
        tokenizer: anything with ``decode(ids) -> str``; may be None when no stop strings
            are used.
        pad_id: token fed for padding and finished rows (always masked out).
        autocast_dtype: e.g. ``torch.bfloat16`` to decode a float32 model under autocast.
        sync_ranks: every rank of the default process group decodes as many steps as the
            longest (a model sharded over the ranks, e.g. a trainer's FSDP2 policy).
        generator: the ``torch.Generator`` (on the model's device) rows without a key draw
            from, e.g. a chat session's, seeded once; None: torch's global generator.
        settings: the engine's :class:`~tunesmith.generation.config.EngineSettings` (slots,
            cache budget, prefix sharing, compile); the compiled decode step, if any, is made
            on the first call and kept for the engine's life.

    Example::

        >>> from tunesmith.models import llama3
        >>> model = llama3.llama3_tiny()
        >>> engine = LocalEngine(model, None, pad_id=0)
        >>> engine.load_weights({"model.norm.weight": torch.full((64,), 2.0)})
        >>> float(model.model.norm.weight.detach()[0])
        2.0
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        pad_id: int,
        autocast_dtype: torch.dtype | None = None,
        sync_ranks: bool = False,
        generator: torch.Generator | None = None,
        settings: EngineSettings | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = int(pad_id)
        self.autocast_dtype = autocast_dtype
        self.sync_ranks = sync_ranks
        self.generator = generator
        self.settings = settings or EngineSettings()
        self.paged = self.settings.paged and supports_paged(model)
        self._compiled: Any = None
        self._prefixes: PrefixCache | None = None

    def _compiled_step(self) -> Any:
        """The decode step compiled once (CUDA graphs on CUDA), or None."""
        if not (self.paged and self.settings.compile):
            return None
        if self._compiled is None:
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for p in self.model.parameters()):
                raise ValueError(
                    "generation.engine.compile: the decode step of a sharded model (FSDP2, "
                    "tensor parallel) is not compiled; set compile: false"
                )
            cuda = next(iter(self.model.parameters())).is_cuda
            mode = "reduce-overhead" if cuda else None
            self._compiled = torch.compile(self.model, dynamic=False, mode=mode)
        return self._compiled

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(iter(self.model.parameters())).device
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        row_keys: Sequence[int] | None,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        min_p: float | None,
        stop_token_ids: Sequence[int],
        stop_strings: Sequence[str],
    ) -> GenerationOutput:
        """Answer each prompt once (``max_new_tokens``: one limit, or one per prompt); see
        :class:`RolloutEngine`."""
        decode = None
        if stop_strings:
            if self.tokenizer is None:
                raise ValueError(
                    f"LocalEngine: stop_strings {list(stop_strings)} need a tokenizer to decode "
                    "completions, but the engine was built with tokenizer=None"
                )
            decode = self.tokenizer.decode
        was_training = self.model.training
        self.model.eval()
        paged = (
            {
                "settings": self.settings,
                "compiled_step": self._compiled_step(),
                "prefixes": self._prefixes,
            }
            if self.paged
            else {}
        )
        try:
            with torch.no_grad(), self._autocast():
                return (generate_paged if self.paged else generate)(
                    self.model,
                    prompt_ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    stop_token_ids=stop_token_ids,
                    stop_strings=stop_strings,
                    decode=decode,
                    pad_id=self.pad_id,
                    generator=self.generator,
                    row_keys=row_keys,
                    sync_ranks=self.sync_ranks,
                    **paged,
                )
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named_tensors`` into the model's parameters of the same names (all or none:
        an unknown name or a shape mismatch raises before any copy)."""
        params = dict(self.model.named_parameters())
        check_named_weights(
            named_tensors, {n: p.shape for n, p in params.items()}, "the rollout model"
        )
        for name, tensor in named_tensors.items():
            params[name].copy_(tensor.detach())
        if self._prefixes is not None:  # kept keys belong to the old weights
            self._prefixes = PrefixCache(self.settings.block_size)

    @contextlib.contextmanager
    def keep_prefixes(self) -> Iterator[None]:
        """Keep the paged cache's full blocks from call to call within this block (see the
        class docs); a no-op for the plain engine and with ``share_prefixes: false``, and
        inside an outer block (which keeps them).

        Example::

            with engine.keep_prefixes():
                first = engine.generate([prompt], ...)
                again = engine.generate([prompt + first.sequences[0] + observation], ...)
            again.stats["cached_tokens"]  # the full blocks of prompt + reply, not prefilled
        """
        if not (self.paged and self.settings.share_prefixes) or self._prefixes is not None:
            yield
            return
        self._prefixes = PrefixCache(self.settings.block_size)
        try:
            yield
        finally:
            self._prefixes = None  # the kept pool is released with it


def generate_with(
    engine: RolloutEngine,
    prompt_ids: Sequence[Sequence[int]],
    row_keys: Sequence[int] | None,
    config: GenerationConfig,
    stop_token_ids: Sequence[int],
    *,
    max_new_tokens: Sequence[int] | None = None,
) -> GenerationOutput:
    """``engine``'s completions of ``prompt_ids`` decoded as ``config`` says (greedy at
    temperature 0): the one call every decode goes through (RL rollouts, evaluation, samples,
    the CLI's ``generate``/``chat``/``eval``, the demos). ``max_new_tokens``: one limit per
    prompt instead of ``config.max_new_tokens``.

    Example::

        >>> from tunesmith.models import llama3
        >>> engine = LocalEngine(llama3.llama3_tiny(), None, pad_id=0)
        >>> out = generate_with(engine, [[1, 5, 7]], [3], GenerationConfig(max_new_tokens=4), [])
        >>> len(out.sequences[0])
        4
        >>> greedy = GenerationConfig(temperature=0.0)
        >>> out = generate_with(engine, [[1, 5], [1, 7]], None, greedy, [], max_new_tokens=[2, 3])
        >>> [len(s) for s in out.sequences]
        [2, 3]
    """
    limits = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    return engine.generate(
        prompt_ids,
        row_keys=row_keys,
        max_new_tokens=limits,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        stop_token_ids=stop_token_ids,
        stop_strings=list(config.stop_strings),
    )
