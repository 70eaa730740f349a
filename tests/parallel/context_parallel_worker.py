"""Worker of test_context_parallel.py: one attention layer under context parallelism against one device.

    torchrun --nproc-per-node N tests/parallel/context_parallel_worker.py OUT_DIR

Every rank builds the same layer and the same (B, T) inputs, runs the whole sequence as one device would, then
its own chunks (:meth:`ContextParallel.token_index`) through the same layer with its ContextParallel attached.
Outputs on the rank's tokens, the input gradients of its tokens and the weight gradients summed over the group
(each rank's share of a loss over the whole sequence) must equal the one-device ones, for causal and
bidirectional attention, grouped-query heads, a (B, T) padding mask and an additive (B, 1, 1, T) bias. Rank 0
writes the largest errors to OUT_DIR/errors.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dufu.layers.attention import Attention
from dufu.parallel.context_parallel import ContextParallel, apply_context_parallel
from dufu.parallel.launch import finish_distributed

T, B, C = 16, 2, 32
# name: (causal, num_key_value_heads, mask kind)
CASES = {
    "causal": (True, 4, None),
    "causal-gqa": (True, 2, None),
    "causal-padding": (True, 2, "padding"),
    "bidirectional-padding": (False, 4, "padding"),
    "bidirectional-bias": (False, 4, "bias"),
}


def mask_for(kind, causal: bool):
    if kind is None:
        return None
    pad = torch.ones(B, T, dtype=torch.long)
    pad[0, -5:] = 0  # right padding in the first row, across the last chunks
    if not causal:  # (causal left padding leaves a query no key: its output is arbitrary on any device)
        pad[1, :3] = 0  # left padding in the second
    if kind == "padding":
        return pad
    return torch.zeros(B, 1, 1, T).masked_fill(pad[:, None, None, :] == 0, torch.finfo(torch.float32).min)


def run_case(causal, kv_heads, kind, cp: ContextParallel) -> dict:
    torch.manual_seed(0)  # the same layer and inputs on every rank
    layer = Attention(C, 4, num_key_value_heads=kv_heads, causal=causal)
    x = torch.randn(B, T, C)
    mask = mask_for(kind, causal)
    weights = torch.randn(B, T, C)  # a loss over every output: sum(y * weights)

    xr = x.clone().requires_grad_(True)
    y = layer(xr, attention_mask=mask)
    (y * weights).sum().backward()
    ref_y, ref_gx = y.detach(), xr.grad
    ref_gw = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    apply_context_parallel(layer, cp)
    idx = cp.token_index(T)
    xl = x[:, idx].clone().requires_grad_(True)
    local_mask = None if mask is None else mask.index_select(mask.dim() - 1, idx)
    yl = layer(xl, attention_mask=local_mask)
    (yl * weights[:, idx]).sum().backward()
    errors = {"output": (yl.detach() - ref_y[:, idx]).abs().max().item(),
              "input_grad": (xl.grad - ref_gx[:, idx]).abs().max().item()}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=cp.group)
        errors[f"grad {n}"] = (g - ref_gw[n]).abs().max().item()
    return errors


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = ContextParallel(dist.group.WORLD, world, rank)
    result = {name: run_case(*case, cp) for name, case in CASES.items()}
    worst = {name: max(errs.values()) for name, errs in result.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, worst)
    if rank == 0:
        Path(out_dir, "errors.json").write_text(json.dumps(gathered, indent=1))
    finish_distributed()  # not destroy_process_group: gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main(sys.argv[1])
