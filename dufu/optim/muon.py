"""Muon: orthogonalised momentum for the hidden layers' 2-D weight matrices, AdamW for every other parameter.

The update (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; Liu et al. 2025,
"Muon is Scalable for LLM Training", the Moonlight report) of a matrix W of shape (A, B) at step t:

    B_t = mu B_(t-1) + (1 - mu) g_t                        momentum (kept as a lerp, like torch.optim.Muon)
    U_t = (1 - mu) g_t + mu B_t    (Nesterov, the default) or B_t
    O_t = NS5(U_t)                 quintic Newton-Schulz: U_t's singular values pushed to ~[0.7, 1.2]
    W_t = W_(t-1) (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O_t

The factor 0.2 sqrt(max(A, B)) is Moonlight's: an orthogonal (A, B) matrix has RMS 1/sqrt(max(A, B)), so the
update's RMS is 0.2 x lr, about AdamW's, and Muon can take AdamW's learning rate and weight decay unchanged.
Weight decay is decoupled (Loshchilov & Hutter), as in AdamW. Embeddings, the output head, norms, biases and
every parameter that is not 2-D train with AdamW (torch's own, in the same optimizer object, so one LR schedule,
one ``state_dict`` and one checkpoint cover both); :func:`muon_param_groups` decides which is which.

**Why not torch.optim.Muon alone.** torch (2.9 and later; 2.13 here) ships ``torch.optim.Muon`` with the same
single-device math (the same coefficients, ``adjust_lr_fn="match_rms_adamw"`` for Moonlight's scaling); it is the
reference this module's tests compare with. It lacks what a dufu run needs: (1) it refuses every parameter that
is not 2-D, so a model needs a second optimizer for the rest (two objects where the trainer, its schedule and its
checkpoint expect one per model part); (2) it runs Newton-Schulz on whatever tensor the parameter is, and under
ZeRO-3 or tensor parallelism that is a DTensor shard: the iteration needs the whole matrix; (3) it always iterates in
bf16, also where bf16 is emulated (slower than fp32) and in runs checked at fp32 tolerances. The update is a few
lines, written here with those three handled.

**Sharded parameters (the gather form).** Under ZeRO (FSDP2: ``Shard(0)`` over the data axis) and tensor
parallelism (``Shard(0)``/``Shard(1)`` over the tensor axis) a parameter, its gradient and its momentum buffer
are DTensors with the same placements. The momentum and the Nesterov step are elementwise, so they run on the
local shards and the buffer stays sharded like the parameter (its memory: one buffer per parameter shard). The
update matrix is then gathered (``DTensor.full_tensor()``: all-gathers over every sharded mesh axis, on the
parameter's device, so NCCL on a GPU), orthogonalised whole on every rank, and each rank keeps its own shard of
the result (``distribute_tensor(..., src_data_rank=None)``: a local slice, no communication). Every rank of a
mesh computes the same orthogonalisation: simple and exact, at the cost of redundant compute and one all-gather
of each matrix's update per step. Moonlight's Distributed Muon does the same (gather over data-parallel then
tensor-parallel ranks, iterate, keep the local part). Owner-based variants (nanochat's DistMuon, DMuon) instead
assign whole matrices to ranks round-robin, iterate each once and all-gather the results, dividing the
Newton-Schulz work by the number of ranks: the next step where the iteration's time matters (large matrices,
many ranks).
A replicated DTensor (``replicate``: dp without ZeRO), a plain tensor and a pipeline stage's own parameters need
no gather.

**Newton-Schulz dtype.** ``ns_dtype="auto"`` iterates in bf16 where the device multiplies bf16 matrices in
hardware -- a CUDA GPU with native bf16 (Ampere and newer: tensor cores), an x86 CPU with AMX-BF16 or AVX512-BF16
(torch's CPU capabilities) -- and in fp32 elsewhere, where bf16 is emulated and slower than fp32. bf16 is the
published practice (Jordan; Moonlight; torch.optim.Muon): the iteration's output is only approximately orthogonal
anyway (singular values in ~[0.7, 1.2]), and the result is cast back to the parameter's dtype. On this project's
AMX CPU one step's iterations of the default recipe's 24 matrices take 2.4x less time in bf16
(benchmarks/results/muon-2026-11-29.md, a loaded machine). The debug recipe (``gpt_debug_muon``) sets
``ns_dtype="float32"``, as the debug recipes train in fp32: a layout gathers an update that differs from one
process's by reduction order, and bf16 rounding would turn those low bits into differences far above the fp32
tolerances its parity tests hold it to. (The CUDA path is unverified here: no GPU.)
"""

