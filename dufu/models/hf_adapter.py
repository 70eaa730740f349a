"""One declarative shape for every family's Hugging Face mapping (:class:`HFMapping`).

A family states, as data:

* ``names``: a table ``(dufu name, transformers name)``, each side either a tensor name or a module prefix,
  with the layer index as a placeholder: ``("blocks.{i}.ln1", "transformer.h.{i}.ln_1")`` maps
  ``blocks.3.ln1.weight`` to ``transformer.h.3.ln_1.weight``. The first row that matches wins. The
  transformers side may list alternatives ``("lm_head.weight", "transformer.wte.weight")``: the first is
  written, and on load the first one stored is read (a tied head falls back to the embedding).
  ``{prefix}`` on the transformers side is the encoder prefix of models with a head (``bert.``): written as
  ``save_prefix(model)`` gives it, never looked up (``load_renames`` strip it from the stored names);
* ``transforms``: the tensors that are not stored as-is, each a :class:`Transposed` or :class:`Fused` rule
  that works in both directions;
* ``load_renames``: regex rewrites from the names other transformers versions store to the table's names;
* ``config``: an :class:`HFConfigMap`, the config conversion in both directions: a list of
  :class:`ConfigField` rows (constructor kwarg <-> transformers config key, with a default for loading, value
  converters, HF-side alternatives, where export reads the value from a built model), constant keys to
  write, and at most one small named function per direction for what a row cannot say.

Reading is lazy: a tensor stored as-is becomes a :class:`dufu.models.hf_weights.StoredTensor` (so a
tensor-parallel or ZeRO rank reads only its block), a transformed one a zero-argument callable that reads
the whole stored tensor; only the names the given module holds are looked up (a pipeline stage reads its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from dufu.errors import DufuError
from dufu.models.hf_weights import StoredTensor


def _compile(pattern: str) -> re.Pattern:
    """A dufu-side pattern as a regex: ``{name}`` placeholders match integers, and a module prefix matches
    every tensor under it (the remainder is kept in the group ``rest``)."""
    parts = re.split(r"(\{\w+\})", pattern)
    body = "".join(f"(?P<{p[1:-1]}>\\d+)" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(body + r"(?P<rest>\..+)?")


def _alternatives(theirs: str | Sequence[str]) -> tuple[str, ...]:
    return (theirs,) if isinstance(theirs, str) else tuple(theirs)


@dataclass(frozen=True)
class Transposed:
    """``nn.Linear`` weights stored transposed (GPT-2's ``Conv1D`` keeps (in, out)); biases are stored as-is."""

    modules: tuple[str, ...]  # dufu module patterns, named on the transformers side by the table

    def __init__(self, *modules: str):
        object.__setattr__(self, "modules", modules)


@dataclass(frozen=True)
class Fused:
    """Several dufu tensors stored as one transformers tensor, concatenated along ``dim`` (GPT-2's
    ``c_attn`` holds q | k | v); ``transposed``: the fused weight is stored (in, out) as well."""

    parts: tuple[str, ...]  # dufu module patterns, in their order inside the stored tensor
    stored: str             # the transformers module pattern
    dim: int = 0
    transposed: bool = False


@dataclass
class HFMapping:
    model_type: str                                   # transformers' config.model_type
    classes: dict[str, Callable[..., nn.Module]]      # HF architecture name -> dufu class (or factory)
    names: Sequence[tuple[str, str | Sequence[str]]]  # (dufu pattern, transformers pattern or alternatives)
    config: "HFConfigMap"                             # HF config dict <-> constructor kwargs
    transforms: Sequence[Transposed | Fused] = ()
    load_renames: Sequence[tuple[str, str]] = ()      # (regex, replacement) on stored names
    save_prefix: Callable[[nn.Module], str] = lambda model: ""
    also_saved_as: Mapping[str, str] = field(default_factory=dict)  # HF name -> second name of the same tensor
    not_saved: tuple[str, ...] = ()                   # regexes of dufu names with no transformers counterpart
    placeholders: Optional[Callable[[nn.Module, dict], dict]] = None  # more placeholders from {i} (Swin's stage)
    finish_sources: Optional[Callable[[Mapping, nn.Module, dict], dict]] = None  # family rules after the table
    default_architecture: str = ""
    dufu_classes: tuple = ()                          # dufu classes this mapping exports
    tied_head: str = "lm_head.weight"                 # not written when the model ties it to the embedding

    def __post_init__(self):
        self._names = [(_compile(ours), _alternatives(theirs)) for ours, theirs in self.names]
        self._transposed = [_compile(m) for t in self.transforms if isinstance(t, Transposed) for m in t.modules]
        self._fused = [(t, [_compile(p) for p in t.parts]) for t in self.transforms if isinstance(t, Fused)]

    # ------------------------------------------------------------------ config
    def config_from_hf(self, hf: Mapping) -> dict:
        """Constructor keyword arguments from a transformers config dict (read as this mapping's
        model_type when it names none)."""
        return self.config.from_hf({**hf, "model_type": hf.get("model_type", self.model_type)})

    def config_to_hf(self, model: nn.Module) -> dict:
        """The transformers config dict of ``model`` (``architectures`` names its own class when mapped)."""
        name = type(model).__name__
        arch = name if name in self.classes else self.default_architecture
        hf = self.config.to_hf(model, {"architectures": [arch], "model_type": self.model_type})
        heads, head_dim = getattr(model, "num_attention_heads", None), getattr(model, "head_dim", None)
        if heads and head_dim and "head_dim" not in hf and heads * head_dim != getattr(model, "hidden_size", 0):
            # e.g. a pruned GPT-2 or BERT (dufu.compress.prune): fewer heads of the original size
            raise DufuError(f"{name} has {heads} heads of {head_dim} (= {heads * head_dim}), not hidden_size "
                            f"{model.hidden_size}; transformers' {self.model_type} config derives the head size from "
                            "the hidden size, so it cannot describe this model. Keep it as a dufu run/directory.")
        return hf

    # ------------------------------------------------------------------ names
    def _values(self, match: re.Match, model: nn.Module, prefix: str) -> dict:
        values = {k: v for k, v in match.groupdict().items() if k != "rest"}
        if self.placeholders is not None and values:
            values.update(self.placeholders(model, values))
        return {**values, "prefix": prefix}

    def hf_names(self, name: str, model: nn.Module, prefix: str = "") -> Optional[tuple[str, ...]]:
        """The transformers names (alternatives, first = written) of dufu tensor ``name``, or None."""
        for rx, theirs in self._names:
            m = rx.fullmatch(name)
            if m:
                rest = m["rest"] or ""
                values = self._values(m, model, prefix)
                return tuple(t.format(**values) + rest for t in theirs)
        return None

    def _fused_part(self, name: str, model: nn.Module, prefix: str = ""):
        """``(rule, part index, stored name)`` when ``name`` is part of a fused tensor, else None."""
        for rule, parts in self._fused:
            for w, rx in enumerate(parts):
                m = rx.fullmatch(name)
                if m:
                    return rule, w, rule.stored.format(**self._values(m, model, prefix)) + (m["rest"] or "")
        return None

    def _is_transposed(self, name: str) -> bool:
        return name.endswith(".weight") and any(rx.fullmatch(name) for rx in self._transposed)

    # ------------------------------------------------------------------ from transformers
    def tensor_sources(self, hf: Mapping, model: nn.Module) -> dict:
        """For each of ``model``'s tensor names found in ``hf`` (a dict or a lazy mapping of transformers
        tensors): a reader of it. Names ``hf`` lacks are left out, for the caller to report."""
        stored = {}  # the table's name -> the name ``hf`` stores it under
        for key in hf:
            name = key
            for pattern, repl in self.load_renames:
                name = re.sub(pattern, repl, name)
            stored[name] = key
        out = {}
        for name in model.state_dict():
            fused = self._fused_part(name, model)
            if fused is not None:
                rule, w, theirs = fused
                if theirs in stored:
                    out[name] = _fused_reader(hf, stored[theirs], rule, w)
                continue
            theirs = next((t for t in self.hf_names(name, model) or () if t in stored), None)
            if theirs is None:
                continue
            if self._is_transposed(name):
                out[name] = lambda key=stored[theirs]: hf[key].t().contiguous()  # (in, out) -> (out, in)
            else:
                out[name] = StoredTensor(hf, stored[theirs])
        if self.finish_sources is not None:
            out = self.finish_sources(hf, model, out)
        return out

    # ------------------------------------------------------------------ to transformers
    def state_dict_to_hf(self, sd: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """dufu tensors -> the tensors of the transformers class ``model`` exports as."""
        prefix = self.save_prefix(model)
        out, fused = {}, {}
        for name, t in sd.items():
            if any(re.search(p, name) for p in self.not_saved):
                continue
            part = self._fused_part(name, model, prefix)
            if part is not None:
                rule, w, theirs = part
                fused.setdefault(theirs, (rule, {}))[1][w] = t
                continue
            theirs = self.hf_names(name, model, prefix)
            if theirs is None:
                raise DufuError(f"{type(model).__name__} tensor {name!r} has no {self.model_type} name in "
                                "transformers.")
            out[theirs[0]] = t.t().contiguous() if self._is_transposed(name) else t
        for theirs, (rule, parts) in fused.items():
            if len(parts) != len(rule.parts):
                raise DufuError(f"{theirs} fuses {len(rule.parts)} tensors but the state dict holds {len(parts)}.")
            t = torch.cat([parts[w] for w in range(len(rule.parts))], dim=rule.dim)  # e.g. q | k | v: (3C, C)
            out[theirs] = t.t().contiguous() if rule.transposed and t.dim() == 2 else t
        for first, second in self.also_saved_as.items():
            if first in out:
                out[second] = out[first].clone()  # one tensor there, stored under both names
        return out

    def tied_hf_names(self, model: nn.Module) -> list[str]:
        """Names not written because transformers ties them to the embedding on load."""
        if not model.tie_word_embeddings:
            return []
        names = self.hf_names(self.tied_head, model, self.save_prefix(model))
        return [names[0]] if names else []


def _fused_reader(hf: Mapping, key: str, rule: Fused, which: int) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        t = hf[key]
        if rule.transposed and t.dim() == 2:
            t = t.t()  # stored (in, n * out) -> (n * out, in)
        return t.chunk(len(rule.parts), dim=rule.dim)[which].clone(memory_format=torch.contiguous_format)
    return read


# ----------------------------------------------------------------------------- config map
class UnsupportedHFValue(DufuError, ValueError):
    """A transformers config value dufu has no counterpart for (or a required key that is missing)."""


REQUIRED = object()  # a ConfigField default: the transformers config must give the key


def _convert(conv, value, key: str, hint: str):
    """``conv`` applied to ``value``: a table (an unknown value is a clear error naming the known ones), a
    function, or None (as-is)."""
    if conv is None:
        return value
    if isinstance(conv, Mapping):
        if value not in conv:
            raise UnsupportedHFValue(f"{key} {value!r} is not supported{hint}; known: {sorted(conv)}.")
        return conv[value]
    return conv(value)


def rope_parameters(hf: Mapping) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, the scaling's other parameters) of a transformers config, from transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` keys (a legacy ``rope_scaling`` fills in a
    default ``rope_parameters``); each family checks the types it supports."""
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    legacy = hf.get("rope_scaling")  # older configs: rope_theta + rope_scaling
    if legacy and params.get("rope_type", params.get("type", "default")) == "default":
        params = {**params, **legacy}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type") if "rope_type" in params else params.get("type", "default")
    params.pop("type", None)
    return theta, kind, params


def rope_to_hf(theta: float, scaling: Optional[dict]) -> dict:
    """A model's rotary settings (``rope_theta``, ``rope_scaling`` or None) as the three config keys transformers
    reads: ``rope_parameters`` (transformers 5) and the older ``rope_theta`` and ``rope_scaling``."""
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        rope = {**scaling, "rope_theta": theta}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return {"rope_parameters": rope, "rope_theta": theta, "rope_scaling": dict(rope) if scaling else None}


def attribute(model: nn.Module, path: str):
    """``model.a.b.0.c`` for ``path`` "a.b.0.c" (a number names a block of a ModuleDict / ModuleList)."""
    value = model
    for part in path.split("."):
        value = getattr(value, part)
    return value


def in_first_block(path: str, default: Any = None) -> Callable[[nn.Module], Any]:
    """An export function: ``path`` inside the model's first block (``model.blocks``), or ``default`` (a value,
    or a function of the model) for a model without blocks."""
    def read(model: nn.Module):
        blocks = model.blocks
        if not len(blocks):
            return default(model) if callable(default) else default
        return attribute(blocks[next(iter(blocks))], path)
    return read


def square_or_pair(pair) -> int | list:
    """A (height, width) pair as transformers writes it: one number when square, else a list."""
    return pair[0] if pair[0] == pair[1] else list(pair)


def id2label(num_labels: int) -> dict:
    """transformers' default label names for ``num_labels`` classes."""
    return {str(i): f"LABEL_{i}" for i in range(num_labels)}


