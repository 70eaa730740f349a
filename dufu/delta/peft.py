"""PEFT's LoRA adapter files <-> dufu's LoRA (and DoRA) layers, for every family with a Hugging Face mapping.

An adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``: ``peft_type`` LORA, ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules`` ...) and ``adapter_model.safetensors``, keyed by transformers
module paths: ``base_model.model.<module>.lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r), DoRA's
``...lora_magnitude_vector`` (out,), and whole trained modules (``modules_to_save``) under their tensor names.

dufu reads and writes these files itself, not through PEFT's ``LoraModel``: the factors live in
:class:`dufu.delta.lora.LoraLinear`, placed by the layer's tensor-parallel style, so a run never holds PEFT's
wrapped modules; only the file format is PEFT's, and PEFT is not needed at run time.

Names go through the family's :class:`dufu.models.hf_adapter.HFMapping`, the table that converts the weights
(dufu's ``blocks.3.attn.q_proj`` is ``model.layers.3.self_attn.q_proj``). PEFT keeps the factors of a layer
transformers stores transposed (GPT-2's ``Conv1D``) in the same (r, in) / (out, r) layout. A fused layer
(GPT-2's ``c_attn`` = q | k | v along the output) maps exactly on loading: ``s B A x`` is, per part,
``s B_part A x``, so each of dufu's q/k/v gets a copy of A and its rows of B. Writing needs one shared A, rank
and scaling for the parts, as such a load gives; factors trained apart (or LoRA on one part only) would need a
block-structured B, which PEFT's LoRA on ``c_attn`` cannot hold, so that is refused, naming what maps.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dufu.delta.lora import (LoraFactor, LoraMagnitude, add_lora, can_carry_lora, init_dora_magnitudes,
                             lora_layers)
from dufu.delta.spec import DeltaInfo
from dufu.errors import DataError, DufuError
from dufu.layers.linear import Linear
from dufu.models.base import contract_of
from dufu.models.hf_adapter import HFMapping
from dufu.models.hub import adapter_for_model, write_hf_model

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
_FACTORS = (".lora_A.weight", ".lora_B.weight")
_MAGNITUDE = ".lora_magnitude_vector"  # DoRA's (out,) magnitude: PEFT's key; dufu's parameter adds ".weight"
_LORA_PARAMS = (*_FACTORS, _MAGNITUDE + ".weight")
# LoraConfig options that change what the adapter computes, which dufu's LoraLinear does not do.
_UNSUPPORTED = ("lora_bias", "target_parameters", "layer_replication", "trainable_token_indices", "use_qalora",
                "alora_invocation_tokens", "use_bdlora", "arrow_config", "kasa_config", "velora_config",
                "monteclora_config")
# Initialisations that also change the base weights: the adapter then belongs to the modified base.
_BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda")
# The PEFT task type of each kind of architecture (PeftModelFor<task>); None: a plain PeftModel.
_TASKS = (("ForCausalLM", "CAUSAL_LM"), ("LMHeadModel", "CAUSAL_LM"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
          ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"),
          ("ForQuestionAnswering", "QUESTION_ANS"), ("Model", "FEATURE_EXTRACTION"))


@dataclass
class Site:
    """A transformers module with a 2-D weight and the dufu modules behind it (several when fused, in order)."""

    hf: str
    parts: list[str]
    fused_dim: Optional[int] = None
    transposed: bool = False


def sites(model: nn.Module) -> dict[str, Site]:
    """Every module of ``model`` that could carry LoRA, by its transformers module path, in model order."""
    ad = adapter_for_model(model)
    prefix = ad.save_prefix(model) if isinstance(ad, HFMapping) else None
    out: dict[str, Site] = {}
    for name, m in model.named_modules():
        weight = m._parameters.get("weight")
        if not name or weight is None or weight.dim() != 2 or isinstance(m, (LoraFactor, LoraMagnitude)):
            continue
        if prefix is None:  # a transformers model as-is (dufu.models.hf_auto): its own names, under "hf."
            out[name.removeprefix("hf.")] = Site(name.removeprefix("hf."), [name])
            continue
        fused = ad._fused_part(f"{name}.weight", model, prefix)
        if fused is not None:  # (rule, index of this part, the stored tensor's name)
            hf = fused[2][: -len(".weight")]
            out.setdefault(hf, Site(hf, [None] * len(fused[0].parts), fused[0].dim, fused[0].transposed))
            out[hf].parts[fused[1]] = name
            continue
        theirs = ad.hf_names(f"{name}.weight", model, prefix)
        if theirs and theirs[0].endswith(".weight"):
            hf = theirs[0][: -len(".weight")]
            out[hf] = Site(hf, [name], transposed=ad._is_transposed(f"{name}.weight"))
    return {hf: s for hf, s in out.items() if all(p is not None for p in s.parts)}


def _normal(model: nn.Module, hf: str) -> str:
    """A transformers name as the family's table spells it (``bert.`` prefix stripped: any head, or none)."""
    for pattern, repl in adapter_for_model(model).load_renames:
        hf = re.sub(pattern, repl, hf)
    return hf


