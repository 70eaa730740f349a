"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; GShard, Lepikhin et al.
2020; Mixtral, Jiang et al. 2024), single-device code like every other layer.

* **Router**: a linear map to ``num_experts`` logits per token, softmax in fp32, the ``top_k`` experts kept;
  ``norm_topk_prob`` renormalises the kept probabilities to sum to one (Mixtral), otherwise they stay as they are
  (Qwen2-MoE's default).
* **Experts**: one grouped weight tensor per projection, in transformers' layout: ``gate_up_proj`` (E, 2F, H) and
  ``down_proj`` (E, H, F), a SwiGLU expert each. Tokens are sorted by expert and each expert multiplies its
  contiguous slice; on a GPU a grouped GEMM could replace the loop over experts, the weights would not change.
* **Dropless by default**: every token reaches its ``top_k`` experts. With ``capacity_factor`` an expert takes at
  most ``ceil(capacity_factor x tokens x top_k / E)`` assignments, first come (token order) first served; the
  others are dropped (their weight is 0, the token keeps only its other experts and the residual).
* **Shared experts** (DeepSeek-MoE, Qwen2-MoE): ``shared_ffn_hidden_size`` adds a dense SwiGLU MLP every token
  goes through, beside the routed ones.
* **Auxiliary losses**, kept on the module after each forward for the model to add to its loss:
  the load-balancing loss ``E x sum_i f_i P_i`` (f_i the mean number of a token's k choices that are expert i,
  P_i its mean router probability; Switch eq. 4, extended to top-k as transformers' Mixtral does), times
  ``aux_loss_coeff``; and the router z-loss ``mean(logsumexp(logits)^2)`` (Zoph et al. 2022, ST-MoE), times
  ``z_loss_coeff``. ``tokens_per_expert`` (E,) counts the assignments of the last forward (the load-balance metric).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers.mlp import GatedMLP


class MoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int = 2,
                 norm_topk_prob: bool = True, capacity_factor: Optional[float] = None, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, shared_ffn_hidden_size: Optional[int] = None,
                 init_std: float = 0.02):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k {top_k} must be between 1 and num_experts {num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor {capacity_factor} must be positive (or None: dropless)")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.capacity_factor, self.aux_loss_coeff, self.z_loss_coeff = capacity_factor, aux_loss_coeff, z_loss_coeff
        self.init_std = init_std
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))  # (E, 2F, H)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))  # (E, H, F)
        self.shared = None
        if shared_ffn_hidden_size:
            self.shared = GatedMLP(hidden_size, shared_ffn_hidden_size, activation="silu")
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.router.weight, self.gate_up_proj, self.down_proj):
            if not w.is_meta:
                nn.init.normal_(w, std=self.init_std)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, E), top-k weights (N, k), top-k expert ids (N, k)) of tokens ``x`` (N, H)."""
        logits = self.router(x)  # (N, E)
        probs = logits.float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts

    def _keep(self, experts: torch.Tensor) -> torch.Tensor:
        """(N, k) mask of the assignments within every expert's capacity (all of them when dropless)."""
        if self.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool)
        n = experts.numel()
        capacity = math.ceil(self.capacity_factor * n / self.num_experts)
        onehot = F.one_hot(experts.flatten(), self.num_experts)  # (N k, E), token order, then k
        position = onehot.cumsum(0) * onehot  # 1-based place of each assignment in its expert's queue
        return (position.sum(-1) <= capacity).view_as(experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # (N, H)
        logits, weights, experts = self.route(x)
        keep = self._keep(experts)
        weights = weights * keep
        flat = experts.flatten()  # (N k,)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token = order // self.top_k  # (N k,): the token of each sorted assignment
        counts = torch.bincount(flat[keep.flatten()], minlength=self.num_experts)
        self.tokens_per_expert = counts.detach()
        routed = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(routed):  # one slice of the grouped weights per expert
            if n:
                idx = token[start:start + n]
                w = weights.flatten()[order[start:start + n]].to(x.dtype)[:, None]  # (n, 1)
                gate, up = F.linear(x[idx], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, F) each
                y = F.linear(F.silu(gate) * up, self.down_proj[e])  # (n, H)
                out.index_add_(0, idx, y * w)
            start += n
        if self.shared is not None:
            out = out + self.shared(x)
        self.aux_loss = self._aux_loss(logits, experts, keep)
        return out.view(shape)

    def _aux_loss(self, logits: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        loss = logits.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coeff:
            probs = logits.float().softmax(-1)  # (N, E)
            # (E,): assignments per token to each expert, summed over the k choices (transformers' Mixtral form)
            assigned = F.one_hot(experts, self.num_experts).float().sum(1).mean(0)
            loss = loss + self.aux_loss_coeff * self.num_experts * (assigned * probs.mean(0)).sum()
        if self.z_loss_coeff:
            loss = loss + self.z_loss_coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
        return loss
