"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; GShard, Lepikhin et al.
2020; Mixtral, Jiang et al. 2024), single-device code like every other layer.

* **Router**: a linear map to ``num_experts`` logits per token, softmax in fp32, the ``top_k`` experts kept;
  ``norm_topk_prob`` renormalises the kept probabilities to sum to one (Mixtral), otherwise they stay as they are
  (Qwen2-MoE's default).
* **Experts** (:class:`GroupedExperts`): one grouped weight tensor per projection, in transformers' layout:
  ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F), a SwiGLU expert each. They take the routed tokens
  sorted by expert with the count of each, and each expert multiplies its contiguous slice; on a GPU a grouped
  GEMM could replace the loop over experts, the weights would not change. This interface is what expert
  parallelism needs: :mod:`dufu.parallel.expert_parallel` splits the experts along dim 0 and sends each rank's
  slices to the rank that holds their expert by all-to-all, around this module only.
* **Dropless by default**: every token reaches its ``top_k`` experts. With ``capacity_factor`` an expert takes at
  most ``ceil(capacity_factor x tokens x top_k / E)`` assignments, first come (token order) first served; the
  others are dropped (their weight is 0, the token keeps only its other experts and the residual).
* **Shared experts** (DeepSeek-MoE, Qwen2-MoE): ``shared_ffn_hidden_size`` adds a dense SwiGLU MLP every token
  goes through, beside the routed ones.
