"""Every tensor dufu hands to a collective is on the device dufu picked for the rank.

On a GPU machine dufu picks ``cuda:<local rank>`` and NCCL (``dufu.parallel.env``), and NCCL refuses a CPU
tensor; a gloo-only group (async checkpoint saves) refuses a CUDA tensor. The usual bug is a tensor made
without ``device=`` (``torch.tensor(flag)``) that reaches ``dist.all_reduce``: it works on CPU runs and fails
on the first CUDA run. This machine has no GPU, so the test stands in for a CUDA run like this:

* the picked device is the CPU, as ``pick_device`` returns here, and the process group is gloo;
* while dufu code runs, torch's *default* device is set to ``meta``: a tensor made without ``device=``
  lands on ``meta`` (where a CUDA run would put it on the CPU, away from the picked device);
* ``torch.distributed``'s collectives are wrapped. Every tensor sent over a group that is not gloo-only (the
  default group, the meshes, groups made without ``backend="gloo"``: NCCL groups in a CUDA run) must be on
  the picked device; a gloo-only group must carry no tensor collectives from dufu (only object collectives
  and barriers, which torch stages in host memory itself).

Paths run on 2 processes: ``dufu.compat.libai.setup`` (process-group start-up, ``to_global``), the
gradient norm over a pipeline group with a rank that has no gradients, tied-gradient sums, a pipeline
schedule (the stages' send/recv), and the checkpointer: a synchronous and an asynchronous save, the
verification the ranks split (with a corrupt file found by one rank only) and a load.

What this cannot catch on CPU: a tensor put *explicitly* on the CPU (``device="cpu"``) is indistinguishable
from one on the picked device here, so :func:`test_no_cpu_literal_near_collectives` reads the modules that
feed collectives for CPU-device literals instead; the CUDA device *index* (cuda:0 vs cuda:1) cannot be
told apart; collectives torch issues itself (DTensor redistribution, FSDP, object-collective staging) are
placed by torch from the mesh's device type and are not inspected; NCCL's own rules (streams, the current
device for object collectives) are not exercised.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]

# Collectives that take tensors: name -> which arguments hold them.
_TENSOR_COLLECTIVES = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list", "tensor"), "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output", "input_list"), "reduce_scatter_tensor": ("output", "input"),
    "all_to_all_single": ("output", "input"), "send": ("tensor",), "recv": ("tensor",),
}  # isend / irecv stay as they are (P2POp accepts only those very functions); batch_isend_irecv is wrapped
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "barrier", "monitored_barrier")


class DeviceMismatch(AssertionError):
    pass


class Recorder:
    """Wraps ``torch.distributed``'s collectives (the module attributes dufu and torch's pipelining call)."""

    def __init__(self, picked: torch.device):
        self.picked = picked
        self.gloo_only: set[int] = set()  # id() of groups made with backend="gloo"
        self.calls: list[tuple[str, str, list[str]]] = []  # (collective, group kind, tensor devices)
        self.mismatches: list[str] = []
        self._saved: dict = {}

    def install(self) -> None:
        import inspect

        for name, params in _TENSOR_COLLECTIVES.items():
            fn = getattr(dist, name)
            self._wrap(name, fn, inspect.signature(fn), params)
        for name in _OBJECT_COLLECTIVES:
            fn = getattr(dist, name)
            self._wrap(name, fn, inspect.signature(fn), ())
        batch = dist.batch_isend_irecv

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                self._check("batch_isend_irecv", op.group, [op.tensor])
            return batch(p2p_op_list)

        self._saved["batch_isend_irecv"] = batch
        dist.batch_isend_irecv = batch_isend_irecv
        new_group = dist.new_group

        def tagged_new_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and group is not None:
                self.gloo_only.add(id(group))
            return group

        self._saved["new_group"] = new_group
        dist.new_group = tagged_new_group

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn, signature, params) -> None:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            tensors = []
            for p in params:
                value = bound.arguments.get(p)
                tensors.extend(value if isinstance(value, (list, tuple)) else [value])
            if not self._check(name, bound.arguments.get("group"), [t for t in tensors if isinstance(t, torch.Tensor)]):
                # gloo would fail on the meta tensor with a message that names neither the call nor the cause
                raise DeviceMismatch(self.mismatches[-1])
            with torch.device("cpu"):  # the collective itself runs as torch wrote it, on the real host default
                return fn(*args, **kwargs)

        self._saved[name] = fn
        setattr(dist, name, wrapper)

    def _check(self, name: str, group, tensors: list[torch.Tensor]) -> bool:
        """Record one collective; False if it sends a tensor where the group's backend would refuse it."""
        before = len(self.mismatches)
        kind = "gloo-only" if group is not None and id(group) in self.gloo_only else "accelerator"
        devices = [str(t.device) for t in tensors]
        self.calls.append((name, kind, devices))
        if kind == "gloo-only" and tensors:
            self.mismatches.append(f"{name}: tensors on a gloo-only group (a CUDA run would send CUDA tensors)")
        for t in tensors if kind == "accelerator" else ():
            if t.device != self.picked:
                origin = "made without device=" if t.device.type == "meta" else "on another device"
                self.mismatches.append(f"{name}: a tensor on {t.device} ({origin}), the rank's device is {self.picked}")
        return len(self.mismatches) == before


