"""A :class:`~tunesmith.generation.engine.RolloutEngine` over vLLM's offline ``LLM`` (GPU only).

vLLM is optional, CUDA-only, and pins its own torch: nothing imports it but
:class:`VLLMEngine`'s constructor, so this module imports (and its conversion functions run)
without it. In an async RL run the engine lives in a rollout actor, which gets vLLM's own
environment (``rollout.runtime_env: {pip: [vllm==...]}``, which runs code and so needs
``tunesmith --allow-runtime-env run ...``) when its torch differs from the trainer's.

Needs vLLM >= 0.10.2 (:data:`MIN_VLLM_VERSION`): the engine is created with
``logprobs_mode="processed_logprobs"``, so the log-prob vLLM returns for a sampled token
(``logprobs=0`` asks for that token's only) is taken after temperature scaling, i.e.
``log_softmax(logits / T)``: what tunesmith's trainer recomputes, and what
:class:`~tunesmith.generation.engine.LocalEngine` returns. vLLM also takes top-k / top-p /
min-p filtering into those log-probs (renormalised over the kept tokens) where tunesmith does
not; :class:`VLLMEngine` therefore refuses these filters while sampling unless built with
``allow_filtered_logprobs=True``. Greedy decoding (``temperature=0``) returns
``log_softmax(logits)``, as tunesmith does.

Per request: ``n=1`` (a group of ``G`` samples is ``G`` rows with their own keys), the row's key
as vLLM's per-request ``seed`` (a completion is reproducible whatever batch it is in, though
the draws differ from :class:`LocalEngine`'s keyed sampling), ``ignore_eos=True`` so only the
given ``stop_token_ids`` stop a row (as in :func:`~tunesmith.generation.generate`), the stop
token (or the token completing a stop string) kept in the completion.

Weights: :meth:`VLLMEngine.load_weights` checks names and shapes against the checkpoint the
engine was started from, packs the tensors (in the engine's dtype, on CPU) into safetensors
blobs of at most ``max_update_bytes`` each, and sends each blob through
``LLM.collective_rpc`` to :class:`VLLMWorkerExtension` on every vLLM worker, which hands them
to the vLLM model's own ``load_weights`` (HF names in, vLLM's fused layouts out); the prefix
cache is reset after. A LoRA policy must send merged weights
(:func:`tunesmith.modules.peft.apply.merge_adapters` on a copy).

Example::

    engine = VLLMEngine("path/to/hf_folder", gpu_memory_utilization=0.3)
    out = engine.generate([[1, 5, 7]], row_keys=[3], max_new_tokens=16, temperature=1.0,
                          top_p=None, top_k=None, min_p=None, stop_token_ids=[2],
                          stop_strings=[])
    engine.load_weights(dict(policy.named_parameters()))
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from tunesmith.generation.engine import check_named_weights
from tunesmith.generation.generate import GenerationOutput, row_limits
from tunesmith.generation.sampling import build_processors

__all__ = [
    "MIN_VLLM_VERSION",
    "VLLMEngine",
    "VLLMWorkerExtension",
    "check_vllm_version",
    "generation_output",
    "llm_kwargs",
    "pack_weights",
    "sampling_params_kwargs",
    "unpack_weights",
    "weight_update_blobs",
]

MIN_VLLM_VERSION = (0, 10, 2)
"""The oldest vLLM whose ``logprobs_mode="processed_logprobs"`` returns post-temperature
log-probs of the sampled tokens."""

WORKER_EXTENSION = "tunesmith.generation.vllm_engine.VLLMWorkerExtension"
"""What :func:`llm_kwargs` passes as vLLM's ``worker_extension_cls``."""

_MISSING_VLLM = (
    "VLLMEngine needs vLLM, which is not installed: pip install vllm "
    "(it needs a CUDA GPU and pins its own torch; the default rollout engine is 'local')"
)


