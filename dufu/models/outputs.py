"""Model outputs with the field names Hugging Face transformers uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ModelOutput:
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    last_hidden_state: Optional[torch.Tensor] = None

    def __getitem__(self, key: str):
        return getattr(self, key)
