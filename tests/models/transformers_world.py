"""HF folders of architectures tunesmith has no native family for: the transformers backend's
test world (a tiny random model of transformers' own class, the tests' tokenizer).

:data:`ARCHITECTURES` are three unlike ones: Cohere 2 (parallel attention and MLP blocks in one
layer norm, a logit scale, sliding and full attention layers), StarCoder 2 (biases, layer norms
with bias, a plain GELU MLP ``c_fc``/``c_proj``) and LFM2 (a hybrid: short-convolution layers
beside attention, so no packed rows).

Example::

    model_dir = make_transformers_model_dir(tmp_path / "cohere2", "cohere2")
    model = from_hf(model_dir)            # a TransformersLM
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data import Tokenizer
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.transformers_backend import build_transformers_model, tiny_config

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # sliding_window 4 < the rows' lengths: the sliding layers' masks differ from full ones
    "cohere2": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "starcoder2": {},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
}
"""model_type -> config overrides of :func:`tiny_config`."""

MIXTURE_OF_EXPERTS: dict[str, dict[str, Any]] = {
    # transformers 5 fuses its per-expert w1/w3 on load: checkpoints and the modules differ
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02},
}
"""model_type -> config overrides: a mixture of experts on the transformers backend."""


def make_transformers_model_dir(
    root: Path, model_type: str, seed: int = 0, **overrides: Any
) -> Path:
    """A HF folder (``root/model``) with a tiny random ``model_type`` model of transformers'
    own class (sizes of :func:`tiny_config`, :data:`ARCHITECTURES`' overrides, then
    ``overrides``), the vocabulary of the tests' tokenizer, whose files it holds."""
    tok_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5")
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    config = tiny_config(
        model_type,
        vocab_size=tokenizer.vocab_size,
        **{
            **ARCHITECTURES.get(model_type, {}),
            **MIXTURE_OF_EXPERTS.get(model_type, {}),
            **overrides,
        },
    )
    torch.manual_seed(seed)
    model = build_transformers_model(config)
    return save_hf_checkpoint(model, root / "model", source_dir=tok_dir)