# ------------------------------------------------------------------------------------------ reading
def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of a PEFT adapter directory."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file():
        raise DataError(f"{path} is not a PEFT adapter directory: it has no {ADAPTER_CONFIG}. Give the directory "
                        "PeftModel.save_pretrained (or dufu.save_pretrained of a model with LoRA) wrote.")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise DataError(f"{path} holds no {ADAPTER_WEIGHTS} (an adapter_model.bin of an old PEFT: load it in PEFT "
                        "and save it again).")
    return json.loads((path / ADAPTER_CONFIG).read_text()), load_file(str(path / ADAPTER_WEIGHTS))


def check_adapter_config(config: dict, where: str = "the adapter") -> None:
    """Refuse, naming them, an adapter type or LoRA options dufu's LoraLinear does not compute."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise DataError(f"{where} is a PEFT {kind!r} adapter; dufu loads LORA adapters only (LoRA and DoRA, "
                        "with or without rank-stabilised scaling use_rslora, rank_pattern / alpha_pattern and "
                        "modules_to_save).")
    bad = [key for key in _UNSUPPORTED if config.get(key)]
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config['bias']!r} (trained biases in the adapter)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        bad.append(f"init_lora_weights={init!r}, which changes the base weights too (convert it to a plain "
                   "LoRA adapter with PEFT's path_initial_model_for_weight_conversion first)")
    if bad:
        raise DataError(f"{where} uses LoRA options dufu does not support: {'; '.join(bad)}. Supported: r, "
                        "lora_alpha, lora_dropout, use_rslora, use_dora, target_modules, exclude_modules, "
                        "layers_to_transform, rank_pattern, alpha_pattern, modules_to_save.")


def _pattern_value(patterns: Optional[dict], hf: str, default):
    """PEFT's per-module ``rank_pattern`` / ``alpha_pattern``: the first key matching the end of the name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", hf):
            return value
    return default