def label2id(num_labels: int) -> dict:
    return {f"LABEL_{i}": i for i in range(num_labels)}


Converter = Union[None, Mapping, Callable[[Any], Any]]


@dataclass(frozen=True)
class ConfigField:
    """One row of a config map: the constructor kwarg ``ours`` <-> the transformers config key ``theirs``.

    ``theirs`` may list alternatives: the first present is read, the first is written. ``default`` (a dufu-side
    value, or a function of the whole HF dict, e.g. ``4 * n_embd``) applies when none is present, or when the
    value is falsy and ``or_default`` (transformers' ``config.x or default``). ``from_hf`` / ``to_hf``: a table
    (unknown values are an :class:`UnsupportedHFValue`, with ``hint`` appended) or a function. ``export``: where
    a built model keeps the value, an attribute path (default ``ours``) or a function of the model;
    ``optional``: not written when the model lacks that attribute. ``ours=None``: a key only checked on load
    (dufu fixes its value). ``load`` / ``save`` False: a row used in one direction only."""

    ours: Optional[str]
    theirs: str | tuple[str, ...]
    default: Any = REQUIRED
    from_hf: Converter = None
    to_hf: Converter = None
    export: str | Callable[[nn.Module], Any] | None = None
    or_default: bool = False
    optional: bool = False
    load: bool = True
    save: bool = True
    hint: str = ""

    @property
    def keys(self) -> tuple[str, ...]:
        return _alternatives(self.theirs)

    def read(self, hf: Mapping) -> Any:
        for key in self.keys:
            if key in hf and not (self.or_default and not hf[key]):
                return _convert(self.from_hf, hf[key], key, self.hint)
        if self.default is REQUIRED:
            raise UnsupportedHFValue(f"the transformers config has no {' or '.join(self.keys)}, which "
                                     f"{self.ours or 'dufu'} needs.")
        return self.default(hf) if callable(self.default) else self.default

    def write(self, model: nn.Module, out: dict) -> None:
        if callable(self.export):
            value = self.export(model)
        else:
            path = self.export or self.ours
            try:
                value = attribute(model, path)
            except AttributeError:
                if self.optional:
                    return
                raise
        out[self.keys[0]] = _convert(self.to_hf, value, self.keys[0], self.hint)


