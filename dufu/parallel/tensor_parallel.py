"""Tensor (and sequence) parallelism from the style each dufu layer declares.

The plan is data read off the model, not written per model family:

=====================================  ===============================================
layer declares                         torch style applied (Megatron-LM terms)
=====================================  ===============================================
``Linear(parallel="col")``             ``ColwiseParallel``   (ColumnParallelLinear)
``Linear(parallel="row")``             ``RowwiseParallel``   (RowParallelLinear); output
                                       sequence-sharded under sequence parallelism
``VocabEmbedding``                     ``RowwiseParallel`` on the table (VocabParallelEmbedding)
``PositionEmbedding``                  replicated; output sliced along the sequence under SP
``nn.Embedding`` with parallel="col"   ``ColwiseParallel``: per-head tables (relative position bias)
norm with ``sequence_parallel=True``   ``SequenceParallel`` (under SP only)
module with                            ``SequenceParallel(sequence_dim=d)``: a replicated
``tensor_parallel_split_dim = d``      weight on an input split along d (per-head norms)
module with ``tensor_parallel_input``  ``PrepareModuleInput``: gather the sequence once
                                       before its column-parallel projections (under SP)
the output head (a col ``Linear``      ``ColwiseParallel`` keeping logits vocab-sharded
with ``is_output_head``)               (``Shard(-1)``) for ``loss_parallel``
=====================================  ===============================================

Sequence parallelism follows Korthikanti et al. 2022: between the tensor-parallel
regions the activations (B, T, C) are split along T, so norms and dropout run on
1/tp of the sequence.

One convention holds for every family: **between modules, activations are plain
tensors** (this rank's part of them); DTensors live only inside a module's style.
Every style here returns a local tensor (the output head excepted: its
vocabulary-sharded logits go to ``loss_parallel``). So a block may add any two of
its activations — pre-norm ``x + attn(norm(x))`` (GPT, LLaMA) and post-norm
``norm(x + attn(x))`` (BERT) alike — and a pipeline stage passes a plain tensor.
Under sequence parallelism the block's tensors are therefore sequence shards
(B, T/tp, C): whatever needs the whole sequence (its length, rotary angles of
the positions, the first token) belongs in a module that declares
``tensor_parallel_input = "replicate"`` (attention, MLP, poolers), whose input
is gathered first.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dufu.delta.lora import LoraColwiseParallel, LoraLinear, LoraRowwiseParallel
from dufu.delta.prefix import ShardHeads
from dufu.errors import LayoutError
from dufu.layers.embedding import PositionEmbedding, VocabEmbedding
from dufu.layers.linear import Linear
from dufu.models.base import contract_of


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False, head: nn.Module | None = None) -> dict:
    """The {module name: ParallelStyle} plan for ``model``, from the styles its layers declare."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    lora_names: list[str] = []
    replicated: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(n + ".") for n in replicated):
            continue  # the root, or inside a replicated module
        if getattr(module, "tensor_parallel_replicated", False):
            replicated.append(name)
            if sequence_parallel:
                plan[name] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            continue
        lora = isinstance(module, LoraLinear)  # its factors follow the layer's split (dufu.delta.lora)
        col, row = (LoraColwiseParallel, LoraRowwiseParallel) if lora else (ColwiseParallel, RowwiseParallel)
        if any(name.startswith(n + ".") for n in lora_names):
            continue  # a LoRA factor: placed by its layer's style
        if lora:
            lora_names.append(name)
        if getattr(module, "tensor_parallel_heads", False):  # a prefix-tuning prefix: split by heads
            plan[name] = ShardHeads()
            continue
        if module is head:
            plan[name] = col(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        elif isinstance(module, Linear):
            if module.parallel == "col":
                plan[name] = col()
            elif module.parallel == "row":
                plan[name] = row(output_layouts=seq)
            elif lora and sequence_parallel:
                # replicated factors fed this rank's tokens would need their gradients summed over the group
                raise LayoutError(
                    f"LoRA on {name}, a layer replicated under tensor parallelism (parallel='data'), does not "
                    "combine with sequence parallelism; leave it out of delta.targets or set "
                    "train.dist.sequence_parallel=False")
        elif isinstance(module, nn.Embedding) and getattr(module, "parallel", None) == "col":
            # a table whose columns are per-head values (T5's relative attention bias): split by head
            plan[name] = ColwiseParallel()
        elif isinstance(module, VocabEmbedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif isinstance(module, PositionEmbedding) and sequence_parallel:
            plan[name] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            )
        elif getattr(module, "tensor_parallel_split_dim", None) is not None:
            # a replicated weight applied to an input split along that dim over the group (a per-head norm,
            # dufu.layers.attention.HeadRMSNorm: dim 1 = heads), with or without sequence parallelism: torch's
            # SequenceParallel style is exactly that, and DTensor sums the weight's gradient over the group
            plan[name] = SequenceParallel(sequence_dim=module.tensor_parallel_split_dim, use_local_output=True)
        elif sequence_parallel and getattr(module, "sequence_parallel", False):
            plan[name] = SequenceParallel(use_local_output=True)  # local output: see the convention above
        elif sequence_parallel and getattr(module, "tensor_parallel_input", None) == "replicate":
            plan[name] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` in place. Tied input/output embeddings stay tied."""
    declared = contract_of(model)
    head, wte = declared.output_head(), declared.token_embedding()
    tied = head is not None and wte is not None and head.weight is wte.weight
    plan = tensor_parallel_plan(model, sequence_parallel, head=head)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # a delta run's frozen base
    parallelize_module(model, tp_mesh, plan)
    for n, p in model.named_parameters():  # SequenceParallel makes new Parameters that require grad
        if n in frozen:
            p.requires_grad_(False)
    if sequence_parallel:  # prompt tuning's hooks regather the sequence over this group (dufu.delta.prompt)
        for m in model.modules():
            if hasattr(m, "delta_prompt") or hasattr(m, "delta_prompt_tokens"):
                m.sp_mesh = tp_mesh
    if tied:
        # Both styles split the (vocab, hidden) table along the vocabulary (Shard(0)), so the
        # embedding's sharded parameter serves the head unchanged.
        head.weight = wte.weight
    return model
