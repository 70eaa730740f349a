"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training").

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not
flush to zero. The overflow check is the *global* gradient norm, which the
trainer already reduces over every parallel axis (tensor, data/FSDP, pipeline),
so all ranks see the same verdict and skip or take the same steps in any layout.
On overflow the step is skipped and the scale backs off; after
``growth_interval`` clean steps it grows.
"""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._good_steps = 0
            self.skipped_steps += 1
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
