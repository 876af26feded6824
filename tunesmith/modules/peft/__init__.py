"""Parameter-efficient fine-tuning: LoRA, DoRA, and NF4-quantised frozen bases (QLoRA/QDoRA).

Adapters are chosen in the model config, not by a separate recipe::

    model:
      _component_: tunesmith.modules.peft.apply_lora
      model: {_component_: tunesmith.models.from_hf, path: Qwen3-0.6B, dtype: bf16}
      target_modules: [q_proj, k_proj, v_proj, o_proj]
      rank: 16
      alpha: 32
      use_dora: false
      quantize_base: false      # nf4 = QLoRA

PEFT-format adapter files (``adapter_config.json`` + ``adapter_model.safetensors``) are read
and written by :mod:`tunesmith.models.peft_io`.
"""

from tunesmith.modules.peft.apply import (
    ADAPTER_KEY_SUFFIXES,
    adapter_modules,
    adapter_state_dict,
    add_adapter,
    apply_lora,
    disable_adapters,
    find_expert_targets,
    find_linear_targets,
    init_adapters,
    is_adapter_key,
    mark_adapters_trainable,
    merge_adapters,
    peft_misread_modules,
    resolve_quantize_base,
    trainable_parameters,
)
from tunesmith.modules.peft.dora import DoRALinear
from tunesmith.modules.peft.lora import LoRALinear, lora_scaling
from tunesmith.modules.peft.nf4 import dequantize_nf4, is_nf4, linear_nf4, quantize_nf4

__all__ = [
    "ADAPTER_KEY_SUFFIXES",
    "DoRALinear",
    "LoRALinear",
    "adapter_modules",
    "adapter_state_dict",
    "add_adapter",
    "apply_lora",
    "dequantize_nf4",
    "disable_adapters",
    "find_expert_targets",
    "find_linear_targets",
    "init_adapters",
    "is_adapter_key",
    "is_nf4",
    "linear_nf4",
    "lora_scaling",
    "mark_adapters_trainable",
    "merge_adapters",
    "peft_misread_modules",
    "quantize_nf4",
    "resolve_quantize_base",
    "trainable_parameters",
]
