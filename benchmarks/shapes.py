"""The model shapes the #20 benchmarks share: the issue's 4-layer benchmark shape (tiny
Llama, vocab 32000, hidden 256) and the ~100M ladder shape, as HF ``config.json`` fields.

Example::

    >>> SHAPES["4-layer"]["num_hidden_layers"]
    4
"""

SHAPES = {
    "4-layer": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "100M": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
        "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "attention_bias": False,
    },
}  # fmt: skip