@contextlib.contextmanager
def host_default_is_meta():
    """Tensors made without ``device=`` land on ``meta``: they stand out from the picked device."""
    with torch.device("meta"):
        yield


# ----------------------------------------------------------------------------------------------- worker


def _tiny_gpt(num_layers: int = 2):
    from dufu.models.gpt.model import GPTModel

    torch.manual_seed(0)
    return GPTModel(vocab_size=32, hidden_size=16, num_layers=num_layers, num_attention_heads=2,
                    max_position_embeddings=8)


def _grads(rec: Recorder, device: torch.device, rank: int) -> None:
    from dufu.parallel.grads import clip_grad_norm_

    pp_group = dist.new_group([0, 1])  # a pipeline axis: NCCL in a CUDA run
    params = [torch.nn.Parameter(torch.ones(3, device=device)) for _ in range(2)]
    if rank == 0:  # rank 1 holds parameters without gradients (a frozen stage): it still joins the norm
        for p in params:
            p.grad = torch.full_like(p, 2.0)
    with host_default_is_meta():
        norm = clip_grad_norm_(params, max_norm=1.0, pp_group=pp_group)
    assert norm.device == device and abs(norm.item() - 24 ** 0.5) < 1e-5, norm


def _tied(device: torch.device) -> None:
    from dufu.parallel.grads import sync_tied_gradients

    group = dist.new_group([0, 1])
    p = torch.nn.Parameter(torch.ones(2, device=device))
    p.grad = torch.ones(2, device=device)
    with host_default_is_meta():
        sync_tied_gradients([p], group)
    assert p.grad.tolist() == [2.0, 2.0]


def _pipeline(ctx, device: torch.device, rank: int) -> None:
    from dufu.parallel.pipeline import build_schedule, build_stage_module, layer_stage_ids, make_stages

    model = _tiny_gpt()
    module = build_stage_module(model, rank, 2, layer_stage_ids(2, 2)).to(device)
    stages = make_stages({rank: module}, 2, device, ctx.mesh.get_group("pipeline"))
    schedule = build_schedule("1f1b", stages, n_microbatches=2, loss_fn=model.pipeline_loss)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    with host_default_is_meta():
        if rank == 0:
            schedule.step(ids[:, :-1])
        else:
            schedule.step(target=ids[:, 1:], losses=losses)
    assert rank == 0 or len(losses) == 2


def _checkpoints(rec: Recorder, device: torch.device, rank: int, root: Path) -> None:
    from dufu.engine.weights.checkpoint import Checkpointer
    from dufu.errors import CheckpointError

    model = torch.nn.Linear(4, 4, device=device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4, device=device)).sum().backward()
    opt.step()
    sync = Checkpointer(root / "sync", rank=rank)
    path = sync.save(1, model, opt, {"step": 1})
    async_ckpt = Checkpointer(root / "async", rank=rank, async_save=True)  # no async_group given
    async_ckpt.save(1, model, opt, {"step": 1})
    async_ckpt.wait()
    assert id(async_ckpt.async_group) in rec.gloo_only, "asynchronous saves must coordinate on a gloo group"
    with host_default_is_meta():
        sync.verify_together(path)
    sync.load(path, model, opt)
    # One file corrupted: only the rank whose share it is hashes it, and every rank must raise.
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != "manifest.json")
    dist.barrier()
    if rank == 0:
        with open(path / files[1], "r+b") as f:  # file 1 of the sorted list: rank 1's share
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
    dist.barrier()
    try:
        with host_default_is_meta():
            sync.verify_together(path)
    except CheckpointError as e:
        assert "SHA-256" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: a corrupt file found by rank 1 was not reported here")


