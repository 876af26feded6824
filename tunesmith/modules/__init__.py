"""Building blocks of decoder-only LMs: plain PyTorch modules with Hugging Face names.

This layer knows nothing of model families or training; ``tunesmith.models``
assembles these pieces from a ``ModelSpec``.
"""

from tunesmith.modules.attention import Attention
from tunesmith.modules.decoder import DecoderLayer, DecoderModel, TransformerLM
from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.masks import (
    build_attention_mask,
    causal_mask,
    document_causal_mask,
    document_position_ids,
    document_spans,
    padding_position_ids,
)
from tunesmith.modules.moe import MoE, load_balancing_loss
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.rope import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

__all__ = [
    "Attention",
    "DecoderLayer",
    "DecoderModel",
    "FeedForward",
    "KVCache",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerLM",
    "apply_rotary",
    "build_attention_mask",
    "causal_mask",
    "document_causal_mask",
    "document_spans",
    "document_position_ids",
    "load_balancing_loss",
    "padding_position_ids",
    "rope_inv_freq",
    "rotate_half",
]
