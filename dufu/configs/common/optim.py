# AdamW without weight decay on norms and biases (LiBai's default optimizer).
import torch

from dufu.config import LazyCall as L
from dufu.engine.optim import get_default_optimizer_params

optim = L(torch.optim.AdamW)(
    params=L(get_default_optimizer_params)(
        # model is filled in by the trainer
        weight_decay_norm=0.0,
        weight_decay_bias=0.0,
    ),
    lr=6e-4,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    eps=1e-8,
    # One fused kernel per step instead of a loop over parameters (5x faster on the CPU for 124M parameters).
    fused=True,
)