@dataclass(frozen=True)
class HFConfigMap:
    """A family's config conversion as data: ``fields`` (see :class:`ConfigField`), ``constants`` written as
    given (``torch_dtype`` ...; ``architectures`` and ``model_type`` come from the mapping unless set here),
    and ``more_from_hf`` / ``more_to_hf``: one small named function per direction for the rules a row cannot
    say (checks across keys, one value spread over several keys); their results are merged over the rows'."""

    fields: Sequence[ConfigField]
    constants: Mapping[str, Any] = field(default_factory=dict)
    more_from_hf: Optional[Callable[[Mapping], dict]] = None
    more_to_hf: Optional[Callable[[nn.Module], dict]] = None

    def from_hf(self, hf: Mapping) -> dict:
        kwargs = {}
        for row in self.fields:
            if row.load:
                value = row.read(hf)
                if row.ours is not None:
                    kwargs[row.ours] = value
        if self.more_from_hf is not None:
            kwargs.update(self.more_from_hf(hf))
        return kwargs

    def to_hf(self, model: nn.Module, names: Mapping[str, Any] = ()) -> dict:
        out = dict(names)
        for row in self.fields:
            if row.save:
                row.write(model, out)
        out.update(self.constants)
        if self.more_to_hf is not None:
            out.update(self.more_to_hf(model))
        return out