from __future__ import annotations

import fnmatch
import math
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dufu.models.base import contract_of

# Keller Jordan's quintic coefficients (a, b, c): the largest slope at zero that still keeps every singular
# value in about [0.7, 1.2] after 5 steps (the same as torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Moonlight's update-RMS match: RMS(O) = 1/sqrt(max(A, B)) for an orthogonal O, times 0.2 sqrt(max(A, B)) = 0.2.
MATCH_ADAMW_RMS = 0.2
# Parameter names (fnmatch, on the full name) trained with AdamW even when they are 2-D: output heads
# (lm_head, a classifier, a ViT head). Embedding tables are recognised by type (nn.Embedding) and the model
# contract's output_head() / token_embedding() by identity; these patterns catch what neither declares.
ADAMW_PATTERNS = ("*head*", "*classifier*")
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


def zeropower_via_newtonschulz(g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthogonal factor of ``g`` (2-D), approximately: U S' V^T for g = U S V^T, S' in about [0.7, 1.2] on the
    directions g has (Jordan et al. 2024), computed in ``dtype`` with matrix products only."""
    if g.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises a 2-D matrix; got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is (min, min)
        x = x.mT
    x = x / x.norm().clamp(min=eps)  # Frobenius >= spectral norm: every singular value in [0, 1]
    for _ in range(steps):
        gram = x @ x.mT  # (A, A), A <= B
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2, (A, A)
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X, (A, B)
    return x.mT if tall else x


def cpu_has_bf16_matmul() -> bool:
    """This x86 CPU multiplies bf16 matrices in hardware (AMX-BF16 or AVX512-BF16), as torch's CPU capabilities
    report it (``torch.cpu.get_capabilities``; False where this torch lacks it)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # a compatibility check: not in every torch
    caps = capabilities() if capabilities is not None else {}
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def ns_dtype_for(setting: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``ns_dtype=setting`` on ``device`` (see the module docstring)."""
    if setting not in NS_DTYPES:
        raise ValueError(f"Muon(ns_dtype={setting!r}): one of {', '.join(map(repr, NS_DTYPES))}")
    if NS_DTYPES[setting] is not None:
        return NS_DTYPES[setting]
    if device.type == "cuda":  # CUDA-only branch, unverified here (no GPU): tensor cores from Ampere on
        fast = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        fast = device.type == "cpu" and cpu_has_bf16_matmul()
    return torch.bfloat16 if fast else torch.float32


def muon_param_groups(model: nn.Module, weight_decay: Optional[float] = None, weight_decay_norm: float = 0.0,
                      weight_decay_bias: float = 0.0, adamw_patterns: Iterable[str] = ADAMW_PATTERNS) -> list[dict]:
    """Parameter groups for :class:`Muon`, each with ``use_muon``: the hidden layers' 2-D weight matrices in one
    Muon group; the rest in AdamW groups, without weight decay on norms and biases (as
    ``dufu.engine.optim.get_default_optimizer_params``).

    AdamW takes, in this order: a norm's parameters (``weight_decay_norm``); biases and every parameter with
    fewer than 2 dims (``weight_decay_bias``); parameters with more than 2 dims (MoE experts' stacked matrices),
    embedding tables (any ``nn.Embedding``, the contract's ``token_embedding()``), the output head (the
    contract's ``output_head()``: under pipelining the last stage's own copy of a tied head too) and every
    parameter whose full name matches one of ``adamw_patterns`` (fnmatch), all with ``weight_decay``. Every
    other parameter (a 2-D weight of a hidden layer: attention projections, MLP matrices, a router) is Muon's.
    ``weight_decay=None`` keeps the optimizer's own. Shared (tied) parameters appear once, frozen ones not at all;
    the AdamW groups are split by tensor kind (plain tensor or DTensor on a given mesh), which fused kernels
    cannot mix. A part with nothing to train gets one empty group.
    """
    patterns = tuple(adamw_patterns)
    declared = contract_of(model)
    special = {id(m) for m in (declared.output_head(), declared.token_embedding()) if m is not None}
    seen: set[int] = set()
    muon, decay, no_decay_norm, no_decay_bias = [], [], [], []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(module, NORM_TYPES):
                no_decay_norm.append(p)
            elif pname == "bias" or p.ndim < 2:
                no_decay_bias.append(p)
            elif (p.ndim > 2 or isinstance(module, nn.Embedding) or id(module) in special
                  or any(fnmatch.fnmatchcase(name, pat) for pat in patterns)):
                decay.append(p)
            else:
                muon.append(p)
    groups = []
    if muon:
        groups.append({"params": muon, "use_muon": True, **({} if weight_decay is None else
                                                            {"weight_decay": weight_decay})})
    for params, wd in ((decay, weight_decay), (no_decay_norm, weight_decay_norm), (no_decay_bias, weight_decay_bias)):
        by_kind: dict = {}
        for p in params:
            mesh = p.device_mesh if isinstance(p, DTensor) else None
            by_kind.setdefault(id(mesh) if mesh is not None else None, []).append(p)
        for kind_params in by_kind.values():
            groups.append({"params": kind_params, "use_muon": False, **({} if wd is None else {"weight_decay": wd})})
    return groups or [{"params": [], "use_muon": False}]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole matrix whose shard ``local`` is, sharded like the parameter ``like`` (gathered on every rank)."""
    if not isinstance(like, DTensor):
        return local
    # shape and stride given: FSDP2 shards dim 0 unevenly when it does not divide (torch.chunk's split)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()


def _shard_as(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``whole``, laid out as the local tensor of the parameter ``like``: a local slice."""
    if not isinstance(like, DTensor):
        return whole
    local = distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
    if local.shape != like.to_local().shape:
        raise RuntimeError(f"Muon: the orthogonalised update's shard has shape {tuple(local.shape)}, the parameter's "
                           f"{tuple(like.to_local().shape)} (placements {like.placements}): this torch shards the "
                           "parameter in a way distribute_tensor does not reproduce")
    return local


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon=True`` (2-D matrices), AdamW on the others (see the module docstring).

    Build the groups with :func:`muon_param_groups` (the recipe's ``optim.params``). Muon's keys: ``lr``,
    ``weight_decay`` (decoupled), ``momentum``, ``nesterov``, ``ns_steps``, ``ns_coefficients``, ``ns_eps``,
    ``ns_dtype`` ("auto": bf16 where the device has bf16 matrix hardware, else fp32; "float32"; "bfloat16").
    AdamW's: the same ``lr`` and ``weight_decay`` (Moonlight reuses AdamW's for both, thanks to the update-RMS
    match), ``betas``, ``eps``, ``fused``; any group may set its own. With ``fused=True`` the optimizer takes the
    trainer's ``found_inf`` and skips a step with non-finite gradients on the device, Muon's matrices included
    (no host read).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_coefficients=NS_COEFFICIENTS, ns_eps: float = 1e-7,
                 ns_dtype: str = "auto", betas=(0.9, 0.95), eps: float = 1e-8, fused: Optional[bool] = None):
        if not lr >= 0.0:
            raise ValueError(f"Muon(lr={lr}): a learning rate is >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon(momentum={momentum}): momentum is in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon(weight_decay={weight_decay}): weight decay is >= 0")
        if int(ns_steps) != ns_steps or ns_steps < 1:
            raise ValueError(f"Muon(ns_steps={ns_steps}): a positive number of Newton-Schulz steps (5 is the usual)")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon(ns_coefficients={ns_coefficients}): three coefficients (a, b, c) of the quintic")
        ns_dtype_for(ns_dtype, torch.device("cpu"))  # an unknown setting fails here, not at the first step
        if isinstance(params, torch.Tensor):
            raise TypeError("Muon(params=...): parameter groups, not a tensor; use dufu.optim.muon_param_groups")
        groups = list(params)
        if not groups or not all(isinstance(g, dict) and "use_muon" in g for g in groups):
            raise ValueError(
                "Muon(params=...): every parameter group needs 'use_muon' (True: a hidden layer's 2-D matrix, "
                "orthogonalised; False: trained with AdamW). Build them with dufu.optim.muon_param_groups: in a "
                "recipe, optim.params = L(muon_param_groups)() (the trainer fills in the model).")
        # AdamW for the groups with use_muon=False: torch's own, sharing this optimizer's group dicts and state
        # (linked in add_param_group and _link), so LR schedules, state_dict and checkpoints see one optimizer.
        self._adamw = torch.optim.AdamW([{"params": []}], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        fused=fused)
        self._adamw.param_groups.clear()
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=int(ns_steps),
                        ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps, ns_dtype=ns_dtype, betas=tuple(betas),
                        eps=eps)
        super().__init__(groups, defaults)
        self._link()
        # fused AdamW skips a step on the device from ``found_inf``; Muon's matrices below do the same
        self._step_supports_amp_scaling = bool(getattr(self._adamw, "_step_supports_amp_scaling", False))

    def add_param_group(self, param_group: dict) -> None:
        if "use_muon" not in param_group:
            raise ValueError("Muon.add_param_group: the group needs 'use_muon' (True: orthogonalised 2-D "
                             "matrices; False: AdamW)")
        if param_group["use_muon"]:
            params = param_group["params"]
            param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
            for p in params:
                if p.ndim != 2:
                    raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} is in a group with use_muon=True; "
                                     "Muon orthogonalises 2-D matrices only: put it in an AdamW group (use_muon="
                                     "False), as dufu.optim.muon_param_groups does")
        else:
            self._adamw.add_param_group(param_group)  # fills AdamW's defaults into the (shared) group dict
        super().add_param_group(param_group)

    def _link(self) -> None:
        """Point the inner AdamW at this optimizer's AdamW group dicts and state (after construction and after
        ``load_state_dict``, which replaces both)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by the trainer (or a GradScaler) around step()
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, found_inf, grad_scale)
        if self._step_supports_amp_scaling:
            self._adamw.found_inf, self._adamw.grad_scale = found_inf, grad_scale
        try:
            self._adamw.step()
        finally:
            if self._step_supports_amp_scaling:
                del self._adamw.found_inf, self._adamw.grad_scale
        return loss

    def _muon_step(self, group: dict, found_inf, grad_scale) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # a DTensor like the gradient: sharded like the parameter
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf, weight = _local(p.grad), _local(state["momentum_buffer"]), _local(p)
            if grad_scale is not None:  # a GradScaler's scaled gradients (fused AdamW unscales them likewise)
                grad = grad / grad_scale
            new_buf = buf.lerp(grad, 1 - mu)
            update = grad.lerp(new_buf, mu) if group["nesterov"] else new_buf  # local shard
            whole = _whole(update, p)  # (A, B) on every rank
            ortho = zeropower_via_newtonschulz(whole, group["ns_steps"], group["ns_coefficients"], group["ns_eps"],
                                               ns_dtype_for(group["ns_dtype"], whole.device))
            ortho = _shard_as(ortho.to(weight.dtype), p)
            scale = lr * MATCH_ADAMW_RMS * math.sqrt(max(p.shape))  # p.shape: the whole matrix's, also for a DTensor
            if found_inf is None:
                buf.copy_(new_buf)
                weight.mul_(1 - lr * wd).sub_(ortho * scale)
            else:  # skipped on the device when the gradients were not finite (their update is NaN)
                skip = found_inf.to(torch.bool)
                buf.copy_(torch.where(skip, buf, new_buf))
                weight.copy_(torch.where(skip, weight, weight * (1 - lr * wd) - ortho * scale))
