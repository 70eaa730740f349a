"""Delta tuning: train a small addition to a frozen model, in every layout.

See :mod:`dufu.delta.spec` for the config section; :mod:`dufu.delta.lora` for LoRA (and DoRA) and its parallel
styles, :mod:`dufu.delta.adapters` for bottleneck adapters, :mod:`dufu.delta.prefix` for prefix tuning,
:mod:`dufu.delta.prompt` for prompt tuning; :mod:`dufu.delta.peft` for PEFT's LoRA adapter files.
"""

from dufu.delta.lora import LoraLinear, add_lora, lora_layers, merge_lora_
from dufu.delta.peft import load_adapter, save_adapter
from dufu.delta.spec import (Adapter, BitFit, DeltaInfo, Freeze, LoRA, PrefixTuning, PromptTuning, apply_delta,
                             matches)

__all__ = ["LoRA", "Adapter", "PrefixTuning", "PromptTuning", "BitFit", "Freeze", "DeltaInfo", "apply_delta",
           "matches", "LoraLinear", "add_lora", "lora_layers", "merge_lora_", "load_adapter", "save_adapter"]
