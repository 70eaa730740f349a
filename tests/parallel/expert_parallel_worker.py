"""Worker of test_expert_parallel.py: one MoE layer under expert parallelism on 4 ranks against one device.

    torchrun --nproc-per-node 4 tests/parallel/expert_parallel_worker.py OUT_DIR

For each case (expert-parallel size, ZeRO stage or none, capacity factor) every rank builds the layer on the meta
device, splits its experts over the expert axis, wraps it in data parallelism as the trainer does (experts on
``expert_data``, the rest on ``data``), materialises it, and runs forward and backward on its own 2 x 5 tokens.
The single-device reference (built and initialised in each process alike) sees all 4 ranks' tokens, one
micro-batch each, with the auxiliary loss scaled as the trainer scales it. Outputs, losses, gradients (the whole
DTensor, gathered), the global gradient norm and, after an SGD step, the weights must agree; rank 0 writes the
largest errors to OUT_DIR/errors.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dufu.layers.moe import MoE
from dufu.models.base import InitByModule
from dufu.parallel.grads import total_grad_norm
from dufu.parallel.launch import finish_distributed
from dufu.parallel.materialize import materialize_
from dufu.parallel.parallelize import parallelize

WORLD = 4
CASES = [(2, None, None), (4, None, None), (2, 3, None), (4, 2, None), (2, 3, 1.0), (4, None, 1.25)]


class Tiny(InitByModule, nn.Module):
    """One MoE layer in a block container, so data parallelism finds its unit as in a model."""

    def __init__(self, capacity_factor):
        super().__init__()
        self.blocks = nn.ModuleDict({"0": MoE(16, 24, 8, top_k=2, capacity_factor=capacity_factor,
                                              aux_loss_coeff=0.1, z_loss_coeff=0.01,
                                              shared_ffn_hidden_size=12, shared_expert_gate=True)})
        self.finish_init()

    def init_module(self, name, module):
        self.init_normal(name, module, 0.2)

    def forward(self, x):
        return self.blocks["0"](x)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(ep: int, zero, capacity) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(WORLD, 2, 5, 16)
    with torch.device("meta"):
        ref = Tiny(capacity)
    materialize_(ref, ref, torch.device("cpu"), seed=3)
    ref.blocks["0"].aux_loss_grad_scale = 1.0 / WORLD  # 4 micro-batches in the step, one per rank here
    ref_out = [ref(x[r]) for r in range(WORLD)]
    sum(o.square().mean() for o in ref_out).div(WORLD).backward()

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("data", "tensor"))
    expert_mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("expert_data", "expert"))
    with torch.device("meta"):
        model = Tiny(capacity)
    parallelize(model, mesh, data_parallel=True, zero_stage=zero, expert_mesh=expert_mesh)
    materialize_(model, ref, torch.device("cpu"), seed=3)
    model.blocks["0"].aux_loss_grad_scale = 1.0  # one micro-batch per rank
    out = model(x[rank])
    out.square().mean().backward()
    errors = {"output": (out - ref_out[rank]).abs().max().item()}
    spec = model.blocks["0"].experts.gate_up_proj
    errors["experts_not_split"] = float(spec.device_mesh.mesh_dim_names != ("expert_data", "expert")
                                        or spec.placements[-1] != Shard(0))
    ref_grads = dict(ref.named_parameters())
    errors["grad"] = max((full(p.grad) - ref_grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    errors["grad_norm"] = abs(total_grad_norm(list(model.parameters())).item() - ref_norm.item())
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    errors["param"] = max((full(p.detach()) - ref_grads[n].detach()).abs().max().item()
                          for n, p in model.named_parameters())
    (_, counts), = model.blocks["0"].pop_stats()
    dist.all_reduce(counts)
    errors["tokens"] = float(counts.sum().item() != sum(c.sum().item() for _, c in ref.blocks["0"].pop_stats()))
    return errors


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    results = {}
    for ep, zero, capacity in CASES:
        results[f"ep{ep}-zero{zero}-capacity{capacity}"] = run_case(ep, zero, capacity)
    if dist.get_rank() == 0:
        (out / "errors.json").write_text(json.dumps(results, indent=1))
    finish_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