def _targeted(config: dict, hf: str) -> bool:
    """Whether PEFT's ``target_modules`` (with exclude_modules, modules_to_save, layers_to_transform) take
    the transformers module ``hf``."""
    def listed(patterns) -> bool:
        if isinstance(patterns, str):
            return re.fullmatch(patterns, hf) is not None
        return any(hf == p or hf.endswith("." + p) for p in patterns or ())

    if config.get("exclude_modules") and listed(config["exclude_modules"]):
        return False
    if any(re.match(rf"(^|.*\.){m}($|\..*)", hf) for m in config.get("modules_to_save") or ()):
        return False
    if not listed(config.get("target_modules")):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    patterns = [patterns] if isinstance(patterns, str) else patterns
    rules = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in patterns] if patterns else [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    found = next((m for m in (re.match(r, hf) for r in rules) if m), None)
    return found is not None and int(found["idx"]) in ([layers] if isinstance(layers, int) else layers)


def _split_keys(tensors: dict, where: str) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """The file's LoRA tensors by transformers module (A, B and DoRA's m), and the others (modules_to_save)."""
    factors: dict[str, dict] = {}
    extra = {}
    for key, t in tensors.items():
        name = key[len(_KEY_PREFIX):] if key.startswith(_KEY_PREFIX) else key
        kind = "m" if name.endswith(_MAGNITUDE) else name[-len("A.weight")] if name.endswith(_FACTORS) else None
        if kind is not None:
            factors.setdefault(name[: -len(_MAGNITUDE if kind == "m" else ".lora_A.weight")], {})[kind] = t
        elif ".lora_" in name:  # e.g. an embedding's lora_embedding_A
            raise DataError(f"{where} holds {key}: dufu adds LoRA to linear layers only.")
        else:
            extra[name] = t
    return factors, extra


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Add the PEFT LoRA adapter at ``path`` to ``model`` (a materialised single-device dufu model) in place,
    unmerged: every module its ``target_modules`` take becomes a :class:`~dufu.delta.lora.LoraLinear` with its
    rank, alpha and scaling and the file's factors (a targeted module the file lacks starts as PEFT's would, at
    B = 0); ``modules_to_save`` tensors replace the base's; only these train. An adapter that does not fit
    changes nothing: the error names the module and both shapes."""
    where = f"the adapter {path}"
    config, tensors = read_adapter(path)
    check_adapter_config(config, where)
    factors, extra = _split_keys(tensors, where)
    dora, name, table, in_file = bool(config.get("use_dora")), type(model).__name__, sites(model), {}
    normal = {_normal(model, hf): hf for hf in table}
    for module, pair in factors.items():
        if normal.get(_normal(model, module)) is None:
            raise DataError(f"{where} holds LoRA factors for {module}, which {name} does not have (its modules: "
                            f"{', '.join(list(table)[:6])} ...). The adapter belongs to another base model.")
        if set(pair) != ({"A", "B", "m"} if dora else {"A", "B"}):
            raise DataError(f"{where} holds {sorted(pair)} of {module}'s LoRA; use_dora={dora} needs A, B"
                            f"{' and m (lora_magnitude_vector)' if dora else ''}.")
        in_file[normal[_normal(model, module)]] = pair
    target_modules = config.get("target_modules")
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":  # all but the output layer
        config = {**config, "target_modules": [hf for hf, s in table.items() if s.parts != ["lm_head"] and all(
            type(model.get_submodule(p)) in (nn.Linear, Linear) for p in s.parts)]}
    if not any(_targeted(config, hf) for hf in table):
        leaves = ", ".join(sorted({hf.rsplit(".", 1)[-1] for hf in table}))
        raise DataError(f"{where}: target_modules {target_modules!r} match no module of {name}; its modules with "
                        f"weights end in (transformers names) {leaves}.")
    plan = []
    for hf in (hf for hf in table if _targeted(config, hf) or hf in in_file):
        site, pair = table[hf], in_file.get(hf)
        rank = int(_pattern_value(config.get("rank_pattern"), hf, config.get("r", 8)))
        alpha = float(_pattern_value(config.get("alpha_pattern"), hf, config.get("lora_alpha", 8)))
        mods = [model.get_submodule(p) for p in site.parts]
        wrong = next((p for p, m in zip(site.parts, mods) if not can_carry_lora(m)), None)
        if wrong is not None:
            raise DataError(f"{where} targets {hf} (dufu {wrong}), a {type(model.get_submodule(wrong)).__name__}; "
                            "dufu adds LoRA only to linear layers (nn.Linear, dufu Linear) without LoRA yet.")
        outs = [m.weight.shape[0] for m in mods]
        need = {"A": (rank, mods[0].weight.shape[1]), "B": (sum(outs), rank), "m": (sum(outs),)}
        for k in (k for k in pair or () if tuple(pair[k].shape) != need[k]):
            raise DataError(f"{where} does not fit {name}: {hf}'s LoRA {k} has shape {tuple(pair[k].shape)} in the "
                            f"adapter but {need[k]} in the model (dufu {', '.join(site.parts)}: {need['A'][1]} -> "
                            f"{need['B'][0]}, rank {rank} from r / rank_pattern). The adapter belongs to another base "
                            "model.")
        plan.append((site, mods, outs, rank, alpha, pair))
    loaded = _extra_sources(model, extra, where) if extra else {}
    dropout, rslora = float(config.get("lora_dropout") or 0.0), bool(config.get("use_rslora", False))
    added = []
    for site, mods, outs, rank, alpha, pair in plan:
        for part, m in zip(site.parts, mods):
            add_lora(m, rank, alpha, dropout, rslora, dora)
            added += [f"{part}{k}" for k in (_LORA_PARAMS if dora else _FACTORS)]
    own = model.state_dict()
    for k, value in loaded.items():
        own[k].copy_(value)
    init_dora_magnitudes([model])  # PEFT's start, ||W + s B A|| with B = 0, for targets the file lacks
    for site, mods, outs, rank, alpha, pair in (row for row in plan if row[-1] is not None):
        for i, m in enumerate(mods):  # a fused module's parts: the same A, their rows of B and m
            m.lora_A.weight.copy_(pair["A"])
            m.lora_B.weight.copy_(pair["B"].split(outs)[i])  # (out_i, r)
            if dora:
                m.lora_magnitude_vector.weight.copy_(pair["m"].split(outs)[i])  # (out_i,)
    _set_trainable(model, added, list(loaded))
    return model


def _extra_sources(model: nn.Module, extra: dict, where: str) -> dict[str, torch.Tensor]:
    """The dufu tensors that the adapter's other tensors (modules_to_save) fill, read and shape-checked."""
    ad, own = adapter_for_model(model), model.state_dict()

    def sources(tensors: dict) -> dict:
        if isinstance(ad, HFMapping):
            return dataclasses.replace(ad, finish_sources=None).tensor_sources(tensors, model)
        return {f"hf.{k}": v for k, v in tensors.items() if f"hf.{k}" in own}  # as-is: its own names under hf.

    unused = [k for k in extra if not sources({k: extra[k]})]
    if unused:
        raise DataError(f"{where} holds {', '.join(unused[:4])}, which {type(model).__name__} has no place for.")
    out = {name: reader() if callable(reader) else reader for name, reader in sources(extra).items()}
    for name, value in out.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise DataError(f"{where} does not fit {type(model).__name__}: its {name} (modules_to_save) has shape "
                            f"{tuple(value.shape)} but {tuple(own[name].shape)} in the model.")
    return out


