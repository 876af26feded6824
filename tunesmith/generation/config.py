"""How completions are sampled: the settings every decode uses, whatever the engine.

:class:`GenerationConfig` is the ``generation:`` section of an RL config, and what every other
decode of the library (held-out rewards, in-training samples, ``tunesmith generate``/``chat``,
lm-eval, the demos) builds; each hands it to a
:class:`~tunesmith.generation.engine.RolloutEngine` through
:func:`~tunesmith.generation.engine.generate_with`. ``temperature=0`` is greedy decoding (RL
configs refuse it where they are read: a policy gradient needs samples).

Example::

    >>> GenerationConfig(max_new_tokens=8, top_p=0.9).temperature
    1.0
    >>> GenerationConfig(temperature=0.0).temperature  # greedy
    0.0
    >>> GenerationConfig(temperature=-1.0)
    Traceback (most recent call last):
    ValueError: temperature must be >= 0 (0 is greedy), got -1.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["EngineSettings", "GenerationConfig"]


@dataclass(frozen=True)
class EngineSettings:
    """How the project's own engine decodes (``generation.engine`` in a config).

    ``paged`` (the default) is the rollout engine of :mod:`tunesmith.generation.paged`: a paged
    KV cache, prompts shared by the rows that repeat them (``share_prefixes``: a GRPO group's
    prompt is prefilled once), and continuous batching over at most ``max_slots`` rows at a time
    (None: every row at once) within ``kv_cache_mib`` MiB of cache (None: as much as the rows
    need); ``block_size`` positions per cache block. ``compile`` compiles the decode step
    (``torch.compile``; CUDA graphs on CUDA), once per bucketed batch shape, kept for the
    engine's life. ``paged: false`` is the plain engine (one padded batch decoded to its
    longest row), the reference the paged one is tested against.

    >>> EngineSettings(max_slots=32).block_size
    16
    >>> EngineSettings(block_size=0)
    Traceback (most recent call last):
    ValueError: engine.block_size must be an int >= 1, got 0
    """

    paged: bool = True
    max_slots: int | None = None
    kv_cache_mib: float | None = None
    block_size: int = 16
    share_prefixes: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_slots", 1), ("block_size", 1)):
            value = getattr(self, name)
            if value is None and name == "max_slots":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"engine.{name} must be an int >= {low}, got {value!r}")
        mib = self.kv_cache_mib
        if mib is not None and (
            isinstance(mib, bool) or not isinstance(mib, int | float) or not mib > 0
        ):
            raise ValueError(f"engine.kv_cache_mib must be a number > 0, got {mib!r}")
        for name in ("paged", "share_prefixes", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"engine.{name} must be true or false, got {getattr(self, name)!r}"
                )

    @classmethod
    def of(cls, value: EngineSettings | Mapping[str, Any] | None) -> EngineSettings:
        """Settings from a config mapping (unknown keys named), or as given.

        >>> EngineSettings.of({"max_slots": 8}).max_slots
        8
        >>> EngineSettings.of({"slots": 8})
        Traceback (most recent call last):
        ValueError: engine.slots: not a setting (paged, max_slots, kv_cache_mib, block_size, share_prefixes, compile)
        """
        if value is None:
            return cls()
        if isinstance(value, EngineSettings):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"engine must be a mapping of settings, got {value!r}")
        names = [f.name for f in fields(cls)]
        for key in value:
            if key not in names:
                raise ValueError(f"engine.{key}: not a setting ({', '.join(names)})")
        return cls(**dict(value))


@dataclass
class GenerationConfig:
    """How completions are sampled (the ``generation:`` section of an RL config).

    ``temperature`` 0 is greedy, > 0 samples (then ``top_p``/``top_k``/``min_p`` filter).
    ``stop_strings`` end a completion after the token that completes one; ``stop_tokens``
    (token strings such as ``"<|im_end|>"``) and the tokenizer's stop ids (its end of
    sequence and the end-of-turn tokens it has, as ``generate`` and ``chat`` stop at) end it
    at that token. ``engine``: how the project's own engine decodes
    (:class:`EngineSettings`; a mapping in a config).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_strings: Sequence[str] = ()
    stop_tokens: Sequence[str] = ()
    engine: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        self.engine = EngineSettings.of(self.engine)
