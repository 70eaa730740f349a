"""Worker of test_zero_units.py: the FSDP units of ZeRO stages on 2 ranks, and the tied head's sharded copy.

    torchrun --nproc-per-node 2 tests/parallel/zero_units_worker.py train.output_dir=JOB STAGE [STAGE ...]

Each rank builds the tiny GPT (tied embedding/head) on the meta device, applies ZeRO ``STAGE`` through
``parallelize`` and materialises it; it also builds the same model on one device. Both ranks feed the same
batch, so the averaged gradients equal the single-device ones. While the backward pass reaches the first block
it records what is gathered and which gradients exist; after one AdamW step and a second forward it compares
parameters, gradients and logits with the single-device model (also after two forwards without gradients and a
second step), and writes what it saw to JOB/STAGE/rank_R.json. The stages run in turn in one job (tests/launch.py's
run_in_turn: ``JOB/.done/STAGE`` when every rank has finished one, the first failure ends the job).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dufu.parallel.launch import finish_distributed
from dufu.models.gpt import GPTModel
from dufu.parallel.grads import sync_tied_gradients, tied_parameters
from dufu.parallel.materialize import materialize_
from dufu.parallel.parallelize import parallelize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for launch.py
from launch import in_turn  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered(p) -> bool:
    """A parameter FSDP has gathered is a plain tensor of the full shape; a resting one is a sharded DTensor."""
    return not isinstance(p, DTensor)


def main(job: Path, stages: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def check(stage: str) -> None:
        out = job / stage
        out.mkdir(parents=True, exist_ok=True)
        check_stage(out, int(stage), rank)

    in_turn(job, stages, check)
    finish_distributed()  # not destroy_process_group: its gloo teardown can abort a finished rank


def check_stage(out: Path, stage: int, rank: int) -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data", "tensor"))
    with torch.device("meta"):
        model = GPTModel(**SIZES)
    parallelize(model, mesh, zero_stage=stage)
    materialize_(model, model, torch.device("cpu"), seed=5)
    with torch.device("meta"):
        ref = GPTModel(**SIZES)
    materialize_(ref, ref, torch.device("cpu"), seed=5)

    seen = {}

    def at_first_block(module, grad_output):
        if "wte_gathered" in seen:
            return  # the first backward only
        seen["wte_gathered"] = gathered(model.wte.weight)
        seen["head_gathered"] = gathered(model.lm_head.weight)
        seen["block1_gathered"] = gathered(model.blocks["1"].attn.q_proj.weight)
        seen["head_grad_reduced"] = isinstance(model.lm_head.weight.grad, DTensor)
        seen["wte_grad"] = model.wte.weight.grad is not None

    model.blocks["0"].register_full_backward_pre_hook(at_first_block)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=g)
    labels = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=g)

    loss = model(ids, shift_labels=labels).loss
    seen["after_forward"] = {"wte_gathered": gathered(model.wte.weight),
                             "block0_gathered": gathered(model.blocks["0"].attn.q_proj.weight),
                             "head_gathered": gathered(model.lm_head.weight)}
    loss.backward()
    ref_loss = ref(ids, shift_labels=labels).loss
    ref_loss.backward()
    copies, tied = tied_parameters([model])
    sync_tied_gradients(tied, None)
    seen["tie"] = {"untied": model.lm_head.weight is not model.wte.weight, "copies": len(copies), "tied": len(tied),
                   "copy_grad_dropped": model.lm_head.weight.grad is None}
    errors = {"loss": abs(loss.item() - ref_loss.item())}
    ref_params = dict(ref.named_parameters())
    errors["grad"] = max((full(p.grad) - ref_params[n].grad).abs().max().item()
                         for n, p in model.named_parameters() if p.grad is not None)

    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt.step()
    ref_opt.step()
    errors["param"] = max((full(p) - ref_params[n]).abs().max().item()
                          for n, p in model.named_parameters() if n != "lm_head.weight")
    state = model.state_dict()  # the copy takes the embedding's values first
    errors["state_dict_copy"] = (full(state["lm_head.weight"]) - ref.wte.weight).abs().max().item()
    with torch.no_grad():  # twice, as evaluation does: the head unit stays gathered in between
        errors["logits"] = max((model(ids).logits - ref(ids).logits).abs().max().item() for _ in range(2))
    # A second training step after that: the copy follows the embedding's first update.
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    model(ids, shift_labels=labels).loss.backward()
    ref(ids, shift_labels=labels).loss.backward()
    sync_tied_gradients(tied, None)
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        errors["second_step_logits"] = (model(ids).logits - ref(ids).logits).abs().max().item()
    seen["errors"] = errors
    (out / f"rank_{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1].split("=", 1)[1]), sys.argv[2:])
