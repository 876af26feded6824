"""Tensor names a family's checkpoint files spell differently from the modules in memory.

tunesmith's modules carry the names transformers gives them in memory (``mlp.gate``,
``mlp.experts.{i}.gate_proj``), which for most families are also the names on disk. Mixtral's
files keep the original release's names (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{i}.w1``), which transformers renames while loading and back while
saving. A family declares such names once (``Family.renames``: our piece -> the file's piece,
``{i}`` standing for an index), and the checkpoint code renames on load and on save
(:class:`KeyRenames`); PEFT folders keep the in-memory names, as peft does.

Example::

    >>> renames = KeyRenames({".mlp.experts.{i}.gate_proj.": ".block_sparse_moe.experts.{i}.w1."})
    >>> renames.to_disk("model.layers.0.mlp.experts.3.gate_proj.weight")
    'model.layers.0.block_sparse_moe.experts.3.w1.weight'
    >>> renames.from_disk("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    'model.layers.0.mlp.experts.3.gate_proj.weight'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["KeyRenames"]

_INDEX = "{i}"


def _pattern(piece: str) -> re.Pattern[str]:
    """A piece with ``{i}`` placeholders as a regex capturing each index in order."""
    return re.compile(r"(\d+)".join(re.escape(part) for part in piece.split(_INDEX)))


def _template(piece: str) -> str:
    """A piece with ``{i}`` placeholders as a replacement string for :func:`_pattern`."""
    parts = piece.split(_INDEX)
    out = parts[0].replace("\\", "\\\\")
    for n, part in enumerate(parts[1:], start=1):
        out += f"\\g<{n}>" + part.replace("\\", "\\\\")
    return out


class KeyRenames:
    """Two-way renaming of state-dict keys by pieces (``{i}``: any index, kept as is).

    Each key is renamed by the first piece it contains; a key with none passes unchanged.

    Example::

        >>> renames = KeyRenames({".mlp.gate.": ".block_sparse_moe.gate."})
        >>> renames.to_disk("model.layers.1.mlp.gate.weight")
        'model.layers.1.block_sparse_moe.gate.weight'
        >>> renames.from_disk("model.norm.weight")
        'model.norm.weight'
    """

    def __init__(self, ours_to_disk: Mapping[str, str]) -> None:
        for ours, disk in ours_to_disk.items():
            if ours.count(_INDEX) != disk.count(_INDEX):
                raise ValueError(f"rename {ours!r} -> {disk!r}: the two name different indices")
        self.ours_to_disk = dict(ours_to_disk)
        self._to_disk = [(_pattern(o), _template(d)) for o, d in ours_to_disk.items()]
        self._from_disk = [(_pattern(d), _template(o)) for o, d in ours_to_disk.items()]

    def __bool__(self) -> bool:
        return bool(self.ours_to_disk)

    @staticmethod
    def _apply(rules: list[tuple[re.Pattern[str], str]], name: str) -> str:
        for pattern, template in rules:
            renamed, n = pattern.subn(template, name, count=1)
            if n:
                return renamed
        return name

    def to_disk(self, name: str) -> str:
        """Our state-dict name -> the name in the family's files."""
        return self._apply(self._to_disk, name)

    def from_disk(self, name: str) -> str:
        """A name in the family's files -> our state-dict name."""
        return self._apply(self._from_disk, name)

    def state_to_disk(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with every key renamed as the files spell it (order kept)."""
        return {self.to_disk(key): value for key, value in state.items()}
