"""A paged key/value cache: fixed-size blocks in one preallocated pool, shared between rows.

Each row (a decode *slot*) reads its keys/values through a *block table*: entry ``j`` is the
pool block that holds its positions ``[j * block_size, (j + 1) * block_size)``. Rows that share
a prompt point their first entries at the same blocks (the prompt is prefilled once), and a
finished row's blocks go back to the pool for the next row: nothing is reallocated or
concatenated while decoding. Position ``p`` of a row always sits at index ``p`` of its gathered
keys, so causality and sliding windows are masks on positions alone.

Before each forward the engine :meth:`~PagedKVCache.bind` s the rows it runs: their block
tables ``[b, n_blocks]`` and the positions ``[b, s]`` of the new tokens. Each attention layer
then calls :meth:`~PagedKVCache.update`, which writes the new keys/values where the positions
say and returns every row's keys/values ``[b, kv_heads, n_blocks * block_size, head_dim]``;
:meth:`~PagedKVCache.attention_mask` hides what a query may not see (later positions, stale
entries of reused blocks, keys outside a sliding window). Block 0 is scratch: padding tokens
write there and nothing reads it unmasked.

Example::

    >>> cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3)
    >>> cache.bind(torch.tensor([[1, 2]]), torch.tensor([[0, 1, 2]]))  # one row, 3 tokens
    >>> k, v = cache.update(0, torch.ones(1, 1, 3, 3), torch.ones(1, 1, 3, 3))
    >>> k.shape, cache.attention_mask(None, batch_size=1, q_len=3)[0, 0].int().tolist()
    (torch.Size([1, 1, 4, 3]), [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
"""

from __future__ import annotations

import torch

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Per-layer pools ``[num_blocks, block_size, kv_heads, head_dim]`` of keys and values.

    Args:
        num_layers: attention layers of the model (one pool pair each).
        num_blocks: blocks in each pool, block 0 (scratch) included.
        block_size: positions per block.
        num_kv_heads: key/value heads (per rank under tensor parallel).
        head_dim: width of one head.
        value_dim: width of one value head when it is not ``head_dim`` (multi-head latent
            attention: the latent as keys, the rotary key as values).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"PagedKVCache needs at least 2 blocks (one is scratch), got {num_blocks}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        v_shape = (*shape[:3], head_dim if value_dim is None else value_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_tables: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self._write_at: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        value_dim: int | None = None,
    ) -> int:
        """Bytes one block takes over all layers (keys and values).

        >>> PagedKVCache.bytes_per_block(2, 16, 4, 8, torch.float32)
        8192
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        widths = head_dim + (head_dim if value_dim is None else value_dim)
        return num_layers * block_size * num_kv_heads * widths * itemsize

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def block_bytes(self) -> int:
        """Bytes one block of this cache takes over all layers (keys and values)."""
        _, block_size, heads, dim = self.k[0].shape
        value_dim = self.v[0].shape[-1]
        return self.bytes_per_block(
            self.num_layers, block_size, heads, dim, self.k[0].dtype, value_dim
        )

    def bind(self, block_tables: torch.Tensor, positions: torch.Tensor) -> None:
        """Set the rows of the next forward: ``block_tables`` ``[b, n]`` (pool block ids) and
        ``positions`` ``[b, s]`` of the new tokens (a position at or past ``n * block_size``,
        or in a table entry 0, writes to the scratch block)."""
        self.block_tables, self.positions = block_tables, positions
        n = block_tables.shape[1]
        logical = (positions // self.block_size).clamp(max=n - 1)
        block = block_tables.gather(1, logical)
        block = torch.where(positions < n * self.block_size, block, 0)
        self._write_at = (block * self.block_size + positions % self.block_size).reshape(-1)

    def next_positions(self, s: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The bound positions (the model's default ``position_ids``)."""
        if self.positions is None or self.positions.shape[1] != s:
            raise RuntimeError("PagedKVCache: bind(block_tables, positions) before each forward")
        return self.positions

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` (``[b, kv_heads, s, head_dim]``) at the bound positions and return
        every bound row's keys/values ``[b, kv_heads, n * block_size, head_dim]``."""
        if self._write_at is None or self.block_tables is None:
            raise RuntimeError("PagedKVCache: bind(block_tables, positions) before each forward")
        b, h, s, d = k.shape
        dv = v.shape[-1]
        pool_k, pool_v = self.k[layer_idx], self.v[layer_idx]
        new_k = k.transpose(1, 2).reshape(b * s, h, d).to(pool_k.dtype)
        new_v = v.transpose(1, 2).reshape(b * s, h, dv).to(pool_v.dtype)
        pool_k.view(-1, h, d).index_copy_(0, self._write_at, new_k)
        pool_v.view(-1, h, dv).index_copy_(0, self._write_at, new_v)
        # Whole blocks gathered in table order: position p of a row is index p of its keys
        # (a view as [b, h, n * block, d], no second copy).
        blocks = self.block_tables.reshape(-1)
        length = self.block_tables.shape[1] * self.block_size
        keys = pool_k.index_select(0, blocks).view(b, length, h, d).transpose(1, 2)
        values = pool_v.index_select(0, blocks).view(b, length, h, dv).transpose(1, 2)
        return keys, values

    def attention_mask(
        self,
        attention_mask: torch.Tensor | None,
        *,
        batch_size: int,
        q_len: int,
        sliding_window: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``[b, 1, s, n * block_size]`` bool: a query sees the keys at its position or before
        (within ``sliding_window`` when set). Rows are never padded inside a paged cache, so
        ``attention_mask`` must be None."""
        if attention_mask is not None:
            raise ValueError("a PagedKVCache forward takes no attention_mask (rows are unpadded)")
        assert self.positions is not None and self.block_tables is not None
        keys = torch.arange(
            self.block_tables.shape[1] * self.block_size, device=self.positions.device
        )
        q = self.positions[:, :, None]
        mask = keys <= q
        if sliding_window is not None:
            mask &= keys > q - sliding_window
        return mask[:, None]

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: every forward binds its own positions."""

    def __repr__(self) -> str:
        _, bs, h, d = self.k[0].shape if self.k else (0, self.block_size, 0, 0)
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{bs}, kv_heads={h}, "
            f"head_dim={d}, dtype={self.k[0].dtype if self.k else None})"
        )
