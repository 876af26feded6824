"""GGUF export of Llama 4 text models (``llama4_text``) as llama.cpp's ``llama4``.

llama.cpp's ``llama4`` reads from the file only the widths, the experts and
``interleave_moe_layer_step``; the rest is fixed in its code, so a model is exported only
when it is what that code computes (:func:`llama4_unsupported`):

- RoPE layers attend within chunks of 8192 positions, every 4th layer globally without RoPE
  (the published ``no_rope_layers`` and ``layer_types``);
- the NoPE layers' queries scaled by ``1 + 0.1 * log1p(floor((pos + 1) / 8192))`` (the
  published ``attn_temperature_tuning``, ``floor_scale`` 8192, ``attn_scale`` 0.1);
- a weightless RMS qk-norm (eps ``rms_norm_eps``) on the RoPE layers, except with 128 experts
  (llama.cpp's "17B-128E", Maverick, has none): ``use_qk_norm`` must say the same;
- every ``interleave_moe_layer_step``-th layer a sigmoid top-k mixture whose weights scale the
  expert's input, beside a shared expert as wide as one expert; the other layers dense.

RoPE rotates interleaved pairs as Llama 4 itself does (rows written as they are); Scout's llama3
RoPE scaling is written as ``rope_freqs``.

Example::

    >>> from tunesmith.models.zoo import llama4
    >>> llama4_unsupported(llama4.spec("llama4_scout_17b_16e"))
    []
    >>> moe_layer_step(llama4.spec("llama4_maverick_17b_128e"))
    2
"""

from __future__ import annotations

from typing import Any

from tunesmith.models.spec import ModelSpec

__all__ = ["CHUNK", "moe_layer_step", "llama4_unsupported", "write_llama4"]

CHUNK = 8192  # llama.cpp's llama4: chunk size and temperature floor scale, fixed
_ATTN_SCALE = 0.1  # llama.cpp's llama4: temperature scale, fixed
_EVERY = 4  # llama.cpp's llama4: a global NoPE layer every 4th, the others chunked RoPE
_NO_QK_NORM_EXPERTS = 128  # llama.cpp's llama4 skips the qk-norm for its "17B-128E" only


def moe_layer_step(spec: ModelSpec) -> int | None:
    """``interleave_moe_layer_step`` of ``spec``: ``s`` when its MoE layers are exactly every
    ``s``-th (layers ``s - 1, 2s - 1, ...``), else None."""
    moe = [i for i in range(spec.num_hidden_layers) if spec.is_moe_layer(i)]
    if not moe:
        return None
    step = moe[0] + 1
    return step if moe == list(range(step - 1, spec.num_hidden_layers, step)) else None


def llama4_unsupported(spec: ModelSpec) -> list[str]:
    """``"setting=value"`` for every setting of a Llama 4 ``spec`` that llama.cpp's ``llama4``
    computes otherwise (empty when it computes this model); RoPE's layout and the NoPE layers are
    checked with the other families' settings (:func:`tunesmith.models.gguf_arches.unsupported`).

    Example::

        >>> from tunesmith.models.zoo import llama4
        >>> llama4_unsupported(llama4.spec("llama4_tiny"))[:2]
        ['attention_chunk_size=3', 'floor_scale=2.0']
    """
    n = spec.num_hidden_layers
    wanted = {
        "attention_chunk_size": CHUNK,
        "floor_scale": float(CHUNK),
        "attn_scale": _ATTN_SCALE,
        "attn_temperature_tuning": True,
        "qk_l2_norm": spec.num_experts != _NO_QK_NORM_EXPERTS,
        "layer_types": tuple(
            "full_attention" if (i + 1) % _EVERY == 0 else "chunked_attention" for i in range(n)
        ),
    }
    found = [f"{key}={getattr(spec, key)!r}" for key, value in wanted.items()
             if getattr(spec, key) != value]  # fmt: skip
    if moe_layer_step(spec) is None:
        found.append(f"mlp_only_layers={spec.mlp_only_layers!r} (MoE layers not every n-th)")
    return found


def write_llama4(writer: Any, spec: ModelSpec) -> None:
    """llama.cpp's ``llama4`` key for its MoE layers (the rest is fixed in its code)."""
    step = moe_layer_step(spec)
    assert step is not None  # checked by llama4_unsupported
    writer.add_interleave_moe_layer_step(step)
