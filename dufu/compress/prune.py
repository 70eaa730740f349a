"""Structured pruning: remove the least important attention heads and feed-forward neurons and rebuild the
model as a smaller model of its own family.

In the line of Michel et al. 2019 ("Are Sixteen Heads Really Better than One?"), BMCook and LLM-Pruner
(Ma et al. 2023): each head (a key/value group under grouped-query attention) and each feed-forward neuron gets
an importance score (:mod:`dufu.compress.prune_importance`), every block keeps the same number of the top-scored
ones, and the kept rows and columns of the weights are copied into a model built by the family's own constructor
with the smaller sizes -- ``num_attention_heads`` (and ``num_key_value_heads``) fewer with ``head_dim`` kept,
``ffn_hidden_size`` smaller. The result is a plain model of the family: smaller matrices, so a real speed-up,
not masks; it saves, loads, trains and parallelizes like any other, from the returned constructor arguments.

::

    small, kwargs = prune_model(model, heads_keep=0.5, ffn_keep=0.5)                  # magnitude, data-free
    small, kwargs = prune_model(model, 0.5, 0.5, importance="first-order", batches=[{"input_ids": x,
                                                                                       "labels": x}, ...])

``torch.nn.utils.prune`` only masks single tensors, and no maintained library rebuilds dufu's models smaller,
so the cutting is written here. Reading runs and writing directories is :mod:`dufu.cli.prune`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn

from dufu.compress.prune_families import family_of, mlp_projections
from dufu.compress.prune_importance import IMPORTANCE_KINDS, check_batches, first_order_scores, magnitude_scores
from dufu.errors import ConfigError, DufuError

__all__ = ["PrunePlan", "apply_plan", "count_parameters", "importance_scores", "kept_count", "plan_pruning",
           "prune_model"]


@dataclass
class PrunePlan:
    """What to keep in each block (keyed as ``model.blocks``), indices ascending.

    ``heads``: kept key/value groups -- heads under multi-head attention; under grouped-query attention each
    group is one key/value head with its ``num_heads / num_key_value_heads`` query heads. ``neurons``: kept
    feed-forward neurons. ``head_scores`` / ``neuron_scores``: the importance every unit had (for reports)."""

    heads: dict[str, list[int]]
    neurons: dict[str, list[int]]
    importance: str = "magnitude"
    head_scores: dict[str, list[float]] = field(default_factory=dict, repr=False)
    neuron_scores: dict[str, list[float]] = field(default_factory=dict, repr=False)


def count_parameters(model: nn.Module) -> int:
    """Parameters, a tied tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _check_fraction(name: str, value) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    if not ok:
        raise ConfigError(f"{name}={value!r}: give the fraction to keep, a number in (0, 1] -- 1.0 keeps "
                          "everything, 0.5 half.")
    return float(value)


def kept_count(fraction: float, total: int, name: str, what: str) -> int:
    """How many of ``total`` units per block a kept ``fraction`` leaves: ``floor(fraction * total)``, so the
    result never keeps more than asked. Zero is a ConfigError naming the smallest fraction that keeps one."""
    fraction = _check_fraction(name, fraction)
    kept = math.floor(fraction * total + 1e-9)  # (the epsilon: 0.3 * 10 is 2.9999999999999996 in floating point)
    if kept < 1:
        raise ConfigError(f"{name}={fraction:g} keeps none of the {total} {what} of each layer "
                          f"(floor({fraction:g} x {total}) = 0). Keep at least one: {name} >= {1 / total:.4g}.")
    return kept


def importance_scores(model: nn.Module, importance: str = "magnitude",
                      batches: Optional[Iterable[dict]] = None) -> tuple[dict[str, torch.Tensor],
                                                                        dict[str, torch.Tensor]]:
    """({block key: score per key/value group}, {block key: score per feed-forward neuron})."""
    if importance not in IMPORTANCE_KINDS:
        raise ConfigError(f"importance={importance!r}: expected one of {', '.join(IMPORTANCE_KINDS)} "
                          "(dufu.compress.prune_importance explains both).")
    family_of(model)
    if importance == "magnitude":
        return magnitude_scores(model)
    return first_order_scores(model, batches)