* **Auxiliary losses** reach the gradients through the layer itself, as Megatron-core does: the output carries
  them into backward (:class:`_AttachAuxLoss`), where they get the gradient ``aux_loss_grad_scale`` (1 on one
  device; the trainer sets 1 / micro-batches per step, so a step's auxiliary loss is the mean over its
  micro-batches in every layout). They are therefore not part of the model's returned loss, which stays the
  language-model loss, and they need no path to the last pipeline stage. The losses:
  the load-balancing loss ``E x sum_i f_i P_i`` (f_i the mean number of a token's k choices that are expert i,
  P_i its mean router probability; Switch eq. 4, extended to top-k as transformers' Mixtral does), times
  ``aux_loss_coeff``; and the router z-loss ``mean(logsumexp(logits)^2)`` (Zoph et al. 2022, ST-MoE), times
  ``z_loss_coeff``. ``tokens_per_expert`` (E,) counts the assignments kept by the last forward (the load-balance
  metric); :meth:`MoE.pop_stats` returns the auxiliary loss and counts of each training forward (with
  gradients) since the last call, not counting activation checkpointing's recomputation.
* **Tensor parallelism**: the layer is replicated on the tensor-parallel ranks and sees the whole sequence
  (``tensor_parallel_replicated``: under sequence parallelism its input is gathered and its output cut back to
  this rank's part of the sequence), so routing, capacity and auxiliary losses are those of one device.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers.mlp import GatedMLP


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split by a parallel style (a DTensor), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts held as two grouped tensors: ``gate_up_proj`` (E, 2F, H), ``down_proj``
    (E, H, F). ``forward(x, counts)``: ``x`` (n, H) are token copies sorted by expert, ``counts`` (E,) how many
    belong to each; returns their outputs (n, H) in the same order."""

    # The parallel style: dim 0 (the experts) splits over the expert-parallel axis (dufu.parallel.expert_parallel).
    expert_parallel = True

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.init_std = num_experts, init_std
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: Optional[float] = None) -> None:
        for w in (self.gate_up_proj, self.down_proj):
            if not w.is_meta:
                nn.init.normal_(w, std=self.init_std if std is None else std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # unbind: one view per expert whose backward stacks the experts' gradients into one tensor (indexing
        # gate_up[e] would give every expert a gradient the size of the whole grouped weight)
        gate_up, down = _local(self.gate_up_proj).unbind(0), _local(self.down_proj).unbind(0)  # E_local x (2F, H), (H, F)
        outputs = []
        for e, chunk in enumerate(x.split(counts.tolist())):  # one contiguous slice per expert
            gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)  # (n_e, F) each
            outputs.append(F.linear(F.silu(gate) * up, down[e]))  # (n_e, H)
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer's output whose backward also gives the auxiliary loss the gradient ``scale``."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.scale, ctx.meta = scale, (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _in_backward() -> bool:
    """True while autograd runs a backward (activation checkpointing recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    # Replicated under tensor parallelism, seeing the whole sequence (see the module docstring).
    tensor_parallel_replicated = True

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int = 2,
                 norm_topk_prob: bool = True, capacity_factor: Optional[float] = None, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, shared_ffn_hidden_size: Optional[int] = None,
                 shared_expert_gate: bool = False, init_std: float = 0.02):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k {top_k} must be between 1 and num_experts {num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor {capacity_factor} must be positive (or None: dropless)")
        if shared_expert_gate and not shared_ffn_hidden_size:
            raise ValueError("MoE: shared_expert_gate needs a shared expert (shared_ffn_hidden_size)")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.capacity_factor, self.aux_loss_coeff, self.z_loss_coeff = capacity_factor, aux_loss_coeff, z_loss_coeff
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, init_std=init_std)
        self.shared = self.shared_gate = None
        if shared_ffn_hidden_size:
            # Qwen2-MoE scales the shared expert's output by sigmoid(shared_gate(x)); DeepSeek-MoE does not.
            self.shared = GatedMLP(hidden_size, shared_ffn_hidden_size, activation="silu", tensor_parallel=False)
            if shared_expert_gate:
                self.shared_gate = nn.Linear(hidden_size, 1, bias=False)
        self.aux_loss_grad_scale = 1.0
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long)
        self._stats = []  # (aux loss, token counts) of each training forward since pop_stats
        if not self.router.weight.is_meta:
            nn.init.normal_(self.router.weight, std=init_std)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, E), top-k weights (N, k), top-k expert ids (N, k)) of tokens ``x`` (N, H)."""
        logits = self.router(x)  # (N, E)
        probs = logits.float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts

    def _keep(self, experts: torch.Tensor) -> Optional[torch.Tensor]:
        """(N, k) mask of the assignments within every expert's capacity; None when dropless (all kept)."""
        if self.capacity_factor is None:
            return None
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
        assignment = torch.arange(experts.numel(), device=x.device)  # (N k,): token-major, then the k choices
        if keep is not None:
            assignment = assignment[keep.flatten()]  # dropped assignments are not computed at all
        chosen = experts.flatten()[assignment]
        order = chosen.argsort(stable=True)  # kept assignments grouped by expert, token order within each
        assignment = assignment[order]
        token = assignment // self.top_k  # (n,): the token of each sorted assignment
        counts = torch.bincount(chosen, minlength=self.num_experts)  # (E,)
        y = self.experts(x[token], counts)  # (n, H)
        w = weights.flatten()[assignment].to(y.dtype)[:, None]  # (n, 1)
        out = x.new_zeros(x.shape, dtype=y.dtype).index_add_(0, token, y * w)  # y: the experts' (autocast) dtype
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        aux = self._aux_loss(logits, experts)
        self.aux_loss, self.tokens_per_expert = aux.detach(), counts.detach()
        if torch.is_grad_enabled() and not _in_backward():  # a training forward, not a recomputation
            self._stats.append((aux.detach(), counts.detach()))
        if aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_grad_scale)
        return out.view(shape)

    def pop_stats(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(auxiliary loss, tokens per expert (E,))] of each training forward since the last call, in order."""
        s, self._stats = self._stats, []
        return s

    def _aux_loss(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        loss = logits.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coeff:
            probs = logits.float().softmax(-1)  # (N, E)
            # (E,): assignments per token to each expert, summed over the k choices (transformers' Mixtral form)
            assigned = F.one_hot(experts, self.num_experts).float().sum(1).mean(0)
            loss = loss + self.aux_loss_coeff * self.num_experts * (assigned * probs.mean(0)).sum()
        if self.z_loss_coeff:
            loss = loss + self.z_loss_coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
        return loss
