"""Decoder layer, decoder stack and causal LM, with Hugging Face parameter names.

``TransformerLM.state_dict()`` has exactly the keys of a transformers checkpoint
(``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ...,
``lm_head.weight``), so HF weights load with no key map and ours save back as is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tunesmith.modules.attention import Attention
from tunesmith.modules.attention_backends import AttentionBatch, resolve_attention_backend
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.masks import build_attention_mask, document_causal_mask
from tunesmith.modules.moe import GroupedExperts
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.ring_attention import RingShard, ring_batch
from tunesmith.modules.rope import RotaryEmbedding

__all__ = ["DecoderLayer", "DecoderModel", "TransformerLM"]


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``.

    ``mlp`` is a :class:`~tunesmith.modules.feed_forward.FeedForward` or a
    :class:`~tunesmith.modules.moe.MoE` (which also returns router logits).
    ``forward`` returns ``(hidden, router_logits or None)``.

    Example::

        >>> from tunesmith.modules.feed_forward import FeedForward
        >>> from tunesmith.modules.rope import RotaryEmbedding
        >>> layer = DecoderLayer(Attention(32, 4, 2, 8), FeedForward(32, 64), 32)
        >>> cos, sin = RotaryEmbedding(8)(torch.arange(5)[None])
        >>> layer(torch.randn(1, 5, 32), cos, sin)[0].shape
        torch.Size([1, 5, 32])
    """

    def __init__(
        self, self_attn: Attention, mlp: nn.Module, hidden_size: int, norm_eps: float = 1e-6
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps=norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        spans: list[list[tuple[int, int]]] | None = None,
        batch: AttentionBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x + self.self_attn(
            self.input_layernorm(x),
            cos,
            sin,
            mask=mask,
            kv_cache=kv_cache,
            layer_idx=layer_idx,
            spans=spans,
            batch=batch,
        )
        out = self.mlp(self.post_attention_layernorm(h))
        router_logits = None
        if isinstance(out, tuple):
            out, router_logits = out
        return h + out, router_logits


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``LlamaModel``, ``Qwen3Model``, ...).

    ``forward`` returns the final normed hidden states ``[b, s, hidden]``, plus a
    tuple of per-MoE-layer router logits when ``output_router_logits=True``.
    Arguments are those of :meth:`TransformerLM.forward`.

    ``attention_backend`` (``auto``, ``sdpa``, ``varlen``, ``flex``, ``loop``; settable) picks
    the :mod:`~tunesmith.modules.attention_backends` backend for each forward through
    :func:`~tunesmith.modules.attention_backends.resolve_attention_backend`: ``auto`` is
    ``varlen`` for packed rows (``flex`` on CUDA), ``sdpa`` otherwise; a KV cache is ``sdpa``.
    """

    def __init__(
        self,
        embed_tokens: nn.Embedding,
        layers: Iterable[DecoderLayer],
        norm: RMSNorm,
        rotary_emb: RotaryEmbedding,
        *,
        sliding_window: int | None = None,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.sliding_window = sliding_window
        self.attention_backend = attention_backend

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
        kv_cache: KVCache | None = None,
        output_router_logits: bool = False,
        cp_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        b, s = input_ids.shape
        cache_len = 0
        if kv_cache is not None:
            if kv_cache.num_layers != len(self.layers):
                raise ValueError(
                    f"kv_cache has {kv_cache.num_layers} layers, the model {len(self.layers)}"
                )
            cache_len = kv_cache.seq_len
        if position_ids is None:
            position_ids = torch.arange(cache_len, cache_len + s, device=input_ids.device)[None]
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
        mask = build_attention_mask(
            attention_mask,
            batch_size=b,
            q_len=s,
            kv_len=cache_len + s,
            sliding_window=self.sliding_window,
            device=input_ids.device,
        )
        backend = resolve_attention_backend(
            self.attention_backend,
            device=input_ids.device,
            packed=document_ids is not None,
            cached=kv_cache is not None,
        )
        batch = AttentionBatch(
            backend, mask=mask, document_ids=document_ids, sliding_window=self.sliding_window
        )
        if cp_index is not None:  # context parallel: rows split over a ring of ranks
            shard = RingShard(getattr(self, "context_parallel_group", None), cp_index)
            mask, batch = None, ring_batch(shard, document_ids=document_ids,
                                           sliding_window=self.sliding_window)  # fmt: skip
        if not torch.compiler.is_compiling():
            batch.prepare()  # index tensors / block masks, once for every layer
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, dtype=h.dtype)
        router_logits = []
        for i, layer in enumerate(self.layers):
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
        spec: Any = None,
    ) -> None:
        super().__init__()
        vocab_size, hidden_size = model.embed_tokens.weight.shape
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
        kv_cache: KVCache | None = None,
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
            head = lambda h: self.lm_head(h[:, -logits_to_keep:])  # noqa: E731
        else:
            head = self.lm_head
        if output_router_logits:
            hidden, router_logits = out
            return head(hidden), router_logits
        return head(out)

    def init_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty :class:`KVCache` sized for this model (default: the weights' dtype/device)."""
        attn = self.model.layers[0].self_attn
        weight = self.model.embed_tokens.weight
        return KVCache(
            num_layers=len(self.model.layers),
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
        )

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
            elif isinstance(module, GroupedExperts):
                module.init_weights(std)
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