def check_vllm_version(version: str) -> None:
    """Raise unless ``version`` (e.g. ``vllm.__version__``) is at least
    :data:`MIN_VLLM_VERSION`; suffixes such as ``.post1`` or ``+cu128`` are ignored.

    Example::

        >>> check_vllm_version("0.11.0+cu128")
        >>> check_vllm_version("0.9.2")
        Traceback (most recent call last):
        ...
        ImportError: VLLMEngine needs vllm >= 0.10.2 (processed log-probs), found 0.9.2: pip install -U vllm
    """
    numbers = [int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3]]
    if tuple(numbers) < MIN_VLLM_VERSION:
        need = ".".join(map(str, MIN_VLLM_VERSION))
        raise ImportError(
            f"VLLMEngine needs vllm >= {need} (processed log-probs), found {version}: "
            "pip install -U vllm"
        )


def _filters_logprobs(top_k: int | None, top_p: float | None, min_p: float | None) -> bool:
    return top_k is not None or (top_p is not None and top_p < 1) or bool(min_p)


def sampling_params_kwargs(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    stop_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    seed: int | None,
    allow_filtered_logprobs: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of one row's ``vllm.SamplingParams`` for our settings.

    Settings are validated as :func:`~tunesmith.generation.generate` does; a filter that
    cannot change anything (``top_p=1``, ``min_p=0``) is left out. Sampling with top-k / top-p
    / min-p raises unless ``allow_filtered_logprobs`` (vLLM's log-probs would then be of the
    filtered distribution, not ``log_softmax(logits / T)``).

    Example::

        >>> kw = sampling_params_kwargs(max_new_tokens=8, temperature=0.7, top_p=1.0,
        ...     top_k=None, min_p=None, stop_token_ids=[2], stop_strings=[], seed=11)
        >>> sorted(kw.items())  # doctest: +NORMALIZE_WHITESPACE
        [('detokenize', False), ('ignore_eos', True), ('logprobs', 0), ('max_tokens', 8),
         ('n', 1), ('seed', 11), ('stop', []), ('stop_token_ids', [2]), ('temperature', 0.7)]
    """
    build_processors(temperature, top_k, top_p, min_p)  # same checks and messages as generate
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for vLLM, got {max_new_tokens}")
    if temperature > 0 and _filters_logprobs(top_k, top_p, min_p) and not allow_filtered_logprobs:
        raise ValueError(
            f"VLLMEngine: sampling with top_k={top_k}, top_p={top_p}, min_p={min_p} makes "
            "vLLM's log-probs those of the filtered distribution, not log_softmax(logits / T) "
            "that the trainer recomputes; drop the filters, or build "
            "VLLMEngine(..., allow_filtered_logprobs=True) to accept the mismatch"
        )
    stops = [str(s) for s in stop_strings]
    for i, stop in enumerate(stops):
        if not stop:
            raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {stop!r}")
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": max_new_tokens,
        "temperature": float(temperature),
        "seed": None if seed is None else int(seed),
        "stop_token_ids": sorted(set(map(int, stop_token_ids))),
        "stop": stops,
        "ignore_eos": True,  # only the given stop tokens end a row, as in generate()
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": bool(stops),  # text is only needed to find stop strings
    }
    if temperature > 0:
        if top_k is not None:
            kwargs["top_k"] = int(top_k)
        if top_p is not None and top_p < 1:
            kwargs["top_p"] = float(top_p)
        if min_p:
            kwargs["min_p"] = float(min_p)
    return kwargs


def generation_output(outputs: Sequence[Any], *, seconds: float = 0.0) -> GenerationOutput:
    """Turn vLLM ``RequestOutput``s (one completion each, in prompt order) into a
    :class:`~tunesmith.generation.generate.GenerationOutput`.

    Reads ``prompt_token_ids`` and ``outputs[0]``'s ``token_ids``, ``logprobs`` (per token a
    mapping ``token id -> Logprob`` with ``.logprob``) and ``finish_reason`` (``"stop"`` or
    ``"length"``; anything else, e.g. ``"abort"``, raises naming the row).

    Example::

        >>> from types import SimpleNamespace as NS
        >>> done = NS(token_ids=[4, 2], logprobs=[{4: NS(logprob=-0.5)}, {2: NS(logprob=-0.25)}],
        ...           finish_reason="stop")
        >>> out = generation_output([NS(request_id="0", prompt_token_ids=[1, 3], outputs=[done])])
        >>> out.sequences, out.logprobs, out.prompt_lengths, out.finish_reasons
        ([[4, 2]], [[-0.5, -0.25]], [2], ['stop'])
    """
    sequences, logprobs, prompt_lengths, reasons = [], [], [], []
    for row, request in enumerate(outputs):
        where = f"vLLM output {row} (request {getattr(request, 'request_id', '?')})"
        if len(request.outputs) != 1:
            raise ValueError(f"{where} holds {len(request.outputs)} completions, expected 1")
        done = request.outputs[0]
        tokens = [int(t) for t in done.token_ids]
        if done.logprobs is None:
            raise ValueError(f"{where} came back without log-probs (request logprobs=0)")
        if len(done.logprobs) != len(tokens):
            raise ValueError(
                f"{where} has {len(tokens)} tokens but {len(done.logprobs)} log-prob entries"
            )
        values = []
        for j, (token, step) in enumerate(zip(tokens, done.logprobs)):
            if token not in step:
                raise ValueError(f"{where}: token {j} ({token}) has no log-prob")
            values.append(float(step[token].logprob))
        if done.finish_reason not in ("stop", "length"):
            raise ValueError(
                f"{where} finished with reason {done.finish_reason!r}; expected 'stop' or 'length'"
            )
        sequences.append(tokens)
        logprobs.append(values)
        prompt_lengths.append(len(request.prompt_token_ids))
        reasons.append(done.finish_reason)
    return GenerationOutput(sequences, logprobs, prompt_lengths, reasons, seconds=seconds)


def pack_weights(
    named_tensors: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None,
    max_bytes: int,
) -> Iterator[bytes]:
    """Serialise ``named_tensors`` (cast to ``dtype`` unless None, copied to CPU) into
    safetensors blobs of at most ``max_bytes`` of tensor data each, filled in the given order; a
    tensor larger than ``max_bytes`` travels alone. Plain bytes cross any vLLM executor. A
    generator: one blob is built at a time, so an update never holds a second full copy.

    Example::

        >>> blobs = pack_weights({"a": torch.ones(4), "b": torch.zeros(4)}, dtype=None,
        ...                      max_bytes=16)  # 16 bytes each: one blob per tensor
        >>> [[name for name, _ in unpack_weights(b)] for b in blobs]
        [['a'], ['b']]
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors.items():
        if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "full_tensor"):
            raise TypeError(
                f"load_weights: {name!r} is a {type(tensor).__name__}; send plain (full, "
                "unsharded) tensors"
            )
        t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype, copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_bytes:
            yield safetensors_save(chunk)
            chunk, size = {}, 0
        chunk[name] = t
        size += nbytes
    if chunk:
        yield safetensors_save(chunk)