def _set_trainable(model: nn.Module, lora: list[str], whole: list[str]) -> DeltaInfo:
    """Only the adapter trains, as after :func:`dufu.delta.apply_delta` (``model.delta_info``)."""
    keep = set(lora) | set(whole)
    params = dict(model.named_parameters())
    for n, p in params.items():
        p.requires_grad_(n in keep)
    trainable = [n for n in params if n in keep]
    model.delta_info = DeltaInfo(["LoRA"], trainable, sum(params[n].numel() for n in trainable),
                                 sum(p.numel() for p in params.values()), lora)
    return model.delta_info


# ------------------------------------------------------------------------------------------ writing
def _short_targets(chosen: set[str], every: set[str]) -> list[str]:
    """``target_modules`` naming exactly ``chosen`` among ``every``: the last one or two name parts when they
    take nothing else (``q_proj``, ``attn.c_proj``), else the full module paths."""
    for depth in (1, 2):
        ends = {".".join(hf.split(".")[-depth:]) for hf in chosen}
        if {hf for hf in every if any(hf == e or hf.endswith("." + e) for e in ends)} == chosen:
            return sorted(ends)
    return sorted(chosen)


def _patterns(values: dict, default) -> dict:
    """PEFT's rank_pattern / alpha_pattern: the modules whose value is not ``default``, named shortly."""
    out = {}
    for v in sorted({v for v in values.values() if v != default}):
        out.update(dict.fromkeys(_short_targets({hf for hf, x in values.items() if x == v}, set(values)), v))
    return out


def _modules_to_save(model: nn.Module, sd: dict) -> tuple[list[str], dict]:
    """The non-LoRA parameters that train, as PEFT's modules_to_save (whole transformers modules) and their
    tensors; a part of a module (BitFit's biases) has no place in the format."""
    ad = adapter_for_model(model)
    info = contract_of(model).delta_info  # None: LoRA layers added by hand, so nothing else trains
    names = {n for n in (info.trainable if info is not None else ()) if not n.endswith(_LORA_PARAMS)}
    tensors = {}
    for n in sorted({n.rsplit(".", 1)[0] for n in names}):
        params = {f"{n}.{p}" for p, _ in model.get_submodule(n).named_parameters()}
        if not params <= names:
            raise DufuError(f"{', '.join(sorted(names & params))} of {n} train while the rest of it is frozen "
                            "(BitFit, partial freezing); a PEFT LoRA adapter holds only LoRA factors and whole "
                            "modules (modules_to_save). Save with merge=True (dufu convert --merge) instead.")
        try:
            hf = ad.state_dict_to_hf({k: sd[k] for k in params}, model)
        except DufuError:  # e.g. one part of a fused tensor
            hf = {}
        if len({k.rsplit(".", 1)[0] for k in hf}) != 1:
            raise DufuError(f"{n} trains as a whole but is not one transformers module; save with merge=True.")
        tensors.update({f"{_KEY_PREFIX}{k}": v for k, v in hf.items()})
    return sorted({k[len(_KEY_PREFIX):].rsplit(".", 1)[0] for k in tensors}), tensors


