"""Delta tuning: train a small addition to a frozen model (LoRA, BitFit, partial fine-tuning), in every layout.

See :mod:`dufu.delta.spec` for the config section and :mod:`dufu.delta.lora` for LoRA and its parallel styles.
"""

from dufu.delta.lora import LoraLinear, add_lora, lora_layers, merge_lora_
from dufu.delta.spec import BitFit, DeltaInfo, Freeze, LoRA, apply_delta, matches

__all__ = ["LoRA", "BitFit", "Freeze", "DeltaInfo", "apply_delta", "matches", "LoraLinear", "add_lora",
           "lora_layers", "merge_lora_"]