def unpack_weights(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one :func:`pack_weights` blob, sorted by name.

    Example::

        >>> unpack_weights(next(pack_weights({"w": torch.ones(2)}, dtype=None, max_bytes=64)))
        [('w', tensor([1., 1.]))]
    """
    return sorted(safetensors_load(blob).items(), key=lambda pair: pair[0])


def weight_update_blobs(
    named_tensors: Mapping[str, torch.Tensor],
    *,
    shapes: Mapping[str, Sequence[int]] | None,
    where: str,
    dtype: torch.dtype | None,
    max_bytes: int,
) -> Iterator[bytes]:
    """Check a weight update for vLLM and pack it (:func:`pack_weights`).

    LoRA adapter tensors are refused (vLLM's model holds merged weights only); every name must
    be one of ``shapes`` (the engine's checkpoint; None skips the check) with its shape. The
    checks run now, before any blob is built.

    Example::

        >>> blobs = weight_update_blobs({"w": torch.ones(2, 3)}, shapes={"w": (2, 3)},
        ...                             where="the checkpoint", dtype=torch.bfloat16, max_bytes=64)
        >>> unpack_weights(next(blobs))[0][1].dtype
        torch.bfloat16
    """
    adapters = [name for name in named_tensors if ".lora_" in name]
    if adapters:
        raise ValueError(
            f"VLLMEngine.load_weights takes full weights, got LoRA adapter tensors "
            f"({adapters[0]!r}, ...): send merged weights "
            "(tunesmith.modules.peft.apply.merge_adapters on a copy of the policy)"
        )
    if shapes is not None:
        check_named_weights(named_tensors, shapes, where)
    return pack_weights(named_tensors, dtype=dtype, max_bytes=max_bytes)


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): receives weight blobs.

    vLLM makes this class a base of its worker class, so ``self.model_runner`` is the worker's.
    :meth:`VLLMEngine.load_weights` calls :meth:`tunesmith_load_weights` on every worker
    through ``LLM.collective_rpc``.

    Example::

        >>> callable(VLLMWorkerExtension.tunesmith_load_weights)
        True
    """

    model_runner: Any

    def tunesmith_load_weights(self, blob: bytes) -> int:
        """Load one :func:`pack_weights` blob into the worker's model by HF name; returns the
        number of tensors."""
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        weights = unpack_weights(blob)
        model.load_weights(weights=weights)
        return len(weights)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(_MISSING_VLLM) from error
    check_vllm_version(getattr(vllm, "__version__", "0"))
    return vllm


def llm_kwargs(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.5,
    seed: int = 0,
    max_model_len: int | None = None,
    enforce_eager: bool = True,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments :class:`VLLMEngine` builds ``vllm.LLM`` with.

    Fixes ``logprobs_mode="processed_logprobs"`` and the worker extension (passing another
    value for either raises); ``engine_kwargs`` (e.g. ``tensor_parallel_size``) pass through.

    Example::

        >>> kw = llm_kwargs("m", max_model_len=512)
        >>> kw["model"], kw["logprobs_mode"], kw["max_model_len"]
        ('m', 'processed_logprobs', 512)
    """
    fixed = {"logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION}
    for key, value in fixed.items():
        if key in engine_kwargs and engine_kwargs[key] != value:
            raise ValueError(
                f"VLLMEngine sets {key}={value!r} itself; got {key}={engine_kwargs[key]!r}"
            )
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "gpu_memory_utilization": gpu_memory_utilization,
        "seed": seed,
        "enforce_eager": enforce_eager,
        **engine_kwargs,
        **fixed,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def _transport_dtype(dtype: str) -> torch.dtype | None:
    if dtype == "auto":
        return None
    from tunesmith.modules.dtypes import dtype_from_name

    return dtype_from_name(dtype, what="dtype")


class VLLMEngine:
    """The :class:`~tunesmith.generation.engine.RolloutEngine` interface over ``vllm.LLM``.

    Args:
        model_dir: a HF folder (weights, ``config.json``, tokenizer) vLLM can serve.
        dtype: vLLM's ``dtype`` (``"bfloat16"``, ``"float16"``, ``"auto"`` ...); weights sent
            to :meth:`load_weights` are cast to it before they travel.
        gpu_memory_utilization: the share of GPU memory vLLM may take (leave room for a
            trainer on the same GPU).
        seed: vLLM's seed (rows without a key sample from it).
        max_model_len: the longest prompt + completion; None takes the model's.
        enforce_eager: no CUDA graphs (faster start; set False for long runs).
        allow_filtered_logprobs: accept top-k / top-p / min-p while sampling (see the module
            docs: the returned log-probs then include the filter).
        max_update_bytes: the largest blob one ``collective_rpc`` carries in
            :meth:`load_weights`.
        engine_kwargs: passed to ``vllm.LLM`` (e.g. ``tensor_parallel_size``).

    Raises ``ImportError`` naming ``pip install vllm`` when vLLM is missing or too old.

    Example::

        engine = VLLMEngine("path/to/hf_folder")
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        allow_filtered_logprobs: bool = False,
        max_update_bytes: int = 1 << 30,
        **engine_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        self.model_dir = Path(model_dir)
        self.allow_filtered_logprobs = allow_filtered_logprobs
        self.max_update_bytes = int(max_update_bytes)
        self._dtype = _transport_dtype(dtype)
        self._shapes = self._checkpoint_shapes()
        self._sampling_params = vllm.SamplingParams
        self.llm = vllm.LLM(
            **llm_kwargs(
                model_dir,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=enforce_eager,
                **engine_kwargs,
            )
        )

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """HF name -> shape of every tensor of the local checkpoint (headers only); None for a
        model vLLM fetches by hub name (then vLLM itself rejects an unknown name)."""
        if not self.model_dir.is_dir():
            return None
        from tunesmith.models.safetensors_io import read_tensor_index

        return {name: info.shape for name, info in read_tensor_index(self.model_dir).items()}

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
        """Answer each prompt once with vLLM (``max_new_tokens``: one limit, or one per prompt;
        a row whose limit is 0 is answered empty without asking vLLM); see
        :class:`~tunesmith.generation.engine.RolloutEngine`."""
        started = time.perf_counter()
        rows = [[int(t) for t in row] for row in prompt_ids]
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        keys: list[int | None] = [None] * len(rows)
        if row_keys is not None:
            keys = [int(k) for k in row_keys]
            if len(keys) != len(rows):
                raise ValueError(f"row_keys has {len(keys)} keys for {len(rows)} prompts")
        limits = row_limits(max_new_tokens, len(rows))
        out = GenerationOutput(
            [[] for _ in rows], [[] for _ in rows], [len(r) for r in rows], ["length"] * len(rows)
        )
        asked = [i for i, limit in enumerate(limits) if limit > 0]
        if asked:
            params = [
                self._sampling_params(
                    **sampling_params_kwargs(
                        max_new_tokens=limits[i],
                        temperature=temperature,
                        top_p=top_p,
                        top_k=top_k,
                        min_p=min_p,
                        stop_token_ids=stop_token_ids,
                        stop_strings=stop_strings,
                        seed=keys[i],
                        allow_filtered_logprobs=self.allow_filtered_logprobs,
                    )
                )
                for i in asked
            ]
            prompts = [{"prompt_token_ids": rows[i]} for i in asked]
            got = generation_output(self.llm.generate(prompts, params, use_tqdm=False))
            for j, i in enumerate(asked):
                out.sequences[i], out.logprobs[i] = got.sequences[j], got.logprobs[j]
                out.finish_reasons[i] = got.finish_reasons[j]
        out.seconds = time.perf_counter() - started
        return out

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Push ``named_tensors`` (HF names, full tensors) into the running vLLM model on every
        worker, then reset the prefix cache (its KV entries came from the old weights)."""
        blobs = weight_update_blobs(
            named_tensors,
            shapes=self._shapes,
            where=f"the checkpoint {self.model_dir}",
            dtype=self._dtype,
            max_bytes=self.max_update_bytes,
        )
        for blob in blobs:
            self.llm.collective_rpc("tunesmith_load_weights", args=(blob,))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def keep_prefixes(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to do: vLLM's automatic prefix caching keeps prompts' blocks across calls
        (``enable_prefix_caching``, on by default)."""
        return contextlib.nullcontext()
