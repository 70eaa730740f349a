"""Worker of test_fused_loss.py: fused_linear_cross_entropy with a vocabulary-sharded weight on 2 ranks equals
the plain cross entropy of one process.

    torchrun --nproc-per-node 2 tests/layers/fused_loss_tp_worker.py OUT_DIR

Every rank computes the single-process reference itself (same seeds), then the loss from its weight shard
(``Shard(0)``, as the column-parallel head holds it) and, under sequence parallelism, from its chunk of the
sequence. It checks the loss, its weight shard's gradient and its hidden states' gradient, and writes the
names of the cases that passed to OUT_DIR/ok_RANK.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dufu.layers.loss import cross_entropy_loss, fused_linear_cross_entropy

B, T, C = 2, 9, 16  # T odd: sequence chunks of 5 and 4
# name: (vocabulary, sequence parallel, bf16 autocast)
CASES = {
    "fp32-even": (384, False, False),
    "fp32-uneven": (383, False, False),  # shards of 192 and 191 rows
    "fp32-sp": (383, True, False),
    "bf16-even": (384, False, True),
    "bf16-sp": (384, True, True),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name, vocab, sp, amp, mesh, rank):
    g = torch.Generator().manual_seed(vocab)
    h = torch.randn(B, T, C, generator=g)
    w = 0.3 * torch.randn(vocab, C, generator=g)
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, :2] = -100
    y[1, 3] = vocab - 1  # a target in the last shard's last row
    y[1, 4] = 0
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ref = cross_entropy_loss(ref_h @ ref_w.t(), y)
    ref.backward()

    weight = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    per = -(-T // 2)
    rows = slice(rank * per, min(T, (rank + 1) * per)) if sp else slice(None)
    hidden = h[:, rows].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = fused_linear_cross_entropy(hidden, weight, y, chunk_size=4)
    (loss * 3).backward()

    shard = -(-vocab // 2)
    vocab_rows = slice(rank * shard, min(vocab, (rank + 1) * shard))
    assert weight.grad.placements == (Shard(0),), weight.grad.placements
    grad_w, grad_h = weight.grad.to_local(), hidden.grad
    assert grad_w.shape == ref_w.grad[vocab_rows].shape and grad_h.shape == hidden.shape
    if amp:
        assert abs(loss.item() - ref.item()) <= 1e-4 * ref.item(), (name, loss.item(), ref.item())
        assert rel(grad_w, 3 * ref_w.grad[vocab_rows]) < 2e-2, name
        assert rel(grad_h, 3 * ref_h.grad[:, rows]) < 2e-2, name
    else:
        assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item(), (name, loss.item(), ref.item())
        torch.testing.assert_close(grad_w, 3 * ref_w.grad[vocab_rows], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(grad_h, 3 * ref_h.grad[:, rows], rtol=1e-5, atol=1e-7, msg=name)


def main(out: Path) -> None:
    dist.init_process_group("gloo")  # CPU tensors: the test machine's backend
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tensor",))
    passed = []
    for name, (vocab, sp, amp) in CASES.items():
        check(name, vocab, sp, amp, mesh, rank)
        passed.append(name)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ok_{rank}").write_text(" ".join(passed))
    from dufu.parallel.launch import finish_distributed

    finish_distributed()  # not destroy_process_group: its gloo teardown can abort a finished rank


if __name__ == "__main__":
    main(Path(sys.argv[1]))