def _top(scores: torch.Tensor, k: int) -> list[int]:
    # A stable sort: among equal scores the lower index is kept, so keeping everything keeps the order.
    order = torch.argsort(scores, descending=True, stable=True)[:k]
    return sorted(order.tolist())


def plan_pruning(model: nn.Module, heads_keep: float = 1.0, ffn_keep: float = 1.0, importance: str = "magnitude",
                 batches: Optional[Iterable[dict]] = None) -> PrunePlan:
    """Score the units and keep the top ``heads_keep`` of the key/value groups and the top ``ffn_keep`` of the
    feed-forward neurons of every block (ranked within the block, the same count in each)."""
    _check_fraction("heads_keep", heads_keep)
    _check_fraction("ffn_keep", ffn_keep)
    if importance == "first-order":
        batches = check_batches(batches)
    family_of(model)
    attn, mlp = next(iter(model.blocks.values())).attn, next(iter(model.blocks.values())).mlp
    nkv, group = attn.num_key_value_heads, attn.num_heads // attn.num_key_value_heads
    what = "heads" if group == 1 else f"key/value groups ({group} query heads + 1 key/value head each)"
    n_groups = kept_count(heads_keep, nkv, "heads_keep", what)
    n_neurons = kept_count(ffn_keep, mlp_projections(mlp)[1].in_features, "ffn_keep", "feed-forward neurons")
    head_scores, neuron_scores = importance_scores(model, importance, batches)
    return PrunePlan(
        heads={k: _top(s, n_groups) for k, s in head_scores.items()},
        neurons={k: _top(s, n_neurons) for k, s in neuron_scores.items()},
        importance=importance,
        head_scores={k: s.tolist() for k, s in head_scores.items()},
        neuron_scores={k: s.tolist() for k, s in neuron_scores.items()},
    )


def _runs(units: list[int], size: int) -> torch.Tensor:
    """The rows (or columns) of units that own ``size`` adjacent ones each: (len(units) * size,)."""
    return torch.cat([torch.arange(u * size, (u + 1) * size) for u in units])


def _check_plan(model: nn.Module, plan: PrunePlan) -> tuple[int, int]:
    """(kept groups, kept neurons) per block; a plan that does not fit ``model`` is a DufuError."""
    keys = list(model.blocks.keys())
    if sorted(plan.heads) != sorted(keys) or sorted(plan.neurons) != sorted(keys):
        raise DufuError(f"the plan names blocks {sorted(plan.heads)} / {sorted(plan.neurons)} but the model has "
                        f"{keys}: make the plan from this model (plan_pruning).")
    counts = set()
    for k, block in model.blocks.items():
        ffn = mlp_projections(block.mlp)[1].in_features
        for kept, total, what in ((plan.heads[k], block.attn.num_key_value_heads, "heads"),
                                  (plan.neurons[k], ffn, "neurons")):
            if not kept or len(set(kept)) != len(kept) or min(kept) < 0 or max(kept) >= total:
                raise DufuError(f"the plan's {what} of block {k} must be distinct indices in [0, {total}) and at "
                                f"least one; got {kept[:8]}{' ...' if len(kept) > 8 else ''}.")
        counts.add((len(plan.heads[k]), len(plan.neurons[k])))
    if len(counts) != 1:
        raise DufuError(f"every block must keep the same number of heads and neurons (so the result is one config "
                        f"of the family); the plan keeps {sorted(counts)}.")
    return counts.pop()


