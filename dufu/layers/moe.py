"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; GShard, Lepikhin et al.
2020; Mixtral, Jiang et al. 2024), single-device code like every other layer.

* **Router**: a linear map to ``num_experts`` logits per token, softmax in fp32, the ``top_k`` experts kept;
  ``norm_topk_prob`` renormalises the kept probabilities to sum to one (Mixtral), otherwise they stay as they are
  (Qwen2-MoE's default).
* **DeepSeekMoE routing** (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2; transformers' ``DeepseekV3TopkRouter``):
  ``score_func="sigmoid"`` scores each expert independently (``sigmoid(logit)`` in fp32), and ``norm_topk_prob``
  divides the kept scores by their sum (``+ 1e-20``, as transformers). ``n_group`` > 1 limits each token to
  ``topk_group`` groups of experts (node-limited routing): the experts split into ``n_group`` equal groups, a
  group's score is the sum of its two best experts' scores, the ``topk_group`` best groups are kept and the
  ``top_k`` experts chosen among theirs. ``routed_scaling_factor`` multiplies the kept weights.
* **Auxiliary-loss-free balancing** (DeepSeek-V3 sec. 2.1.2; Wang et al. 2024): with ``score_bias`` the layer
  holds a persistent fp32 buffer ``score_bias`` (E,), zeros at first, added to the scores to *choose* the
  experts (and the groups) and never to the weights the outputs are mixed with; it has no gradient.
  :meth:`MoE.update_score_bias` moves it by ``bias_update_rate x sign(mean load - load_i)``; the training loop
  calls it after each optimizer step with the step's token counts summed over the micro-batches and the
  data-parallel ranks (:mod:`dufu.engine.moe_balance`). Being a buffer, it is saved with the model and restored
  on a resume.
* **Experts** (:class:`GroupedExperts`): one grouped weight tensor per projection, in transformers' layout:
  ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F), a SwiGLU expert each. They take the routed tokens
  sorted by expert with the count of each. This interface is what expert parallelism needs:
  :mod:`dufu.parallel.expert_parallel` splits the experts along dim 0 and sends each rank's slices to the rank
  that holds their expert by all-to-all, around this module only.
* **Grouped GEMM**: the experts run as one ``torch._grouped_mm`` per projection, the experts' row offsets a
  cumulative sum of the counts on the device, so the forward and backward never read the counts on the host (no
  device synchronisation, no graph break under ``torch.compile``). Where torch has no such kernel for the device
  and dtype, each expert multiplies its slice in a loop (``x.split(counts.tolist())``: one host read per layer
  and forward). :func:`grouped_mm_available` decides, by running the kernel once per device and dtype on a small
  probe (forward, backward, equal to the loop), and under ``torch.compile`` also asks torch's meta kernel, which
  is what compilation traces. Measured here and expected elsewhere:

  ====================================  =====================================================================
  torch 2.13, CPU, eager                grouped: fp32, bf16, fp16 (the CPU kernel loops over the groups in C++)
  torch 2.13, CPU, ``torch.compile``    grouped in bf16; fp32 and fp16 loop (the meta kernel takes bf16 only)
  torch 2.11, CUDA (sm 80+)             grouped in bf16 is what torch documents; other dtypes as probed
                                        (not verified here: no GPU)
  a torch without ``_grouped_mm``       the loop
  ====================================  =====================================================================

  A trace on fake tensors outside ``torch.compile`` (:mod:`dufu.plan`'s) runs the loop: it answers the reads
  of the counts with its own routing and counts the loop's GEMMs. ``GroupedExperts.grouped_mm`` (None: the
  above) forces one path: True refuses to run without the kernel, False always loops. On the grouped path the
  layer counts tokens per expert with ``scatter_add_`` (``bincount`` reads its largest input on a GPU, see
  :meth:`MoE._count`); a ``capacity_factor`` still selects the kept assignments by a boolean mask, whose size
  depends on the data (a read on a GPU, a graph break when compiled).
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
  ``aux_loss_coeff``; the router z-loss ``mean(logsumexp(logits)^2)`` (Zoph et al. 2022, ST-MoE), times
  ``z_loss_coeff`` (softmax routing only); and DeepSeek-V3's sequence-wise balance loss (eq. 17-20), times
  ``seq_aux_loss_coeff``: for each row of the input (B, T, H) (one sequence), ``f_i = E / (k T) x`` the tokens
  that chose expert i and ``P_i`` the row's mean of the normalised scores ``s_i / sum_j s_j``; the loss is
  ``sum_i f_i P_i`` averaged over the rows. A row must be a whole sequence: under context parallelism it is a
  part of one (:attr:`MoE.context_parallel_unsupported_reason` says so for the model to refuse the layout).
  With sigmoid scores, the load-balancing loss's ``P_i`` is also of the normalised scores.
  ``tokens_per_expert`` (E,) counts the assignments kept by the last forward (the load-balance metric);
  :meth:`MoE.pop_stats` returns the auxiliary loss and counts of each training forward (with gradients) since
  the last call, not counting activation checkpointing's recomputation.
* **Tensor parallelism**: the layer is replicated on the tensor-parallel ranks and sees the whole sequence
  (``tensor_parallel_replicated``: under sequence parallelism its input is gathered and its output cut back to
  this rank's part of the sequence), so routing, capacity and auxiliary losses are those of one device.
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dufu.layers import init
from dufu.layers.mlp import GatedMLP


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split by a parallel style (a DTensor), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


# (device, dtype, traced) -> whether torch._grouped_mm computes the experts there (see grouped_mm_available).
_GROUPED_MM: dict[tuple, bool] = {}


def grouped_mm_available(device, dtype: torch.dtype, traced: bool = False) -> bool:
    """Whether ``torch._grouped_mm`` computes the experts on ``device`` in ``dtype``: torch has it, and on a small
    probe its forward and backward run there and equal per-expert matmuls exactly (an empty expert included).
    ``traced``: also under ``torch.compile``, whose fake tensors run torch's meta kernel, which may accept fewer
    dtypes than the device's. Probed once per (device, dtype, traced); the module docstring lists the results."""
    key = (str(torch.device(device)), dtype, traced)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = _probe_grouped_mm(*key)
    return _GROUPED_MM[key]


def _grouped_mm_probe(device, dtype: torch.dtype) -> bool:
    """True when the kernel's output and gradients on ``device`` equal the loop's. The values are small integers,
    so every product and sum is exact in any float dtype and the comparison needs no tolerance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (8, 8), generator=g).to(device, dtype).requires_grad_()  # (tokens, K)
    w = torch.randint(-2, 3, (3, 16, 8), generator=g).to(device, dtype).requires_grad_()  # (E, N, K)
    grad = torch.randint(-2, 3, (8, 16), generator=g).to(device, dtype)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)  # expert 1 gets no rows
    out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    if device.type == "meta":
        return out.shape == (8, 16) and gx.shape == x.shape and gw.shape == w.shape
    ref = torch.cat([F.linear(x[0:3], w[0]), F.linear(x[3:3], w[1]), F.linear(x[3:8], w[2])])
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    return all(torch.equal(a, b) for a, b in ((out, ref), (gx, rx), (gw, rw)))


# Not traced by torch.compile: a first call while compiling runs here, eagerly, once (a graph break only then).
@torch.compiler.disable
def _probe_grouped_mm(device: str, dtype: torch.dtype, traced: bool) -> bool:
    """The probe of :func:`grouped_mm_available`, run in a thread of its own: autocast, grad mode, dispatch modes
    (fake tensors, selective checkpointing's cache) and saved-tensor hooks (checkpointing) are per thread, so the
    caller's forward neither changes the probe nor records its ops."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    devices = [torch.device(device)] + ([torch.device("meta")] if traced else [])
    result = []

    def run():
        try:
            result.append(all(_grouped_mm_probe(dev, dtype) for dev in devices))
        except (RuntimeError, NotImplementedError, TypeError, ValueError):  # no kernel for this device or dtype
            result.append(False)

    thread = threading.Thread(target=run, name="dufu-grouped-mm-probe")
    thread.start()
    thread.join()
    return bool(result and result[0])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would multiply ``x`` in: autocast's where it is on, else ``x``'s."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """SwiGLU experts by two grouped GEMMs: ``x`` (n, H) sorted by expert, ``counts`` (E,), ``gate_up``
    (E, 2F, H), ``down`` (E, H, F); returns (n, H) in ``dtype``.

    torch's grouped GEMM wants the row stride of each operand a multiple of 16 bytes
    (``_meta_grouped_mm_common`` in torch/_meta_registrations.py, the CUDA kernels' rule): H and F a multiple of 4
    in fp32, of 8 in bf16. Other sizes are zero-padded to the next multiple (a copy of the weights per call):
    padded gate and up rows give silu(0) x 0 = 0, padded columns multiply zeros, and the padded output columns
    are cut off; the gradients of the pads are cut off by autograd alike."""
    num_experts, two_f, h = gate_up.shape
    if x.shape[0] == 0:
        # No rows (an expert-parallel rank that received none): the kernel refuses empty operands. All counts are
        # 0, so the loop runs without reading them, and its empty matmuls give the weights their zero gradients.
        return looped_swiglu(x.to(dtype), counts, gate_up.to(dtype), down.to(dtype), sizes=[0] * num_experts)
    f = two_f // 2
    align = 16 // dtype.itemsize
    hp, fp = _round_up(h, align), _round_up(f, align)
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    if (hp, fp) != (h, f):
        x = F.pad(x, (0, hp - h))  # (n, Hp)
        gate_up = F.pad(gate_up.view(num_experts, 2, f, h), (0, hp - h, 0, fp - f)).view(num_experts, 2 * fp, hp)
        down = F.pad(down, (0, fp - f, 0, hp - h))  # (E, Hp, Fp)
    # The end row of each expert's slice, on the device: no host read, whatever the counts.
    offs = counts.cumsum(0).to(torch.int32)  # (E,)
    gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # (n, Fp) each
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)  # (n, Hp)
    return y if hp == h else y[:, :h]


def looped_swiglu(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  sizes: Optional[list[int]] = None) -> torch.Tensor:
    """The same SwiGLU experts, one pair of matmuls per expert on its slice of ``x``: the counts are read on the
    host (``tolist``) to cut the slices, unless the caller knows them (``sizes``)."""
    # unbind: one view per expert whose backward stacks the experts' gradients into one tensor (indexing
    # gate_up[e] would give every expert a gradient the size of the whole grouped weight)
    gate_up, down = gate_up.unbind(0), down.unbind(0)  # E x (2F, H), (H, F)
    outputs = []
    for e, chunk in enumerate(x.split(counts.tolist() if sizes is None else sizes)):  # a slice per expert
        gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)  # (n_e, F) each
        outputs.append(F.linear(F.silu(gate) * up, down[e]))  # (n_e, H)
    return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts held as two grouped tensors: ``gate_up_proj`` (E, 2F, H), ``down_proj``
    (E, H, F). ``forward(x, counts)``: ``x`` (n, H) are token copies sorted by expert, ``counts`` (E,) how many
    belong to each; returns their outputs (n, H) in the same order. ``grouped_mm``: None runs the grouped GEMM
    where :func:`grouped_mm_available` says so and the loop elsewhere; True the grouped GEMM (an error where torch
    has none); False the loop."""

    # The parallel style: dim 0 (the experts) splits over the expert-parallel axis (dufu.parallel.expert_parallel).
    expert_parallel = True

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02,
                 grouped_mm: Optional[bool] = None):
        super().__init__()
        self.num_experts, self.init_std, self.grouped_mm = num_experts, init_std, grouped_mm
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: Optional[float] = None) -> None:
        """N(0, std) experts, tile by tile (:mod:`dufu.layers.init`: an expert-parallel rank draws only its
        experts); a meta tensor is left as it is."""
        for w in (self.gate_up_proj, self.down_proj):
            init.normal_(w, std=self.init_std if std is None else std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)  # (E_local, 2F, H), (E_local, H, F)
        dtype = _compute_dtype(x)
        if self._grouped(x, dtype):
            return grouped_swiglu(x, counts, gate_up, down, dtype)
        return looped_swiglu(x, counts, gate_up, down)

    def runs_grouped(self, x: torch.Tensor) -> bool:
        """Whether tokens like ``x`` go through the grouped GEMM (else the loop)."""
        return self._grouped(x, _compute_dtype(x))

    def _grouped(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if self.grouped_mm is False:
            return False
        compiling = torch.compiler.is_compiling()
        if not compiling and isinstance(x, FakeTensor) and self.grouped_mm is None:
            return False  # a trace without values outside torch.compile (dufu.plan's): see the module docstring
        if grouped_mm_available(x.device, dtype, traced=compiling):
            return True
        if self.grouped_mm:
            raise RuntimeError(
                f"GroupedExperts(grouped_mm=True): torch {torch.__version__} has no grouped GEMM for {dtype} on "
                f"{x.device}{' under torch.compile' if compiling else ''} (grouped_mm_available is False). Leave "
                "grouped_mm=None to loop over the experts where it is missing.")
        return False


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
    """True while autograd runs a backward (activation checkpointing recomputing a forward). False while
    torch.compile traces: a compiled block recomputes inside its compiled backward, without running this Python
    again (and asking autograd here would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


SCORE_FUNCS = ("softmax", "sigmoid")


class MoE(nn.Module):
    # Replicated under tensor parallelism, seeing the whole sequence (see the module docstring).
    tensor_parallel_replicated = True

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int = 2,
                 norm_topk_prob: bool = True, capacity_factor: Optional[float] = None, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, shared_ffn_hidden_size: Optional[int] = None,
                 shared_expert_gate: bool = False, init_std: float = 0.02, score_func: str = "softmax",
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0, score_bias: bool = False,
                 bias_update_rate: float = 0.0, seq_aux_loss_coeff: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k {top_k} must be between 1 and num_experts {num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor {capacity_factor} must be positive (or None: dropless)")
        if shared_expert_gate and not shared_ffn_hidden_size:
            raise ValueError("MoE: shared_expert_gate needs a shared expert (shared_ffn_hidden_size)")
        _check_routing(num_experts, top_k, score_func, n_group, topk_group, routed_scaling_factor, score_bias,
                       bias_update_rate, seq_aux_loss_coeff, z_loss_coeff)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.capacity_factor, self.aux_loss_coeff, self.z_loss_coeff = capacity_factor, aux_loss_coeff, z_loss_coeff
        self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
        self.routed_scaling_factor, self.bias_update_rate = routed_scaling_factor, bias_update_rate
        self.seq_aux_loss_coeff = seq_aux_loss_coeff
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, init_std=init_std)
        self.shared = self.shared_gate = None
        if shared_ffn_hidden_size:
            # Qwen2-MoE scales the shared expert's output by sigmoid(shared_gate(x)); DeepSeek-MoE does not.
            self.shared = GatedMLP(hidden_size, shared_ffn_hidden_size, activation="silu", tensor_parallel=False)
            if shared_expert_gate:
                self.shared_gate = nn.Linear(hidden_size, 1, bias=False)
        # The expert-choice bias of auxiliary-loss-free balancing: a buffer (no gradient, no optimizer, no weight
        # decay), persistent (saved and resumed with the model), fp32 (updates of gamma ~1e-3 must not round away).
        self.register_buffer("score_bias", torch.zeros(num_experts, dtype=torch.float32) if score_bias else None)
        self.aux_loss_grad_scale = 1.0
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long)
        self._stats = []  # (aux loss, token counts) of each training forward since pop_stats
        if not self.router.weight.is_meta:
            nn.init.normal_(self.router.weight, std=init_std)

    @property
    def context_parallel_unsupported_reason(self) -> Optional[str]:
        """Why this layer cannot take a context-parallel chunk of each sequence (None: it can, as far as it
        knows): the sequence-wise balance loss needs each row of its input to be a whole sequence."""
        if self.seq_aux_loss_coeff:
            return ("the sequence-wise balance loss (seq_aux_loss_coeff) counts each sequence's tokens per expert, "
                    "and under context parallelism a rank holds only chunks of each sequence; set "
                    "seq_aux_loss_coeff=0 (auxiliary-loss-free balancing, score_bias, needs no sequence)")
        return None

    def init_own(self) -> None:
        """The initial values of the layer's own tensor (its children have their own rules): a zero bias."""
        if self.score_bias is not None:
            init.zeros_(self.score_bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, E), top-k weights (N, k), top-k expert ids (N, k)) of tokens ``x`` (N, H)."""
        logits, _, weights, experts = self._route(x)
        return logits, weights, experts

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`route`, with the scores (N, E) in fp32 (softmax probabilities or sigmoid affinities)."""
        logits = self.router(x)  # (N, E)
        scores = logits.float().softmax(-1) if self.score_func == "softmax" else logits.float().sigmoid()
        if self.score_bias is None and self.n_group == 1:
            weights, experts = scores.topk(self.top_k, dim=-1)  # (N, k)
        else:
            # The bias and the group limit decide which experts; the weights are the unbiased scores.
            choice = scores if self.score_bias is None else scores + self.score_bias.float()  # (N, E)
            if self.n_group > 1:
                choice = self._limit_groups(choice)
            experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
            weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            # sigmoid scores of a token can all be ~0: transformers' DeepseekV3TopkRouter adds 1e-20
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return logits, scores, weights, experts

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` (N, E) with the experts outside each token's ``topk_group`` best groups at -inf; a group's
        score is the sum of its two best experts' (DeepSeek-V3's node-limited routing, as transformers)."""
        n = choice.shape[0]
        grouped = choice.view(n, self.n_group, self.num_experts // self.n_group)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        best = group_scores.topk(self.topk_group, dim=-1).indices  # (N, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, self.num_experts)

    @torch.no_grad()
    def update_score_bias(self, tokens_per_expert: torch.Tensor, scale=1.0) -> None:
        """Auxiliary-loss-free balancing's update (DeepSeek-V3 sec. 2.1.2): ``score_bias += bias_update_rate x
        sign(mean load - load_i) x scale``, ``tokens_per_expert`` (E,) the tokens each expert got in the whole
        step over all data-parallel ranks; ``scale`` (a number or a 0-dim tensor on the device) is 0 for a step
        whose update was skipped. The same counts on every replica give every replica the same bias."""
        if self.score_bias is None:
            raise RuntimeError("MoE.update_score_bias: this layer has no score_bias (build it with score_bias=True)")
        load = tokens_per_expert.to(self.score_bias.device, torch.float32)
        step = torch.sign(load.mean() - load) * self.bias_update_rate  # (E,)
        self.score_bias.add_(step * scale)

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
        logits, scores, weights, experts = self._route(x)
        keep = self._keep(experts)
        assignment = torch.arange(experts.numel(), device=x.device)  # (N k,): token-major, then the k choices
        if keep is not None:
            assignment = assignment[keep.flatten()]  # dropped assignments are not computed at all
        chosen = experts.flatten()[assignment]
        order = chosen.argsort(stable=True)  # kept assignments grouped by expert, token order within each
        assignment = assignment[order]
        token = assignment // self.top_k  # (n,): the token of each sorted assignment
        counts = self._count(chosen, x)  # (E,)
        y = self.experts(x[token], counts)  # (n, H)
        w = weights.flatten()[assignment].to(y.dtype)[:, None]  # (n, 1)
        out = x.new_zeros(x.shape, dtype=y.dtype).index_add_(0, token, y * w)  # y: the experts' (autocast) dtype
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        aux = self._aux_loss(logits, scores, experts, rows=math.prod(shape[:-2]) if len(shape) > 2 else 1)
        self.aux_loss, self.tokens_per_expert = aux.detach(), counts.detach()
        if torch.is_grad_enabled() and not _in_backward():  # a training forward, not a recomputation
            self._stats.append((aux.detach(), counts.detach()))
        if aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_grad_scale)
        return out.view(shape)

    def _count(self, chosen: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(E,) kept assignments per expert. ``bincount`` sizes its output by the largest value, which it reads on
        the host on a GPU and which torch.compile cannot trace in one graph; ``scatter_add_`` does neither, and
        the grouped GEMM counts with it. The loop, which reads the counts anyway, keeps ``bincount``: a trace
        without values (:mod:`dufu.plan`) answers it with its balanced routing."""
        if self.experts.runs_grouped(x):
            return torch.zeros(self.num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
                0, chosen, torch.ones_like(chosen))
        return torch.bincount(chosen, minlength=self.num_experts)

    def pop_stats(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(auxiliary loss, tokens per expert (E,))] of each training forward since the last call, in order."""
        s, self._stats = self._stats, []
        return s

    def _aux_loss(self, logits: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                  rows: int) -> torch.Tensor:
        """The auxiliary losses of the module docstring: ``scores`` (N, E) the router's fp32 scores, ``experts``
        (N, k) the chosen experts, ``rows`` the input's sequences (N = rows x T)."""
        loss = logits.new_zeros((), dtype=torch.float32)
        if not (self.aux_loss_coeff or self.z_loss_coeff or self.seq_aux_loss_coeff):
            return loss
        # the scores as a distribution over experts: softmax's already are, sigmoid's are divided by their sum
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)  # (N, E)
        if self.aux_loss_coeff:
            # (E,): assignments per token to each expert, summed over the k choices (transformers' Mixtral form)
            assigned = F.one_hot(experts, self.num_experts).float().sum(1).mean(0)
            loss = loss + self.aux_loss_coeff * self.num_experts * (assigned * probs.mean(0)).sum()
        if self.z_loss_coeff:
            loss = loss + self.z_loss_coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
        if self.seq_aux_loss_coeff:
            t = experts.shape[0] // rows
            chosen = experts.view(rows, t * self.top_k)  # (B, T k)
            # counted by scatter_add_: no host read (F.one_hot checks its values on the host)
            counts = probs.new_zeros(rows, self.num_experts).scatter_add_(
                1, chosen, probs.new_ones(chosen.shape))  # (B, E)
            f = counts * (self.num_experts / (self.top_k * t))  # (B, E), no gradient
            p = probs.view(rows, t, self.num_experts).mean(1)  # (B, E)
            loss = loss + self.seq_aux_loss_coeff * (f * p).sum(-1).mean()
        return loss


def _check_routing(num_experts: int, top_k: int, score_func: str, n_group: int, topk_group: int,
                   routed_scaling_factor: float, score_bias: bool, bias_update_rate: float,
                   seq_aux_loss_coeff: float, z_loss_coeff: float) -> None:
    """Refuse router settings that do not combine, saying what to change."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"MoE: score_func {score_func!r} is not one of {', '.join(map(repr, SCORE_FUNCS))}")
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"MoE: n_group {n_group!r} must be a whole number >= 1 that divides num_experts "
                         f"{num_experts} (the experts split into n_group equal groups)")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(f"MoE: n_group {n_group} leaves {per_group} expert per group, but a group's score is the "
                         "sum of its two best experts' scores; use n_group <= num_experts / 2, or n_group=1")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"MoE: topk_group {topk_group!r} must be between 1 and n_group {n_group} (the groups "
                         "each token may use)")
    if top_k > topk_group * per_group:
        raise ValueError(f"MoE: top_k {top_k} experts cannot be chosen from topk_group {topk_group} groups of "
                         f"{per_group} experts ({topk_group * per_group} experts); raise topk_group or lower top_k")
    if not routed_scaling_factor > 0:
        raise ValueError(f"MoE: routed_scaling_factor {routed_scaling_factor} must be positive")
    if bias_update_rate < 0:
        raise ValueError(f"MoE: bias_update_rate {bias_update_rate} must be >= 0 (0: the bias does not move)")
    if bias_update_rate > 0 and not score_bias:
        raise ValueError(f"MoE: bias_update_rate {bias_update_rate} updates the expert-choice bias, but the layer "
                         "has none; set score_bias=True")
    if seq_aux_loss_coeff < 0:
        raise ValueError(f"MoE: seq_aux_loss_coeff {seq_aux_loss_coeff} must be >= 0")
    if z_loss_coeff and score_func != "softmax":
        raise ValueError(f"MoE: the router z-loss (z_loss_coeff {z_loss_coeff}) penalises logsumexp of the logits, "
                         f"the normaliser of softmax scores; {score_func} scores have none. Set z_loss_coeff=0 with "
                         f"score_func={score_func!r}")
