"""tunesmith: PyTorch-native post-training for open-weight LLMs."""

__version__ = "0.1.0"
