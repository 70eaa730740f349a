"""What the optimizer holds per parameter and what its step allocates, by kind (``Setup.optimizer``, read from the
config's ``optim._target_``): AdamW (and anything unknown), SGD with or without momentum, and Muon
(:mod:`dufu.optim.muon`), whose hidden matrices keep one momentum buffer and are orthogonalised whole at the step.
"""

from __future__ import annotations

from dufu.plan.layout import Layout, Setup
from dufu.plan.shapes import ModelInfo


def muon_elems(info: ModelInfo, parts: list[int], tp: int, ep: int = 1) -> tuple[float, float]:
    """(elements, of those the MoE experts') of the matrices Muon updates a rank holding ``parts`` has before ZeRO
    (a ``1 / tp`` share of those tensor parallelism splits, ``1 / ep`` of the experts')."""
    elems = experts = 0.0
    for p in parts:
        part = info.parts[p]
        elems += part.muon - part.muon_tp_split + part.muon_tp_split / tp
        if part.muon_experts and ep > 1:
            elems -= part.muon_experts - part.muon_experts / ep
        experts += part.muon_experts / ep
    return elems, experts


def optimizer_state(info: ModelInfo, parts: list[int], layout: Layout, setup: Setup, trained: float,
                    trained_experts: float) -> list[tuple[float, float, float]]:
    """The optimizer state of the ``trained`` elements a rank holds (``trained_experts`` of them MoE experts'), as
    [(bytes per element, elements, of those the experts')]: AdamW's two fp32 moments (8 B); Muon's one momentum
    buffer (4 B) for its matrices, AdamW's for the rest; SGD's momentum buffer (4 B, none without momentum). The
    caller shards them like the parameters under ZeRO (:func:`dufu.plan.memory.owned`)."""
    kind = getattr(setup, "optimizer", "adamw")
    if kind == "sgd":
        return [(4.0 if setup.sgd_momentum else 0.0, trained, trained_experts)]
    if kind == "muon":
        muon, muon_experts = muon_elems(info, parts, layout.tensor_parallel_size, layout.expert_parallel_size)
        return [(8.0, trained - muon, trained_experts - muon_experts), (4.0, muon, muon_experts)]
    return [(8.0, trained, trained_experts)]


# Muon's step on its largest matrix (fp32, whole on every rank: gathered when sharded): the update, its normalised
# copy, the Gram matrix and polynomial (A x A, A <= B) and the next iterate, about 5 matrices' worth
# (dufu.optim.muon.zeropower_via_newtonschulz)
MUON_STEP_BYTES = 20.0


def optimizer_step_temporaries(info: ModelInfo, parts: list[int], setup: Setup) -> float:
    """Bytes the optimizer step allocates for a moment: Muon's Newton-Schulz iteration of its largest matrix."""
    if getattr(setup, "optimizer", "adamw") != "muon":
        return 0.0
    largest = max((a * b for p in parts for a, b in info.parts[p].muon_shapes), default=0)
    return MUON_STEP_BYTES * largest
