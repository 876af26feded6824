"""Token-level generation: batched KV-cache decoding and sampling."""

from tunesmith.generation.generate import (
    FinishReason,
    GenerationOutput,
    generate,
    left_pad,
)
from tunesmith.generation.sampling import (
    LogitsProcessor,
    MinP,
    SampleOutput,
    Temperature,
    TopK,
    TopP,
    apply_processors,
    build_processors,
    policy_logprobs,
    sample,
)

__all__ = [
    "FinishReason",
    "GenerationOutput",
    "LogitsProcessor",
    "MinP",
    "SampleOutput",
    "Temperature",
    "TopK",
    "TopP",
    "apply_processors",
    "build_processors",
    "generate",
    "left_pad",
    "policy_logprobs",
    "sample",
]