def _cuts(model: nn.Module, plan: PrunePlan) -> dict[str, tuple[int, torch.Tensor]]:
    """{state-dict key: (dim, indices kept along it)} for every tensor pruning shrinks."""
    names = {id(m): n for n, m in model.named_modules()}
    cuts = {}
    for k, block in model.blocks.items():
        a = block.attn
        group = a.num_heads // a.num_key_value_heads
        q_rows = _runs(plan.heads[k], group * a.head_dim)  # the group's query heads are adjacent
        kv_rows = _runs(plan.heads[k], a.head_dim)
        ins, out = mlp_projections(block.mlp)
        neurons = torch.tensor(plan.neurons[k], dtype=torch.long)
        for module, dim, idx in ((a.q_proj, 0, q_rows), (a.k_proj, 0, kv_rows), (a.v_proj, 0, kv_rows),
                                 *((m, 0, neurons) for m in ins)):
            cuts[f"{names[id(module)]}.weight"] = (dim, idx)
            if module.bias is not None:
                cuts[f"{names[id(module)]}.bias"] = (0, idx)
        cuts[f"{names[id(a.out_proj)]}.weight"] = (1, q_rows)  # the output bias stays whole
        cuts[f"{names[id(out)]}.weight"] = (1, neurons)
    return cuts


@torch.no_grad()
def apply_plan(model: nn.Module, plan: PrunePlan) -> tuple[nn.Module, dict]:
    """A new model of ``model``'s class built with the smaller sizes through its constructor, holding the kept
    rows and columns of ``model``'s weights (``model`` is left unchanged), and the constructor's arguments."""
    family = family_of(model)
    n_groups, n_neurons = _check_plan(model, plan)
    attn = next(iter(model.blocks.values())).attn
    kwargs = family.kwargs(model)
    kwargs.update(num_attention_heads=n_groups * (attn.num_heads // attn.num_key_value_heads),
                  head_dim=attn.head_dim, ffn_hidden_size=n_neurons)
    if "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = n_groups

    cuts = _cuts(model, plan)
    state = {}
    for key, value in model.state_dict().items():
        dim, idx = cuts.get(key, (None, None))
        state[key] = value if dim is None else value.index_select(dim, idx.to(value.device))
    params = list(model.parameters())
    dtypes = {p.dtype for p in params}
    # Built on the meta device (no initialisation to throw away), then given storage and the kept values.
    with torch.device("meta"):
        small = type(model)(**kwargs)
    small = small.to_empty(device=params[0].device)
    if len(dtypes) == 1:
        small = small.to(dtype=dtypes.pop())
    small.tie_weights()  # to_empty gave the tied head its own tensor
    small.load_state_dict(state, strict=True)
    buffers = dict(small.named_buffers())
    for name, buf in model.named_buffers():  # also the non-persistent ones (rotary tables), not in state_dict
        buffers[name].copy_(buf)
    flags = dict(model.named_parameters())
    for name, p in small.named_parameters():
        p.requires_grad_(flags[name].requires_grad)
    small.return_dict = model.return_dict
    small.train(model.training)
    return small, kwargs


def prune_model(model: nn.Module, heads_keep: float = 1.0, ffn_keep: float = 1.0, importance: str = "magnitude",
                batches: Optional[Iterable[dict]] = None) -> tuple[nn.Module, dict]:
    """``(smaller model, its constructor kwargs)``: keep the top ``heads_keep`` of every block's heads (key/value
    groups under grouped-query attention) and the top ``ffn_keep`` of its feed-forward neurons, by ``importance``
    ``"magnitude"`` (weight norms, no data) or ``"first-order"`` (Taylor, from ``batches``: a list of dicts of
    model inputs with labels, the model's ``.loss`` is differentiated). GPT, LLaMA / Qwen2 and BERT / RoBERTa
    (with their heads); ``type(model)(**kwargs)`` rebuilds the result's shapes."""
    return apply_plan(model, plan_pruning(model, heads_keep, ffn_keep, importance, batches))
