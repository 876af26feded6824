"""Decoder layer, decoder stack and causal LM, with Hugging Face parameter names.

``TransformerLM.state_dict()`` has exactly the keys of a transformers checkpoint
(``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ...,
``lm_head.weight``), so HF weights load with no key map and ours save back as is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunesmith.modules.attention import Attention
from tunesmith.modules.attention_backends import AttentionBatch, resolve_attention_backend
from tunesmith.modules.chunked import chunked_batch
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.masks import build_attention_mask, document_causal_mask
from tunesmith.modules.moe import GroupedExperts
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.paged_cache import PagedKVCache
from tunesmith.modules.ring_attention import RingShard, ring_batch
from tunesmith.modules.rope import RotaryEmbedding
from tunesmith.modules.routers import DeepSeekGate

__all__ = [
    "NORM_LAYOUTS",
    "DecoderLayer",
    "DecoderModel",
    "NormLayout",
    "TransformerLM",
    "decoder_layers",
    "mark_decoder_layers",
]


@dataclass(frozen=True)
class NormLayout:
    """The names of a layer's RMSNorms around its two blocks; None where a layout has none.

    ``h = x + attn_out(attn(attn_in(x)))``, ``out = h + mlp_out(mlp(mlp_in(h)))``. The names
    are the Hugging Face ones, so the state dict needs no key map.
    """

    attn_in: str | None
    attn_out: str | None
    mlp_in: str | None
    mlp_out: str | None

    def names(self) -> tuple[str, ...]:
        """The norms this layout has, in order."""
        return tuple(n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n)


NORM_LAYOUTS: dict[str, NormLayout] = {
    # Llama, Qwen, Mistral, Granite, SmolLM3: a norm before each block.
    "pre": NormLayout("input_layernorm", None, "post_attention_layernorm", None),
    # Gemma 2/3: norms before and after each block ("sandwich").
    "sandwich": NormLayout(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    # GLM-4: the same four norms under other names.
    "sandwich_glm": NormLayout(
        "input_layernorm",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "post_mlp_layernorm",
    ),
    # OLMo 2/3: a norm after each block only.
    "post": NormLayout(None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}
"""Norm placements by name (a spec's ``norm_layout``)."""


class DecoderLayer(nn.Module):
    """One block: attention then MLP, each added to the residual stream, with the norms of
    ``norm_layout`` (:data:`NORM_LAYOUTS`; default pre-norm:
    ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``).

    ``mlp`` is a :class:`~tunesmith.modules.feed_forward.FeedForward` or a
    :class:`~tunesmith.modules.moe.MoE` (which also returns router logits). Each block's output
    is multiplied by ``residual_multiplier`` before it is added (Granite). ``sliding_window``
    makes it a ``"sliding_attention"`` layer (its queries see only the last ``sliding_window``
    keys), else ``"full_attention"``. ``forward`` returns ``(hidden, router_logits or None)``.

    Example::

        >>> from tunesmith.modules.feed_forward import FeedForward
        >>> from tunesmith.modules.rope import RotaryEmbedding
        >>> layer = DecoderLayer(Attention(32, 4, 2, 8), FeedForward(32, 64), 32)
        >>> cos, sin = RotaryEmbedding(8)(torch.arange(5)[None])
        >>> layer(torch.randn(1, 5, 32), cos, sin)[0].shape
        torch.Size([1, 5, 32])
        >>> DecoderLayer(Attention(32, 4, 2, 8), FeedForward(32, 64), 32,
        ...              norm_layout="post").norm_names
        ('post_attention_layernorm', 'post_feedforward_layernorm')
    """

    is_decoder_layer = True  # what decoder_layers() finds (other models' layers are marked)

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        hidden_size: int,
        norm_eps: float = 1e-6,
        *,
        norm_layout: str = "pre",
        norm_style: str = "plain",
        residual_multiplier: float = 1.0,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if norm_layout not in NORM_LAYOUTS:
            raise ValueError(
                f"norm_layout must be one of {list(NORM_LAYOUTS)}, got {norm_layout!r}"
            )
        self.self_attn = self_attn
        self.mlp = mlp
        self.layout = NORM_LAYOUTS[norm_layout]
        self.norm_names = self.layout.names()
        for name in self.norm_names:
            self.add_module(name, RMSNorm(hidden_size, eps=norm_eps, style=norm_style))
        self.residual_multiplier = residual_multiplier
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size

    @property
    def attention_type(self) -> str:
        """``"sliding_attention"``, ``"chunked_attention"`` (queries see only their own chunk of
        ``attention_chunk_size`` positions: Llama 4) or ``"full_attention"`` (HF's names)."""
        if self.attention_chunk_size is not None:
            return "chunked_attention"
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else getattr(self, name)(x)

    def _add(self, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return residual + out

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | PagedKVCache | None = None,
        layer_idx: int = 0,
        spans: list[list[tuple[int, int]]] | None = None,
        batch: AttentionBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layout = self.layout
        attn = self.self_attn(
            self._norm(layout.attn_in, x),
            cos,
            sin,
            mask=mask,
            kv_cache=kv_cache,
            layer_idx=layer_idx,
            spans=spans,
            batch=batch,
        )
        h = self._add(x, self._norm(layout.attn_out, attn))
        out = self.mlp(self._norm(layout.mlp_in, h))
        router_logits = None
        if isinstance(out, tuple):
            out, router_logits = out
        return self._add(h, self._norm(layout.mlp_out, out)), router_logits


def mark_decoder_layers(layers: Iterable[nn.Module]) -> None:
    """Mark another model's layers (transformers' own) as decoder layers: the units that
    activation checkpointing, compile and FSDP2 work on (:func:`decoder_layers`)."""
    for layer in layers:
        layer.is_decoder_layer = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer inside ``model``, in order: :class:`DecoderLayer` modules and the
    layers :func:`mark_decoder_layers` marked.

    >>> from tunesmith.models import llama3
    >>> len(decoder_layers(llama3.llama3_tiny()))
    2
    """
    return [m for m in model.modules() if getattr(m, "is_decoder_layer", False)]


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``LlamaModel``, ``Qwen3Model``, ...).

    ``forward`` returns the final normed hidden states ``[b, s, hidden]``, plus a
    tuple of per-MoE-layer router logits when ``output_router_logits=True``.
    Arguments are those of :meth:`TransformerLM.forward`.

    ``attention_backend`` (``auto``, ``sdpa``, ``varlen``, ``flex``, ``loop``; settable) picks
    the :mod:`~tunesmith.modules.attention_backends` backend for each forward through
    :func:`~tunesmith.modules.attention_backends.resolve_attention_backend`: ``auto`` is
    ``varlen`` for packed rows (``flex`` on CUDA), ``sdpa`` otherwise; a KV cache is ``sdpa``.

    Each layer's own ``sliding_window`` decides what it attends to (one mask is built per
    distinct window, once per forward). ``rotary_emb_local``, when given, rotates the sliding
    layers (Gemma 3: a lower RoPE base for local layers), ``rotary_emb`` the others.
    ``embedding_multiplier`` scales the embeddings, as a scalar of their dtype (Gemma:
    ``sqrt(hidden_size)``; Granite: its ``embedding_multiplier``).
    """

    def __init__(
        self,
        embed_tokens: nn.Embedding,
        layers: Iterable[DecoderLayer],
        norm: RMSNorm,
        rotary_emb: RotaryEmbedding,
        *,
        rotary_emb_local: RotaryEmbedding | None = None,
        embedding_multiplier: float = 1.0,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.rotary_emb_local = rotary_emb_local
        self.embedding_multiplier = embedding_multiplier
        self.attention_backend = attention_backend

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (None = full attention), in layer order."""
        return tuple(dict.fromkeys(layer.sliding_window for layer in self.layers))

    @property
    def attention_kinds(self) -> tuple[tuple[int | None, int | None], ...]:
        """The distinct ``(sliding_window, attention_chunk_size)`` of the layers, in order."""
        return tuple(
            dict.fromkeys(
                (layer.sliding_window, layer.attention_chunk_size) for layer in self.layers
            )
        )

    @property
    def attention_backend(self) -> str:
        """The backend knob (``auto`` or a name in ``ATTENTION_BACKENDS``)."""
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        resolve_attention_backend(name, device="cpu", packed=False, cached=False)  # validates
        self._attention_backend = name

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | PagedKVCache | None = None,
        output_router_logits: bool = False,
        cp_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        b, s = input_ids.shape
        if kv_cache is not None and kv_cache.num_layers != len(self.layers):
            raise ValueError(
                f"kv_cache has {kv_cache.num_layers} layers, the model {len(self.layers)}"
            )
        if position_ids is None:
            position_ids = (
                torch.arange(s, device=input_ids.device)[None]
                if kv_cache is None
                else kv_cache.next_positions(s, device=input_ids.device)
            )
        elif position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.shape[-1] != s or position_ids.shape[0] not in (1, b):
            raise ValueError(
                f"position_ids must be [batch, seq] = {[b, s]} (or [1, seq]), "
                f"got {list(position_ids.shape)}"
            )
        if document_ids is not None and cp_index is None:
            if attention_mask is not None or kv_cache is not None:
                raise ValueError("document_ids (packed rows) takes no attention_mask or kv_cache")
            if document_ids.shape != input_ids.shape:
                raise ValueError(
                    f"document_ids must be shaped like input_ids {list(input_ids.shape)}, "
                    f"got {list(document_ids.shape)}"
                )
            attention_mask = document_causal_mask(document_ids)
        backend = resolve_attention_backend(
            self.attention_backend,
            device=input_ids.device,
            packed=document_ids is not None,
            cached=kv_cache is not None,
        )
        # One mask and batch per distinct (window, chunk), built once for every layer with it.
        batches: dict[tuple[int | None, int | None], tuple[torch.Tensor | None, AttentionBatch]]
        batches = {}
        for window, chunk in self.attention_kinds:
            shape = {"batch_size": b, "q_len": s, "sliding_window": window}
            if kv_cache is None:
                mask = build_attention_mask(
                    attention_mask, kv_len=s, device=input_ids.device, **shape
                )
            else:  # the cache knows where the cached keys sit
                mask = kv_cache.attention_mask(attention_mask, device=input_ids.device, **shape)
            batch = AttentionBatch(
                backend, mask=mask, document_ids=document_ids, sliding_window=window
            )
            if cp_index is not None:  # context parallel: rows split over a ring of ranks
                shard = RingShard(getattr(self, "context_parallel_group", None), cp_index)
                mask, batch = None, ring_batch(shard, document_ids=document_ids,
                                               sliding_window=window)  # fmt: skip
            if chunk is not None:  # Llama 4: finer documents, the mask cut at chunk edges
                mask, batch = chunked_batch(
                    mask, batch, chunk_size=chunk, position_ids=position_ids,
                    attention_mask=attention_mask,
                    cached_len=None if kv_cache is None else getattr(kv_cache, "seq_len", 0),
                )  # fmt: skip
            batch.position_ids = position_ids
            if not torch.compiler.is_compiling():
                batch.prepare()  # index tensors / block masks, once for every layer
            batches[(window, chunk)] = (mask, batch)
        h = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * torch.tensor(self.embedding_multiplier, dtype=h.dtype)
        rope = {None: self.rotary_emb(position_ids, dtype=h.dtype)}
        if self.rotary_emb_local is not None:
            rope["local"] = self.rotary_emb_local(position_ids, dtype=h.dtype)
        router_logits = []
        for i, layer in enumerate(self.layers):
            mask, batch = batches[(layer.sliding_window, layer.attention_chunk_size)]
            local = layer.sliding_window is not None and self.rotary_emb_local is not None
            cos, sin = rope["local" if local else None]
            h, layer_router_logits = layer(
                h, cos, sin, mask=mask, kv_cache=kv_cache, layer_idx=i, batch=batch
            )
            if layer_router_logits is not None:
                router_logits.append(layer_router_logits)
        if kv_cache is not None:
            kv_cache.advance(s)
        h = self.norm(h)
        return (h, tuple(router_logits)) if output_router_logits else h


def _drop_tied_head(
    module: TransformerLM, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: a tied ``lm_head.weight`` is not saved (as in transformers)."""
    if module.tie_word_embeddings:
        state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(
    module: TransformerLM, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """load_state_dict pre-hook: a tied head takes the embedding's values, present or not."""
    embed_key = prefix + "model.embed_tokens.weight"
    if module.tie_word_embeddings and embed_key in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict[embed_key]


def _after_load(module: TransformerLM, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: re-tie (``assign=True`` replaces parameters) and build
    RoPE buffers if the weights just arrived on a meta-built model."""
    module.tie_weights()
    if module.model.rotary_emb.inv_freq.is_meta and not module.model.embed_tokens.weight.is_meta:
        module.init_buffers()


class TransformerLM(nn.Module):
    """Causal language model: :class:`DecoderModel` (``.model``) plus ``.lm_head``.

    With ``tie_word_embeddings`` the head *is* the embedding matrix
    (``lm_head.weight is model.embed_tokens.weight``). The tie survives ``.to()``,
    ``to_empty()`` and ``load_state_dict(..., assign=True)``; ``state_dict()`` then
    omits ``lm_head.weight`` and loading accepts dicts with or without it (the
    embedding wins), matching what transformers saves and loads.

    ``spec`` is the :class:`~tunesmith.models.ModelSpec` the model was built from
    (set by the builder; any object, since this layer does not know models).

    ``logit_transform`` (a :class:`~tunesmith.modules.logits.LogitTransform`, or None) is what
    the family does to ``lm_head``'s output (Granite's scaling, Gemma 2's soft-cap): applied
    here to the logits, and by every chunked loss to its chunks (they read it through
    :func:`~tunesmith.training.forward.head_transform`).

    Example::

        >>> from tunesmith.models import llama3
        >>> model = llama3.llama3_tiny()          # built by tunesmith.models.build_model
        >>> model(torch.randint(0, 256, (2, 7))).shape
        torch.Size([2, 7, 256])
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        logit_transform: LogitTransform | None = None,
        spec: Any = None,
    ) -> None:
        super().__init__()
        vocab_size, hidden_size = model.embed_tokens.weight.shape
        self.logit_transform = LogitTransform.of(logit_transform)
        self.model = model
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        self.initializer_range = initializer_range
        self.spec = spec
        self.tie_weights()
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_pre_hook(_fill_tied_head)
        self.register_load_state_dict_post_hook(_after_load)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | PagedKVCache | None = None,
        output_router_logits: bool = False,
        return_hidden_states: bool = False,
        logits_to_keep: int = 0,
        cp_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Logits ``[b, s, vocab]`` for ``input_ids`` ``[b, s]``.

        Args:
            position_ids: ``[b, s]`` or ``[1, s]``; default ``arange(cached, cached + s)``.
            attention_mask: None (causal over cached + new tokens); a 2-D
                ``[b, cached + s]`` 0/1 padding mask, combined with causal; or an
                explicit 4-D bool ``[b, 1, s, cached + s]`` mask (True = may attend),
                e.g. :func:`~tunesmith.modules.masks.document_causal_mask` for packing.
            document_ids: ``[b, s]`` packed rows (equal ids = one document, negative =
                padding): each document attends causally to itself only, by the model's
                ``attention_backend`` (``varlen`` by default on CPU: no ``[s, s]`` work across
                documents); instead of ``attention_mask``.
            kv_cache: a :class:`KVCache` from :meth:`init_kv_cache`; new keys/values
                are appended and its ``seq_len`` advances by ``s``.
            output_router_logits: also return the tuple of per-MoE-layer router
                logits ``[b * s, num_experts]`` (for the load-balancing loss).
            return_hidden_states: return the final normed hidden states ``[b, s, hidden]``
                instead of logits, for a loss that owns the output projection
                (:class:`~tunesmith.modules.losses.LinearCrossEntropyLoss`). Going through
                this root forward (not ``.model``) keeps FSDP2's hooks in play.
            logits_to_keep: when > 0, project only the last ``logits_to_keep`` positions
                (``[b, logits_to_keep, vocab]``): a prefill that needs only the next token's
                logits never builds ``[b, s, vocab]``. 0 keeps every position.
            cp_index: context parallel (``[b, s]``): the rows are split over the ranks of
                ``model.context_parallel_group`` (see
                :func:`~tunesmith.training.parallel.context_parallel.shard_batch`), these are this
                rank's positions and ``cp_index`` their indices in the full rows; attention is
                :func:`~tunesmith.modules.ring_attention.ring_attention` (causal by index,
                within ``document_ids``).
        """
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        out = self.model(
            input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            document_ids=document_ids,
            kv_cache=kv_cache,
            output_router_logits=output_router_logits,
            cp_index=cp_index,
        )
        if return_hidden_states:
            head = lambda h: h  # noqa: E731
        elif logits_to_keep:
            head = lambda h: self._logits(h[:, -logits_to_keep:])  # noqa: E731
        else:
            head = self._logits
        if output_router_logits:
            hidden, router_logits = out
            return head(hidden), router_logits
        return head(out)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logit_transform is None else self.logit_transform(logits)

    def _cache_sizes(self, dtype: torch.dtype | None, device: Any) -> dict[str, Any]:
        """What every cache of this model is sized by (default: the weights' dtype/device)."""
        attn = self.model.layers[0].self_attn
        weight = self.model.embed_tokens.weight
        return {
            "num_layers": len(self.model.layers),
            "num_kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim,
            # values of another width: multi-head latent attention caches its latent
            "value_dim": getattr(attn, "cache_value_dim", None),
            "dtype": weight.dtype if dtype is None else dtype,
            "device": weight.device if device is None else device,
        }

    def init_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty :class:`KVCache` sized for this model (default: the weights' dtype/device)."""
        sizes = self._cache_sizes(dtype, device)
        return KVCache(batch_size=batch_size, max_seq_len=max_seq_len, **sizes)

    def init_paged_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """An empty :class:`~tunesmith.modules.paged_cache.PagedKVCache` of ``num_blocks``
        blocks for this model (default: the weights' dtype/device)."""
        sizes = self._cache_sizes(dtype, device)
        return PagedKVCache(num_blocks=num_blocks, block_size=block_size, **sizes)

    # -- weights -----------------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding parameter itself (no-op when untied)."""
        if self.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Initialise like transformers: linears and embeddings ~ N(0, std), biases 0,
        norms 1; then recompute RoPE buffers. ``std`` defaults to ``initializer_range``.

        Typical use after a meta-device build: ``model.to_empty(device=d); model.init_weights()``.
        """
        std = self.initializer_range if std is None else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (GroupedExperts, DeepSeekGate)):
                module.init_weights(std)
            if isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, mean=0.0, std=std)  # gpt-oss, as transformers
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute non-persistent buffers (RoPE ``inv_freq``) on ``device``
        (default: the embedding's device). Needed after materialising a meta model
        by assignment; ``to_empty()`` and ``.to()`` already do it."""
        device = self.model.embed_tokens.weight.device if device is None else device
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters(device)

    def _apply(self, fn: Any, recurse: bool = True) -> TransformerLM:
        # .to()/.cuda()/to_empty() may replace parameters one module at a time; re-tie after.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self
