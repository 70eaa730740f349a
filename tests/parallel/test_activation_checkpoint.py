"""Activation checkpointing (dufu.parallel.activation_checkpoint): full and selective modes give the gradients of
no checkpointing, keep measurably less for backward (full < selective < none), leave names unchanged, and match
one process under tensor parallelism and ZeRO-3 on 2 processes.

The multi-process check runs this file as a torchrun worker (``python -m torch.distributed.run ... THIS_FILE
train.output_dir=JOB CASE [CASE ...]``, a CASE being ``LAYOUT:MODE`` or ``LAYOUT:MODE:compile``; the cases of
every selected test run in turn in one job, launched by the fixture ``selective_checkpointing_runs`` of
tests/parallel/conftest.py): for each case, each rank builds the tiny GPT twice from one seed, checkpoints one
copy (and compiles it: test_compile.py) and parallelizes it with ``dufu.parallel.parallelize`` (checkpointing
first: it wraps the block's own forward, so tensor parallelism's hooks on the block's submodules run inside the
checkpointed region, as in the trainer's order), and compares loss and gradients with the other copy run on the
whole batch in one process.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

SIZES = dict(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)


def tiny_gpt(dropout: float = 0.0, **kw):
    from dufu.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(**SIZES, embedding_dropout=dropout, hidden_dropout=dropout, attention_dropout=dropout, **kw)


def batch(rows: int = 4):
    tokens = torch.randint(0, 257, (rows, 33), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, dtype=None, seed: int = 7):
    x, y = batch()
    torch.manual_seed(seed)  # the dropout masks: the same stream for every model
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(x, shift_labels=y).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_equal_no_checkpointing(mode, dropout):
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing

    plain = tiny_gpt(dropout)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), mode)
    plain.train(), checkpointed.train()
    ref_loss, ref = loss_and_grads(plain)
    loss, got = loss_and_grads(checkpointed)
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6), (loss, ref_loss)
    assert got.keys() == ref.keys()
    for name, g in ref.items():  # recomputation replays the same ops (and, with dropout, the same RNG stream)
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-6), (name, (got[name] - g).abs().max())


def test_selective_gradients_equal_under_bf16_autocast():
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing

    plain = tiny_gpt()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), "selective")
    ref_loss, ref = loss_and_grads(plain, torch.bfloat16)
    loss, got = loss_and_grads(checkpointed, torch.bfloat16)
    assert loss == ref_loss
    for name, g in ref.items():  # the same bf16 ops in the same order: bit for bit
        assert torch.equal(got[name], g), name


def kept_bytes(model, dtype=None) -> int:
    from dufu.parallel.activation_checkpoint import LiveActivations

    x, y = batch()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        with LiveActivations(exclude=[*model.parameters(), x, y]) as live:
            loss = model(x, shift_labels=y).loss
    kept = live.alive_bytes(exclude=[loss])
    loss.backward()
    return kept


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_keeps_less_than_none_and_more_than_full(dtype):
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing

    base = tiny_gpt()
    kept = {"none": kept_bytes(copy.deepcopy(base), dtype)}
    for mode in ("selective", "full"):
        kept[mode] = kept_bytes(apply_activation_checkpointing(copy.deepcopy(base), mode), dtype)
    assert kept["full"] < kept["selective"] < kept["none"], kept
    # Selective drops at least the layer norms' and GELU's outputs (>= 4 + 2 of ~16 hidden-sized values per
    # token and block): well over a tenth of what the blocks keep without checkpointing.
    assert kept["selective"] < 0.9 * kept["none"], kept
    # Full keeps one hidden-state per block (its input), plus what lies outside the blocks (embeddings, loss).
    x, _ = batch()
    block_input = x.numel() * SIZES["hidden_size"] * 4  # fp32 residual stream
    assert kept["none"] - kept["full"] > SIZES["num_layers"] * 4 * block_input, kept


def test_saved_tensors_hooks_agree_without_checkpointing():
    """The live-storage count equals what autograd saves when nothing is checkpointed (the cross-check)."""
    model = tiny_gpt()
    x, y = batch()
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    from dufu.parallel.activation_checkpoint import LiveActivations

    with LiveActivations(exclude=[*model.parameters(), x, y]) as live, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, shift_labels=y).loss
    assert live.alive_bytes(exclude=[loss]) == sum(saved.values()) > 0


def test_names_unchanged_and_copies_are_independent():
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing, checkpoint_mode

    plain = tiny_gpt()
    model = apply_activation_checkpointing(copy.deepcopy(plain), "selective")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(checkpoint_mode(b) == "selective" for b in model.blocks.values())
    twin = copy.deepcopy(model)  # its forward must run the copy's own weights
    with torch.no_grad():
        twin.blocks["0"].mlp.fc1.weight.mul_(2)
    x, y = batch()
    model(x, shift_labels=y).loss.backward()
    assert twin.blocks["0"].mlp.fc1.weight.grad is None and model.blocks["0"].mlp.fc1.weight.grad is not None


def test_inference_runs_without_checkpointing_and_gives_the_same_logits():
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing

    plain = tiny_gpt().eval()
    model = apply_activation_checkpointing(copy.deepcopy(plain), "selective").eval()
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)


def test_bad_input_is_a_clear_error():
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing

    with pytest.raises(ValueError, match="'selective'.*'full'"):
        apply_activation_checkpointing(tiny_gpt(), "partial")
    model = apply_activation_checkpointing(tiny_gpt(), "full")
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(model, "selective")
    with pytest.raises(ValueError, match="no transformer block.*layer_idx"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(4, 4)), "full")


# ------------------------------------------------------------------------------------------ two processes


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2", "dp2-zero3"])
def test_selective_matches_one_process_on_two_ranks(layout, selective_checkpointing_runs):
    out = selective_checkpointing_runs(f"{layout}:selective")
    for rank in (0, 1):
        err = json.loads((out / f"rank_{rank}.json").read_text())
        assert err["checkpointed_blocks"] == SIZES["num_layers"], err
        assert err["loss"] < 1e-5 and err["grad_mismatch"] == [], err


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def worker(out: Path, layout: str, mode: str, compiled: bool = False) -> None:
    """One case, in the started process group: each rank writes ``out/rank_R.json``."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing, checkpoint_mode
    from dufu.parallel.parallelize import parallelize

    rank = dist.get_rank()
    dp, tp = {"tp2": (1, 2), "dp2-zero3": (2, 1)}[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
    ref = tiny_gpt(tie_word_embeddings=False)
    model = apply_activation_checkpointing(copy.deepcopy(ref), mode)
    if compiled:  # what parallelize's compile step does, with dufu's compile cache
        from dufu.parallel.compile import apply_compile

        apply_compile(model)
    parallelize(model, mesh, tensor_parallel=tp > 1, data_parallel=dp > 1, zero_stage=3 if dp > 1 else None)

    x, y = batch(8)
    ref_loss = ref(x, shift_labels=y).loss
    ref_loss.backward()
    rows = slice(rank * 4, rank * 4 + 4) if dp > 1 else slice(None)  # each data-parallel rank: its half
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        loss = model(x[rows], shift_labels=y[rows]).loss
        loss.backward()
    loss = _full(loss).detach().clone()
    if dp > 1:  # the mean of equal halves' means is the whole batch's mean
        dist.all_reduce(loss)
        loss /= dp
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    rtol = 1e-4 if compiled else 1e-5  # inductor may sum in another order
    # allclose per parameter: some gradients are zero up to roundoff (a key bias cannot change a softmax)
    err = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
           "grad_mismatch": [n for n, p in ref.named_parameters()
                             if not torch.allclose(grads[n], p.grad, rtol=rtol, atol=1e-6)],
           "max_grad_diff": max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()),
           "checkpointed_blocks": sum(checkpoint_mode(b) == mode for b in model.blocks.values())}
    Path(out, f"rank_{rank}.json").write_text(json.dumps(err))


def main(job: Path, cases: list[str]) -> None:
    """The cases in turn (see the module docstring), each writing ``job/CASE/rank_R.json``, through
    tests/launch.py's in_turn."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for launch.py
    from launch import in_turn
    from dufu.parallel.launch import finish_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    def check(case: str) -> None:
        layout, mode, *compiled = case.split(":")
        out = job / case
        out.mkdir(parents=True, exist_ok=True)
        worker(out, layout, mode, compiled=compiled == ["compile"])

    in_turn(job, cases, check)
    finish_distributed()  # not destroy_process_group: its gloo teardown can abort a finished rank


if __name__ == "__main__":
    main(Path(sys.argv[1].split("=", 1)[1]), sys.argv[2:])
