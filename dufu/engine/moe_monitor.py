"""What a mixture-of-experts run needs from the trainer: the auxiliary losses' gradient scale, and the load
balance people read (``moe_aux_loss``, ``moe_max_load`` and ``moe_max_load_step`` in every record, the tokens
each expert received in ``moe_tokens.jsonl``, and ``moe_tokens.png`` at the end), and the one place that takes
the layers' routing statistics (:meth:`dufu.layers.moe.MoE.pop_stats`): the step's token counts it keeps in
:attr:`MoEMonitor.step_counts` are what auxiliary-loss-free balancing reads (:mod:`dufu.engine.moe_balance`).

* **Scale**: each MoE layer's auxiliary losses get the gradient ``1 / micro-batches per rank per step`` (times
  the fp16 loss scale), so that after the data-parallel gradient average a step's auxiliary loss is the mean over
  all its micro-batches: the same in every layout, as the language-model loss is (:mod:`dufu.layers.moe`).
* **Records**: after each step the monitor keeps each layer's last ``micro-batches per step`` forwards (a
  pipeline schedule's first step also runs a forward of its own, on placeholder inputs, to infer shapes), and
  the counters are summed over the steps of a logging window and over ranks (tensor-parallel
  peers count once; each pipeline stage reports its own layers). ``moe_aux_loss`` is the auxiliary loss per
  micro-batch summed over layers (what the gradient adds), ``moe_max_load`` the mean over layers of the busiest
  expert's tokens over the mean expert's (1.0 is perfect balance; top-k over E experts with E / k tokens
  would be the worst), counted over the whole window; ``moe_max_load_step`` the same ratio of each step's
  tokens (over all ranks), averaged over the window's steps and the layers: the load a step's experts carry,
  and the one auxiliary-loss-free balancing acts on, which summing a window's steps would smooth.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from dufu.engine.hooks import Hook
from dufu.layers.moe import MoE
from dufu.parallel.env import collective_device


def moe_layer_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, MoE)]


def max_load(counts: torch.Tensor) -> torch.Tensor:
    """The busiest expert's tokens over the mean expert's, along the last dim of ``counts`` (..., E); 1.0 where
    no expert got any."""
    mean = counts.mean(-1)
    return torch.where(mean > 0, counts.amax(-1) / mean.clamp(min=1e-30), torch.ones_like(mean))


class MoEMonitor(Hook):
    """Built from the whole (meta) model, before it is split: the names of all its MoE layers, in order. A hook of
    the training loop (the auxiliary losses' scale before each forward-backward, the step's forwards kept after
    the backward); the run log asks it for :meth:`record` and :meth:`plot`."""

    def __init__(self, output_dir, model):
        self.names = moe_layer_names(model)
        self.num_experts = max((m.num_experts for m in model.modules() if isinstance(m, MoE)), default=0)
        self.path = Path(output_dir) / "moe_tokens.jsonl"
        self._started = False
        self.window = {}  # layer name -> [aux loss sum, token counts sum, forwards] since the last record
        self.window_steps = []  # {layer name: the step's token counts (E,)} of each step since the last record
        # {layer name: tokens per expert (E,), summed over this rank's forwards of the last step}; on the device
        self.step_counts: dict[str, torch.Tensor] = {}
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.top_k = sorted({m.top_k for m in layers})
        # the parameters one token uses: all but the (1 - top_k / E) of the experts it is not routed to
        self.inactive_parameters = sum(p.numel() * (1 - m.top_k / m.num_experts)
                                       for m in layers for p in m.experts.parameters())

    def describe(self, num_parameters: int) -> str:
        """For the start-up summary: what a token uses of the model."""
        active = num_parameters - self.inactive_parameters
        k = "/".join(map(str, self.top_k))
        return (f"{active / 1e6:.2f}M active per token: {len(self.names)} MoE layers, top-{k} of "
                f"{self.num_experts} experts")

    def __bool__(self) -> bool:
        return bool(self.names)

    @staticmethod
    def _layers(model_parts) -> dict[str, MoE]:
        return {n: m for part in model_parts for n, m in part.named_modules() if isinstance(m, MoE)}

    def before_forward_backward(self, tr, micro_batches) -> None:
        rt = tr.runtime
        if not self._started:  # the first step of this process: the file reads as one run
            self._started = True
            if tr.is_main and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and rt.resume_from is not None and json.loads(line)["step"] <= tr.step]
                self.path.write_text("".join(line + "\n" for line in kept))
        # A pipeline schedule divides every gradient by its number of micro-batches itself (torch's scale_grads).
        num = 1 if rt.schedule is not None else rt.num_accumulation_steps
        scale = (rt.scaler.scale if rt.scaler is not None else 1.0) / num
        for m in self._layers(rt.model_parts).values():
            m.aux_loss_grad_scale = scale

    def after_backward(self, tr, local_loss) -> None:
        """Add the step's forwards to the window: the last ones of each layer (see the module docstring)."""
        rt = tr.runtime
        self.step_counts = {}
        for name, m in self._layers(rt.model_parts).items():
            forwards = m.pop_stats()[-rt.num_accumulation_steps:]
            if forwards:
                counts = sum(counts for _, counts in forwards)
                self.step_counts[name] = counts
                w = self.window.setdefault(name, [0.0, 0, 0])
                w[0] = w[0] + sum(aux.detach() for aux, _ in forwards)  # on the device: read at the log step
                w[1] = w[1] + counts
                w[2] += len(forwards)
        self.window_steps.append(self.step_counts)

    def record(self, tr, step: int) -> dict:
        """The window's load-balance metrics (every rank calls this at once: one all-reduce); rank 0 also appends
        the tokens per expert to ``moe_tokens.jsonl``. ``tr``: the runtime."""
        device = collective_device()
        layers, experts = len(self.names), self.num_experts
        window, self.window = self.window, {}
        window_steps, self.window_steps = self.window_steps, []
        # one all-reduce: (layer, [window's counts, aux, forwards]) and (step, layer, the step's counts)
        table = torch.zeros(layers * (experts + 2) + len(window_steps) * layers * experts, dtype=torch.float64,
                            device=device)
        head = table[:layers * (experts + 2)].view(layers, experts + 2)
        steps = table[layers * (experts + 2):].view(len(window_steps), layers, experts)
        if tr.tp_rank == 0:  # tensor-parallel peers hold the same numbers
            for name, (aux, counts, forwards) in window.items():
                row = head[self.names.index(name)]
                row[:counts.numel()] = counts.to(device, torch.float64)
                row[-2], row[-1] = aux, forwards
            for i, step_counts in enumerate(window_steps):
                for name, counts in step_counts.items():
                    steps[i, self.names.index(name), :counts.numel()] = counts.to(device, torch.float64)
        if tr.world_size > 1:
            dist.all_reduce(table)
        head, steps = head.cpu(), steps.cpu()
        counts, aux, forwards = head[:, :-2], head[:, -2], head[:, -1].clamp(min=1)
        loads = max_load(counts)  # (L,)
        if tr.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "tokens_per_expert": {
                    n: [int(v) for v in c] for n, c in zip(self.names, counts)}}) + "\n")
        step_loads = max_load(steps).mean() if len(window_steps) else loads.mean()
        return {"moe_aux_loss": float((aux / forwards).sum()), "moe_max_load": float(loads.mean()),
                "moe_max_load_step": float(step_loads)}

    def plot(self, title: str = "") -> Path | None:
        """``moe_tokens.png``: each layer's max/mean load over the run, and each expert's share of the tokens
        of the last window, layer by layer."""
        if not self.path.exists():
            return None
        import matplotlib  # about 0.4 s to import, only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after the backend is chosen

        records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        if not records:
            return None
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
        steps = [r["step"] for r in records]
        for name in self.names:
            loads = []
            for r in records:
                c = torch.tensor(r["tokens_per_expert"][name], dtype=torch.float64)
                loads.append(float(c.max() / c.mean()) if c.sum() > 0 else 1.0)
            left.plot(steps, loads, label=name, linewidth=1.0)
        left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        left.set_xlabel("step")
        left.set_ylabel("busiest expert / mean expert (tokens)")
        left.set_title("load imbalance per MoE layer")
        if len(self.names) <= 12:
            left.legend(fontsize=7)
        last = torch.tensor([records[-1]["tokens_per_expert"][n] for n in self.names], dtype=torch.float64)
        share = last / last.sum(1, keepdim=True).clamp(min=1)
        image = right.imshow(share.numpy(), aspect="auto", cmap="viridis")
        right.set_xlabel("expert")
        right.set_ylabel("MoE layer")
        right.set_yticks(range(len(self.names)), self.names, fontsize=6)
        right.set_title(f"share of tokens per expert, steps to {records[-1]['step']}")
        fig.colorbar(image, ax=right)
        fig.suptitle(title)
        fig.tight_layout()
        png = self.path.with_suffix(".png")
        fig.savefig(png)
        plt.close(fig)
        return png
