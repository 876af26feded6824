"""A preallocated (static) key/value cache for incremental decoding."""

from __future__ import annotations

import torch

from tunesmith.modules.masks import build_attention_mask

__all__ = ["KVCache"]


class KVCache:
    """Per-layer key/value buffers ``[batch, kv_heads, max_seq_len, head_dim]`` (values
    ``value_dim`` wide when given: multi-head latent attention caches its latent as the keys and
    its rotary key as the values, see :mod:`~tunesmith.modules.mla`).

    All rows share one fill level, :attr:`seq_len`. During a forward each attention
    layer calls :meth:`update` with its new keys/values, which are written after
    the cached ones; the model then calls :meth:`advance` once with the number of
    new tokens. With left padding, padded slots are simply masked out.

    Example::

        >>> cache = KVCache(num_layers=2, batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=4)
        >>> k, v = cache.update(0, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        >>> k.shape, cache.seq_len  # layer 0 sees 3 tokens; the fill level moves on advance()
        (torch.Size([1, 2, 3, 4]), 0)
        >>> cache.advance(3); cache.seq_len
        3
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        v_shape = (*shape[:3], head_dim if value_dim is None else value_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.seq_len = 0

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (``[batch, kv_heads, new, head_dim]``) after the cached tokens and
        return all keys/values so far, ``[batch, kv_heads, seq_len + new, head_dim]``."""
        new = k.shape[2]
        end = self.seq_len + new
        if end > self.max_seq_len:
            raise RuntimeError(
                f"KVCache overflow: {self.seq_len} cached + {new} new tokens > "
                f"max_seq_len={self.max_seq_len}"
            )
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KVCache holds batch {self.batch_size}, got keys for {k.shape[0]}")
        self.k[layer_idx][:, :, self.seq_len : end] = k
        self.v[layer_idx][:, :, self.seq_len : end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as filled (called once per model forward)."""
        if self.seq_len + num_tokens > self.max_seq_len:
            raise RuntimeError(
                f"KVCache overflow: cannot advance {self.seq_len} by {num_tokens} "
                f"past max_seq_len={self.max_seq_len}"
            )
        self.seq_len += num_tokens

    def next_positions(self, s: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[1, s]`` positions of ``s`` new tokens after the cached ones (the model's default
        ``position_ids``)."""
        return torch.arange(self.seq_len, self.seq_len + s, device=device)[None]

    def attention_mask(
        self,
        attention_mask: torch.Tensor | None,
        *,
        batch_size: int,
        q_len: int,
        sliding_window: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None:
        """The mask of a forward of ``q_len`` new tokens after the cached ones (see
        :func:`~tunesmith.modules.masks.build_attention_mask`)."""
        return build_attention_mask(
            attention_mask,
            batch_size=batch_size,
            q_len=q_len,
            kv_len=self.seq_len + q_len,
            sliding_window=sliding_window,
            device=device,
        )

    def reset(self) -> None:
        """Forget all cached tokens (buffers are kept and overwritten later)."""
        self.seq_len = 0

    def __repr__(self) -> str:
        b, h, n, d = self.k[0].shape if self.k else (self.batch_size, 0, self.max_seq_len, 0)
        return (
            f"KVCache(layers={self.num_layers}, batch={b}, kv_heads={h}, head_dim={d}, "
            f"seq_len={self.seq_len}/{n}, dtype={self.k[0].dtype if self.k else None})"
        )
