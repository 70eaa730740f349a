"""The ``delta`` section of a config: what to add to a model and what of it trains.

A recipe writes, LazyCall like every other section::

    delta = L(LoRA)(targets=["q_proj", "v_proj"], rank=8, alpha=16)
    delta = [L(LoRA)(targets=["q_proj", "v_proj"], rank=8), L(BitFit)()]     # several at once
    delta = L(Freeze)(freeze=["wte", "blocks.0.*"])                           # plain partial fine-tuning

:func:`apply_delta` runs on the freshly built single-device model (on the meta device in a run), before any
pipeline split or sharding, and changes no model code. Then the base is frozen: only the parameters a delta
adds (LoRA factors), or selects (BitFit's biases, ``unfreeze`` patterns) train. ``Freeze`` alone keeps the
base trainable except its ``freeze`` patterns. ``freeze`` always wins.

Target patterns follow PEFT's ``target_modules`` (so its adapter configs carry over): a list of names matches
every module whose name equals one or ends with ``.<name>``; shell-style wildcards (``blocks.*.attn.q_proj``)
are allowed; a single string is a regular expression the whole module name must match.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

from torch import nn

from dufu.delta.adapters import add_adapter
from dufu.delta.lora import add_lora, can_carry_lora, init_dora_magnitudes
from dufu.delta.prefix import add_prefix
from dufu.delta.prompt import add_prompt
from dufu.errors import ConfigError
from dufu.layers.attention import Attention
from dufu.models.base import contract_of

Patterns = Union[str, Sequence[str], None]


def matches(name: str, patterns: Patterns) -> bool:
    """Whether module/parameter ``name`` matches ``patterns`` (see the module docstring)."""
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    for p in patterns:
        if name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p):
            return True
    return False


def _no_match(what: str, patterns: Patterns, names: Iterable[str]) -> ConfigError:
    names = list(names)
    wanted = [patterns] if isinstance(patterns, str) else list(patterns)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    close = sorted({c for p in wanted for c in difflib.get_close_matches(str(p).rsplit(".", 1)[-1], leaves, n=4,
                                                                          cutoff=0.4)})
    hint = f" Closest module names: {', '.join(close)}." if close else ""
    return ConfigError(f"{what} {patterns!r} matches no module of the model.{hint} Module names end in: "
                       f"{', '.join(leaves[:40])}{' ...' if len(leaves) > 40 else ''}.")


@dataclass
class LoRA:
    """Low-rank adapters beside the targeted linear layers. ``alpha``: the scaling numerator (PEFT's
    ``lora_alpha``; default = rank, so s = 1). ``rslora``: s = alpha / sqrt(rank)."""

    adds_parameters = True  # creates parameters no base checkpoint holds

    targets: Patterns = ("q_proj", "v_proj")
    rank: int = 8
    alpha: Optional[float] = None
    dropout: float = 0.0
    rslora: bool = False
    exclude: Patterns = None
    dora: bool = False  # weight-decomposed LoRA (Liu et al. 2024; PEFT's use_dora)
    freezes_base: bool = field(default=True, init=False)

    def apply(self, model: nn.Module) -> list[str]:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"delta LoRA rank = {self.rank!r}: use a positive integer (typical: 4 to 64)")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"delta LoRA dropout = {self.dropout!r}: use a probability in [0, 1)")
        head = contract_of(model).output_head()
        chosen = [(n, m) for n, m in model.named_modules()
                  if n and matches(n, self.targets) and not matches(n, self.exclude)]
        if not chosen:
            raise _no_match("delta LoRA targets", self.targets, (n for n, _ in model.named_modules() if n))
        names = []
        for n, m in chosen:
            if not can_carry_lora(m):
                raise ConfigError(f"delta LoRA target {n!r} is a {type(m).__name__}; LoRA applies to linear layers. "
                                  "Narrow delta.targets (e.g. to the attention projections).")
            if m is head and contract_of(model).fused_loss:
                raise ConfigError("delta LoRA on the output head does not combine with model.fused_loss=True (the "
                                  "fused loss reads the head's weight directly); set model.fused_loss=False.")
            try:
                add_lora(m, self.rank, float(self.alpha if self.alpha is not None else self.rank),
                         float(self.dropout), bool(self.rslora), bool(self.dora))
            except ValueError as e:
                raise ConfigError(f"delta LoRA on {n!r}: {e}") from None
            names += [f"{n}.lora_A.weight", f"{n}.lora_B.weight"]
            names += [f"{n}.lora_magnitude_vector.weight"] if self.dora else []
        return names


@dataclass
class Adapter:
    """Bottleneck adapters on the outputs of the ``targets`` sublayers (:mod:`dufu.delta.adapters`).
    ``placement``: "houlsby" (default targets: each block's attention and MLP) or "pfeiffer" (the MLP only).
    ``bottleneck``: the inner width (default hidden_size // ``reduction_factor``)."""

    adds_parameters = True  # creates parameters no base checkpoint holds

    placement: str = "houlsby"
    targets: Patterns = None
    bottleneck: Optional[int] = None
    reduction_factor: int = 16
    activation: str = "relu"
    hidden_size: Optional[int] = None
    freezes_base: bool = field(default=True, init=False)

    PLACEMENTS = {"houlsby": ("attn", "attention", "self_attn", "mlp"), "pfeiffer": ("mlp",)}

    def apply(self, model: nn.Module) -> list[str]:
        if self.placement not in self.PLACEMENTS:
            raise ConfigError(f"delta Adapter placement {self.placement!r}: use 'houlsby' or 'pfeiffer'")
        hidden = self.hidden_size or contract_of(model).hidden_size
        if not isinstance(hidden, int):
            raise ConfigError("delta Adapter: the model has no hidden_size attribute; set delta hidden_size=...")
        size = self.bottleneck or max(1, hidden // self.reduction_factor)
        targets = self.targets if self.targets is not None else list(self.PLACEMENTS[self.placement])
        blocks = {n for n, _ in _blocks(model)}
        chosen = [(n, m) for n, m in model.named_modules()
                  if n and matches(n, targets) and (self.targets is not None or n.rsplit(".", 1)[0] in blocks)]
        if not chosen:
            raise _no_match("delta Adapter targets", targets, (n for n, _ in model.named_modules() if n))
        names = []
        for n, m in chosen:
            try:
                add_adapter(m, hidden, size, self.activation)
            except ValueError as e:
                raise ConfigError(f"delta Adapter on {n!r}: {e}") from None
            names += [f"{n}.delta_adapter.{w}" for w in ("down_weight", "down_bias", "up_weight", "up_bias")]
        return names


@dataclass
class PrefixTuning:
    """Learned keys and values before every self-attention's own (:mod:`dufu.delta.prefix`), in the blocks'
    attention modules (or the ``targets``)."""

    adds_parameters = True  # creates parameters no base checkpoint holds

    num_virtual_tokens: int = 16
    targets: Patterns = None
    freezes_base: bool = field(default=True, init=False)

    def apply(self, model: nn.Module) -> list[str]:
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens < 1:
            raise ConfigError(f"delta PrefixTuning num_virtual_tokens = {self.num_virtual_tokens!r}: use a positive "
                              "integer (typical: 8 to 64)")
        blocks = [n for n, _ in _blocks(model)]
        chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, Attention) and (
            matches(n, self.targets) if self.targets is not None
            else any(n.startswith(b + ".") for b in blocks) and not n.endswith("cross_attn"))]
        if not chosen:
            raise _no_match("delta PrefixTuning targets", self.targets or ["attention"],
                            (n for n, _ in model.named_modules() if n))
        for n, m in chosen:
            add_prefix(m, self.num_virtual_tokens)
        return [f"{n}.delta_prefix.{w}" for n, _ in chosen for w in ("key", "value")]


@dataclass
class PromptTuning:
    """Learned virtual tokens in front of the sequence (:mod:`dufu.delta.prompt`); decoder-only models."""

    adds_parameters = True  # creates parameters no base checkpoint holds

    num_virtual_tokens: int = 16
    init_std: float = 0.02
    freezes_base: bool = field(default=True, init=False)

    def apply(self, model: nn.Module) -> list[str]:
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens < 1:
            raise ConfigError(f"delta PromptTuning num_virtual_tokens = {self.num_virtual_tokens!r}: use a positive "
                              "integer (typical: 8 to 100)")
        blocks = _blocks(model) if contract_of(model).pipeline_layout is not None else []
        containers = {n.rsplit(".", 1)[0] for n, _ in blocks}
        causal = blocks and all(m.causal for _, b in blocks for m in b.modules() if isinstance(m, Attention))
        if not blocks or len(containers) != 1 or not causal:
            raise ConfigError(f"delta PromptTuning applies to decoder-only models (GPT, LLaMA families); "
                              f"{type(model).__name__} is not one. Use PrefixTuning, LoRA or adapters for it.")
        hidden = contract_of(model).hidden_size
        (first, first_block), (_, last_block) = blocks[0], blocks[-1]
        add_prompt(first_block, last_block, self.num_virtual_tokens, hidden)
        first_block.delta_prompt.std = float(self.init_std)
        return [f"{first}.delta_prompt.weight"]


def _blocks(model: nn.Module):
    """The transformer blocks in order (the ``pipeline_layout`` every family declares: one block container, or an
    encoder's then a decoder's): their sublayers are where adapters go by default."""
    layout = contract_of(model).pipeline_layout
    if layout is None:  # a model without a block layout: every module counts
        return list(model.named_modules())
    containers = [layout["blocks"]] if isinstance(layout["blocks"], str) else list(layout["blocks"])
    return [(f"{c}.{k}", m) for c in containers for k, m in model.get_submodule(c).items()]


@dataclass
class BitFit:
    """Train the biases only (Ben Zaken et al. 2021); ``targets`` narrows which modules' biases (default all)."""

    adds_parameters = False  # selects parameters the base has

    targets: Patterns = None
    freezes_base: bool = field(default=True, init=False)

    def apply(self, model: nn.Module) -> list[str]:
        names = [n for n, _ in model.named_parameters() if n.endswith("bias")
                 and (self.targets is None or matches(n.rsplit(".", 1)[0], self.targets))]
        if not names:
            raise ConfigError("delta BitFit found no bias to train" + (f" in modules {self.targets!r}" if self.targets
                              else ": this model's layers have none (LLaMA's have no biases); use LoRA instead"))
        return names


@dataclass
class Freeze:
    """Partial fine-tuning: ``freeze`` patterns (module or parameter names; a module covers all it contains)
    stop training; ``unfreeze`` patterns train even where another delta froze the base (e.g. a new
    classification head beside LoRA)."""

    adds_parameters = False  # selects parameters the base has

    freeze: Patterns = None
    unfreeze: Patterns = None
    freezes_base: bool = field(default=False, init=False)

    def apply(self, model: nn.Module) -> list[str]:
        return []


@dataclass
class DeltaInfo:
    """What :func:`apply_delta` did: the trainable parameter names and the counts for the summary."""

    kinds: list[str]
    trainable: list[str]
    trainable_count: int
    total_count: int
    added: list[str] = field(default_factory=list)  # parameters the delta created (not in any base checkpoint)

    def summary(self) -> str:
        share = 100.0 * self.trainable_count / max(1, self.total_count)
        return (f"{' + '.join(self.kinds)}: {self.trainable_count:,} of {self.total_count:,} parameters train "
                f"({share:.2f}%); the rest is frozen")


def _specs(delta) -> list:
    specs = list(delta) if isinstance(delta, (list, tuple)) else [delta]
    for s in specs:
        if not callable(getattr(s, "apply", None)):
            raise ConfigError(f"delta: {s!r} is not a delta (LoRA, BitFit, Freeze from dufu.delta)")
    return specs


def apply_delta(model: nn.Module, delta) -> Optional[DeltaInfo]:
    """Apply the config's ``delta`` (one spec, a list of them, or None) to ``model`` in place and set each
    parameter's ``requires_grad``; returns what trains (also kept as ``model.delta_info``)."""
    if delta is None:
        return None
    specs = _specs(delta)
    selected: list[str] = []
    added: list[str] = []
    for s in specs:
        names = s.apply(model)
        selected += names
        added += names if s.adds_parameters else []
    freezes_base = any(s.freezes_base for s in specs)
    unfreeze = [p for s in specs if isinstance(s, Freeze) for p in _as_list(s.unfreeze)]
    freeze = [p for s in specs if isinstance(s, Freeze) for p in _as_list(s.freeze)]
    for what, pats in (("delta Freeze unfreeze", unfreeze), ("delta Freeze freeze", freeze)):
        for p in pats:
            if not any(_covers(n, [p]) for n, _ in model.named_parameters()):
                raise _no_match(what, [p], (n for n, _ in model.named_modules() if n))
    chosen = set(selected)
    trainable = []
    total = trainable_count = 0
    seen = set()
    for n, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        train = n in chosen or not freezes_base or (bool(unfreeze) and _covers(n, unfreeze))
        if freeze and _covers(n, freeze):
            train = False
        p.requires_grad_(train)
        total += p.numel()
        if train:
            trainable.append(n)
            trainable_count += p.numel()
    if not trainable:
        raise ConfigError("delta leaves no parameter to train: check delta's targets and freeze patterns")
    info = DeltaInfo([type(s).__name__ for s in specs], trainable, trainable_count, total, added)
    model.delta_info = info
    if any(p.device.type != "meta" for p in model.parameters()):  # a model with values: DoRA's magnitudes now
        init_dora_magnitudes([model])
    return info


def _covers(param: str, patterns: list) -> bool:
    """Whether a parameter or any module it sits in (every prefix of its name) matches ``patterns``."""
    parts = param.split(".")
    return any(matches(".".join(parts[:i]), patterns) for i in range(1, len(parts) + 1))


def _as_list(p: Patterns) -> list:
    if p is None:
        return []
    return [p] if isinstance(p, str) else list(p)


def restore_requires_grad(model: nn.Module, trainable: Iterable[str]) -> None:
    """Set ``requires_grad`` from the trainable names again (after a step that made new parameters)."""
    keep = set(trainable)
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