def adapter_files(model: nn.Module, state_dict: Optional[dict] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of ``model``'s LoRA layers in PEFT's format (``state_dict``: the
    values, e.g. a delta checkpoint's, for a model built on the meta device; default the model's own)."""
    layers = lora_layers(model)
    if not layers:
        raise DufuError(f"{type(model).__name__} carries no LoRA layers: there is no adapter to write.")
    merged = [n for n, m in layers.items() if m.lora_merged]
    if merged:
        raise DufuError(f"the LoRA of {', '.join(merged[:3])} is merged into the weights; unmerge it "
                        "(dufu.delta.merge_lora_(model, unmerge=True)) to write an adapter, or save with merge=True.")
    check_lora_only(model)
    sd = state_dict if state_dict is not None else model.state_dict()
    table = sites(model)
    doras = {getattr(m, "lora_magnitude_vector", None) is not None for m in layers.values()}
    if len(doras) > 1:
        raise DufuError("some LoRA layers are DoRA and some are not; PEFT's use_dora holds for a whole adapter.")
    dora, rows, tensors = doras.pop(), {}, {}
    for hf, site in table.items():
        mods = [layers.get(p) for p in site.parts]
        if not any(mods):
            continue
        if len(mods) > 1:
            _check_fused(model, site, mods, sd)
        rows[hf] = mods[0]
        key = f"{_KEY_PREFIX}{hf}"
        tensors[f"{key}.lora_A.weight"] = sd[f"{site.parts[0]}.lora_A.weight"]                     # (r, in)
        tensors[f"{key}.lora_B.weight"] = torch.cat([sd[f"{p}.lora_B.weight"] for p in site.parts])  # (out, r)
        if dora:
            tensors[f"{key}{_MAGNITUDE}"] = torch.cat([sd[f"{p}{_MAGNITUDE}.weight"] for p in site.parts])  # (out,)
    one_rule = len({m.lora_rslora for m in rows.values()}) == 1
    # PEFT's use_rslora holds for all: where layers differ, alpha carries each one's scaling (scaling * rank)
    alphas = {hf: _plain_number(m.lora_alpha if one_rule else m.lora_scaling * m.lora_rank) for hf, m in rows.items()}
    ranks = {hf: m.lora_rank for hf, m in rows.items()}
    rank, alpha = (Counter(v.values()).most_common(1)[0][0] for v in (ranks, alphas))
    dropouts = Counter(m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for m in rows.values())
    save, whole = _modules_to_save(model, sd)
    arch = adapter_for_model(model).config_to_hf(model)["architectures"][0]
    config = {
        "peft_type": "LORA", "task_type": next((task for end, task in _TASKS if arch.endswith(end)), None),
        "base_model_name_or_path": None, "revision": None, "inference_mode": True,
        "r": rank, "lora_alpha": alpha, "use_rslora": one_rule and next(iter(rows.values())).lora_rslora,
        "use_dora": dora, "lora_dropout": dropouts.most_common(1)[0][0],
        "target_modules": _short_targets(set(rows), set(table)), "exclude_modules": None,
        "rank_pattern": _patterns(ranks, rank), "alpha_pattern": _patterns(alphas, alpha),
        "modules_to_save": save or None, "layers_to_transform": None, "layers_pattern": None,
        "fan_in_fan_out": any(table[hf].transposed for hf in rows),  # GPT-2's Conv1D (only PEFT's merging reads it)
        "bias": "none", "lora_bias": False, "init_lora_weights": True,
    }
    return config, {k: v.detach().cpu().contiguous() for k, v in {**tensors, **whole}.items()}


def check_lora_only(model: nn.Module) -> None:
    """Deltas other than LoRA/DoRA (bottleneck adapters, prefix tuning) exist in neither format."""
    other = sorted({n.split(".delta_", 1)[1].split(".")[0] for n, _ in model.named_parameters() if ".delta_" in n})
    if other:
        kinds = ", ".join({"adapter": "bottleneck adapters"}.get(o, f"{o} tuning") for o in other)
        raise DufuError(f"{type(model).__name__} carries {kinds}, which neither a PEFT LoRA adapter nor a transformers "
                        "model holds; only LoRA and DoRA are written.")


def _plain_number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def _check_fused(model: nn.Module, site: Site, mods: list, sd: dict) -> None:
    names = ", ".join(site.parts)
    why = (f"transformers stores {names} of {type(model).__name__} as one module, {site.hf}, and PEFT's LoRA on it "
           "is one A and one B for all parts: dufu writes it when every part carries LoRA of one rank and scaling "
           "with the same A (as loading such an adapter gives). Here ")
    fix = (f", which would need a block-structured B on {site.hf}. Save with merge=True, or target layers "
           "transformers keeps apart (e.g. GPT-2's out_proj, fc1, fc2).")
    if not all(mods):
        raise DufuError(why + f"only {', '.join(p for p, m in zip(site.parts, mods) if m)} carry LoRA" + fix)
    same = len({(m.lora_rank, m.lora_scaling) for m in mods}) == 1 and site.fused_dim == 0
    a0 = sd[f"{site.parts[0]}.lora_A.weight"]
    if not same or not all(torch.equal(a0, sd[f"{p}.lora_A.weight"]) for p in site.parts[1:]):
        raise DufuError(why + "their ranks, scalings or A factors differ (trained apart: A_q != A_k)" + fix)


def base_state_dict(model: nn.Module, state_dict: Optional[dict] = None) -> dict:
    """The base model's tensors of a model carrying LoRA: its state dict without the factors."""
    sd = state_dict if state_dict is not None else model.state_dict()
    if any(m.lora_merged for m in lora_layers(model).values()):
        raise DufuError("the LoRA layers are merged into the weights; unmerge them first to write the base.")
    return {k: v for k, v in sd.items() if not k.endswith(_LORA_PARAMS)}


def merged_state_dict(model: nn.Module, state_dict: Optional[dict] = None) -> dict:
    """The model's tensors with every LoRA update folded in (``W + s B A``) and the factors left out: a plain
    model, for transformers alone."""
    check_lora_only(model)
    sd = dict(state_dict if state_dict is not None else model.state_dict())
    tied = contract_of(model).tied_parameter_names
    for name, layer in lora_layers(model).items():
        a, b = sd.pop(f"{name}.lora_A.weight"), sd.pop(f"{name}.lora_B.weight")
        magnitude = sd.pop(f"{name}{_MAGNITUDE}.weight", None)
        if f"{name}.weight" in tied or f"{name}.weight" in tied.values():
            raise DufuError(f"LoRA on {name}, whose weight is tied to {tied.get(f'{name}.weight', 'the head')}, "
                            "cannot be merged into one tied tensor; write the adapter (merge=False) instead.")
        if not layer.lora_merged:
            w = sd[f"{name}.weight"]
            merged = w.float() + layer.lora_scaling * (b.float() @ a.float())  # (out, in)
            if magnitude is not None:  # DoRA: each row rescaled to its magnitude
                merged = merged * (magnitude.float() / torch.linalg.vector_norm(merged, dim=1))[:, None]
            sd[f"{name}.weight"] = merged.to(w.dtype)
    return sd


def save_adapter(model: nn.Module, path: str | Path, state_dict: Optional[dict] = None,
                 base: Optional[str | Path] = None) -> Path:
    """Write ``model``'s LoRA as a PEFT adapter directory. ``base``: the Hugging Face directory (or hub name)
    of the base model, written as ``base_model_name_or_path``; default: the directory the model was loaded
    from (``pretrained_path``) if it is one, else the base is written beside the adapter (``path/base``)."""
    path = Path(path)
    config, tensors = adapter_files(model, state_dict)
    if base is None:
        base = contract_of(model).pretrained_path
        if base is None or not (Path(base) / "config.json").is_file():
            base = write_hf_model(model, path / "base", base_state_dict(model, state_dict))
    config["base_model_name_or_path"] = str(Path(base).resolve()) if Path(base).exists() else str(base)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path
