"""KV cache blocks kept across engine calls, found again by the tokens they hold.

A multi-turn rollout calls the engine once per turn, and each turn's prompt is the last one
plus the reply just sampled plus the environment's answer. A :class:`PrefixCache` keeps the
paged pool of :mod:`~tunesmith.generation.paged` alive between those calls, with a trie of its
**full** blocks: a node per block, its key the block's tokens, its path from the root the
tokens before them. A later prompt walks the trie with its own tokens; the blocks it finds
hold exactly its first positions (the same tokens at the same positions, under the same
weights), so only the rest is prefilled: each turn continues its conversation's KV cache.

* A prompt's full blocks enter the trie once prefilled; a finished row's full blocks (its
  prompt, its sampled tokens but the last, which is never fed) enter it when the row ends.
  A block whose key is already there stays the row's own and is freed as before.
* A node is *pinned* while a prompt of the running call uses it; every pinned node's
  ancestors are pinned too. Unpinned nodes are evicted, least recently used leaf first, when
  the pool runs short; the pool grows instead when the engine has no ``kv_cache_mib`` budget.
* Nothing survives the engine's :meth:`~tunesmith.generation.engine.LocalEngine.keep_prefixes`
  block, and new weights (``load_weights``) drop everything: cached keys belong to the
  weights that wrote them.

Example::

    >>> cache = PrefixCache(block_size=2)
    >>> cache.adopt([5, 6, 7, 8, 9], [3, 4], first=0)  # blocks 3, 4 hold tokens 5 6 | 7 8
    [3, 4]
    >>> [n.block for n in cache.match([5, 6, 7, 8, 1, 2], most=2)]
    [3, 4]
    >>> [n.block for n in cache.match([5, 6, 0, 0], most=2)]
    [3]
    >>> cache.evict(2)  # nothing pinned: the leaf first, then its parent
    [4, 3]
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PrefixCache"]


@dataclass(eq=False)
class _Node:
    """One kept block: ``key`` its tokens, ``block`` the pool block holding their keys."""

    key: tuple[int, ...]
    block: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    pins: int = 0
    used: int = 0  # the clock at its last match or insertion (eviction order)


class PrefixCache:
    """The trie of kept full blocks and the pool (``cache``, ``pool``) they live in; see the
    module docs. The engine owns one per :meth:`LocalEngine.keep_prefixes` block.

    Args:
        block_size: positions per cache block (the engine's ``block_size``).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = _Node((), 0, None)
        self.cache: Any = None  # the PagedKVCache kept between calls (made by the engine)
        self.pool: Any = None  # its free list (paged._BlockPool)
        self.kept = 0  # blocks held by the trie
        self._unpinned = 0
        self._clock = itertools.count(1)

    def _keys(self, ids: Sequence[int], blocks: int) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(ids[i * bs : (i + 1) * bs]) for i in range(blocks)]

    def match(self, ids: Sequence[int], most: int) -> list[_Node]:
        """The kept nodes of ``ids``' first full blocks (at most ``most``), in order."""
        nodes, node, now = [], self.root, next(self._clock)
        for key in self._keys(ids, min(most, len(ids) // self.block_size)):
            node = node.children.get(key)
            if node is None:
                break
            node.used = now
            nodes.append(node)
        return nodes

    def pin(self, nodes: Sequence[_Node]) -> None:
        for node in nodes:
            self._unpinned -= node.pins == 0
            node.pins += 1

    def unpin(self, nodes: Sequence[_Node]) -> None:
        for node in nodes:
            node.pins -= 1
            self._unpinned += node.pins == 0

    @property
    def evictable(self) -> int:
        """Kept blocks no running prompt uses (each can be evicted)."""
        return self._unpinned

    def adopt(self, ids: Sequence[int], table: Sequence[int], first: int) -> list[int]:
        """Keep the full blocks of ``ids`` (written in ``table``'s blocks) from block
        ``first`` on: the blocks of ``table`` now owned by the trie (unpinned), in order.
        A block whose tokens are kept already stays the caller's; the path before ``first``
        must be kept (the caller's prompt), or nothing is adopted."""
        adopted, node, now = [], self.root, next(self._clock)
        for i, key in enumerate(self._keys(ids, min(len(ids) // self.block_size, len(table)))):
            child = node.children.get(key)
            if child is None:
                if i < first:
                    break  # the caller's prefix is not kept: no path to hang its blocks on
                child = node.children[key] = _Node(key, table[i], node)
                adopted.append(table[i])
                self.kept += 1
                self._unpinned += 1
            child.used = now
            node = child
        return adopted

    def register(
        self, ids: Sequence[int], blocks: Sequence[int], matched: int
    ) -> tuple[list[_Node], list[int]]:
        """Keep a just-prefilled prompt's full blocks past its ``matched`` (pinned) ones
        (``blocks``: its block table) and pin their nodes for it: those nodes, and the blocks
        the trie adopted (the others, whose tokens were kept already, stay the prompt's)."""
        adopted = self.adopt(ids, blocks, first=matched)
        nodes = self.match(ids, len(ids) // self.block_size)[matched:]
        self.pin(nodes)
        return nodes, adopted

    def evict(self, count: int) -> list[int]:
        """Free up to ``count`` unpinned blocks, least recently used leaves first; their
        block ids."""
        leaves = [(n.used, id(n), n) for n in self._nodes() if not n.children and n.pins == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < count:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            freed.append(node.block)
            self.kept -= 1
            self._unpinned -= 1
            if parent is not self.root and not parent.children and parent.pins == 0:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        return freed

    def _nodes(self) -> list[_Node]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