def _self_check(rec: Recorder, device: torch.device) -> None:
    """The harness catches the bug it is for: a flag made without device= and broadcast."""
    before = len(rec.mismatches)
    try:
        with host_default_is_meta():
            dist.broadcast(torch.tensor(1.0), src=0)  # every rank takes this path, so none waits for a peer
    except DeviceMismatch:
        pass
    assert len(rec.mismatches) == before + 1, "the recorder missed a tensor made without device="
    del rec.mismatches[before:]
    rec.calls.pop()


def worker() -> int:
    from dufu.compat import libai
    from dufu.parallel import env

    torch.set_num_threads(1)
    _, local_rank, _ = env.world_info()
    picked = env.pick_device(local_rank)
    rec = Recorder(picked)
    rec.install()
    try:
        ctx = libai.setup(pipeline_parallel_size=2)
        rank = ctx.rank
        assert dist.get_backend() == env.pick_backend(picked), (dist.get_backend(), picked)
        with host_default_is_meta():
            local = torch.ones(2, 3, device=picked) * (rank + 1)
            y = libai.to_global(local, sbp=libai.broadcast)
        assert libai.to_local(y).device == ctx.device == picked
        _self_check(rec, picked)
        _grads(rec, picked, rank)
        _tied(picked)
        _pipeline(ctx, picked, rank)
        _checkpoints(rec, picked, rank, Path(os.environ["DUFU_TEST_DIR"]))
    finally:
        rec.uninstall()
    sent = sum(1 for _, kind, devices in rec.calls if devices)
    for line in rec.mismatches:
        print(f"rank {rank} MISMATCH {line}", flush=True)
    print(f"rank {rank}: {len(rec.calls)} collectives, {sent} with tensors, {len(rec.mismatches)} mismatches",
          flush=True)
    from dufu.parallel.launch import finish_distributed

    finish_distributed(1 if rec.mismatches else 0)
    return 0


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.multiprocess
def test_collectives_run_on_the_picked_device(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", DUFU_TEST_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # Both ranks print to one pipe, so their lines can interleave: find the summaries anywhere in the text.
    summaries = re.findall(r"rank (\d+): (\d+) collectives, (\d+) with tensors, (\d+) mismatches", proc.stdout)
    assert sorted(rank for rank, *_ in summaries) == ["0", "1"], out[-6000:]
    assert all(mismatches == "0" for *_, mismatches in summaries), out[-6000:]
    # The run exercised tensor collectives, not only barriers.
    assert all(int(sent) >= 5 for _, _, sent, _ in summaries), summaries


# Modules whose tensors reach collectives directly. An explicit CPU device in them would pass the run above
# (the picked device is the CPU here) and fail under NCCL; where a tensor's device is not given by another
# tensor it comes from dufu.parallel.env.
_COLLECTIVE_MODULES = ["dufu/parallel/grads.py", "dufu/parallel/pipeline.py", "dufu/engine/weights/checkpoint.py",
                       "dufu/compat/libai.py", "dufu/compat/sbp.py", "dufu/parallel/launch.py",
                       "dufu/data/sampler.py", "dufu/engine/reporting/report.py"]


def _cpu_literals(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        is_device_ctor = isinstance(func, ast.Attribute) and func.attr == "device" and not node.keywords
        args = list(node.args) if is_device_ctor else [k.value for k in node.keywords if k.arg == "device"]
        if any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("cpu") for a in args):
            lines.append(node.lineno)
    return lines


def test_no_cpu_literal_near_collectives():
    found = {path: _cpu_literals((REPO / path).read_text()) for path in _COLLECTIVE_MODULES}
    assert not any(found.values()), f"CPU device literals (fail under NCCL): {found}"
    assert _cpu_literals("x = torch.zeros((), device='cpu')\ny = torch.device('cpu')") == [1, 2]


if __name__ == "__main__":
    sys.exit(worker())
