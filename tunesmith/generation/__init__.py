"""Token-level generation: batched KV-cache decoding and sampling, and the rollout engines
(the project's own, and the optional vLLM adapter) an RL rollout worker decodes through."""

from tunesmith.generation.config import GenerationConfig
from tunesmith.generation.engine import LocalEngine, RolloutEngine, generate_with
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
from tunesmith.generation.vllm_engine import VLLMEngine

__all__ = [
    "FinishReason",
    "GenerationConfig",
    "GenerationOutput",
    "LocalEngine",
    "LogitsProcessor",
    "MinP",
    "RolloutEngine",
    "SampleOutput",
    "Temperature",
    "TopK",
    "TopP",
    "VLLMEngine",
    "apply_processors",
    "build_processors",
    "generate",
    "generate_with",
    "left_pad",
    "policy_logprobs",
    "sample",
]
