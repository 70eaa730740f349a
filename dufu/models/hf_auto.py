"""Any Hugging Face transformers architecture, trained as-is (LiBai's "import a HF model" story).

``HFAutoModel`` builds a transformers model from its config only -- a config dict, or a local model directory's
config.json -- and wraps it so the trainer's contract holds:
``model(**batch).loss``. dufu's language-model batches carry ``shift_labels`` (the next-token ids, already
shifted); the wrapper computes the mean token cross entropy over them from the model's logits, exactly as
dufu's own models do, so no token is wasted. Batches with transformers' own ``labels`` (shifted inside the model,
or class labels) go to the model, which returns its loss.

::

    model = L(HFAutoModel)(model_type="gpt_neox", config=dict(hidden_size=64, num_hidden_layers=2, ...))
    model = L(HFAutoModel)(path="/models/my-llama", auto_class="AutoModelForCausalLM")

Building reads no weights: with ``path`` (and ``load_weights``) the constructor records ``pretrained_path``, and
whoever builds the model loads them as a separate step, as for every dufu family: the trainer after its build,
or :func:`dufu.engine.weights.pretrained.load_pretrained` in place. Tensors are read one at a time under the wrapped
model's own names (:class:`AsIsMapping`).

What works without code changes: data parallelism, ZeRO 1/2/3 (FSDP2), activation checkpointing, compile and
AMP. Each decoder layer becomes its own FSDP / checkpointing unit: transformers' layers carry no ``layer_idx``,
so the wrapper marks the children of the model's layer list with one (that is how
``dufu.parallel.transformer_blocks`` finds blocks). Tensor and pipeline parallelism need models built from
dufu layers: they read each layer's declared style and the model's ``pipeline_layout`` (see docs/models.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dufu.errors import ConfigError
from dufu.models.base import ModelBase, tied_names
from dufu.models.hf_weights import StoredTensor
from dufu.models.outputs import ModelOutput


def _import_transformers():
    try:
        import transformers  # here, not at the top: optional, and seconds to import
    except ModuleNotFoundError:
        raise ConfigError("HFAutoModel needs Hugging Face transformers: pip install transformers") from None
    return transformers


def build_hf_config(model_type: Optional[str] = None, config: Optional[dict] = None, path: Optional[str] = None):
    """A transformers config: ``model_type`` + ``config`` fields (AutoConfig.for_model), or a local directory's
    config.json (AutoConfig.from_pretrained, offline) with ``config`` fields changed."""
    transformers = _import_transformers()
    config = dict(config or {})
    if path is not None:
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"HFAutoModel(path={path!r}): no config.json there; give a local Hugging Face model "
                              "directory (what save_pretrained writes).")
        hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        for key, value in config.items():
            setattr(hf_config, key, value)
        return hf_config
    if model_type is None:
        raise ConfigError("HFAutoModel needs model_type (e.g. 'gpt_neox', 'llama', 'mistral') with config=dict(...), "
                          "or path= a local Hugging Face model directory.")
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except ValueError as e:
        raise ConfigError(f"HFAutoModel(model_type={model_type!r}): {e}") from None


def mark_transformer_blocks(model: nn.Module, num_layers: Optional[int]) -> list[nn.Module]:
    """Give each repeated layer of a transformers model a ``layer_idx`` (if it has none), so dufu's per-block
    transforms (FSDP units, activation checkpointing, compile) find them. The layer list is the ``ModuleList``
    of ``num_layers`` modules of one class (the first such list, e.g. ``model.layers`` / ``gpt_neox.layers``)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(c) for c in module}
            if len(kinds) == 1 and (num_layers is None or len(module) == num_layers):
                for i, layer in enumerate(module):
                    if not hasattr(layer, "layer_idx"):
                        layer.layer_idx = i
                return list(module)
    return []


# The sizes a pretrained directory's config must agree on with the model (see dufu.models.hub.check_sizes_fit).
_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
          "num_attention_heads": "num_attention_heads", "max_position_embeddings": "max_position_embeddings"}


class AsIsMapping:
    """How :func:`dufu.engine.weights.pretrained.load_pretrained` reads a transformers directory into an
    :class:`HFAutoModel`. When the directory stores every tensor under the wrapped model's own name (``hf.``
    stripped; a checkpoint of the bare model without ``base_model_prefix``, e.g. ``gpt_neox.``, or of a model with
    a head, with it), each is read on its own, lazily. Otherwise the stored names are transformers' older or
    fused layout (GPT-NeoX's ``embed_out`` is ``lm_head`` in memory), which only transformers' own loader
    converts: it reads the directory once into a model of the same class, whose tensors are served. Names the
    directory lacks are left out, for the loader to report; tied names are served by their twin."""

    model_type = "transformers as-is"
    load_renames = ()  # stored names are the wrapped model's own (or converted by transformers' loader)

    def config_from_hf(self, hf_config: dict) -> dict:
        text = hf_config.get("text_config") or hf_config
        return {ours: text.get(theirs) for ours, theirs in _SIZES.items()}

    def tensor_sources(self, weights, module: nn.Module) -> dict:
        prefix = getattr(module.hf, "base_model_prefix", "") or ""
        tied = module.tied_parameter_names
        out = {}
        for name in module.state_dict():
            theirs = name.removeprefix("hf.")
            if prefix and theirs.startswith(prefix + "."):
                candidates = (theirs, theirs[len(prefix) + 1:])
            else:
                candidates = (theirs, f"{prefix}.{theirs}") if prefix else (theirs,)
            key = next((c for c in candidates if c in weights), None)
            if key is not None:
                out[name] = StoredTensor(weights, key)
        if all(name in out or name in tied for name in module.state_dict()):
            return out
        return _converted_by_transformers(module, weights.path)

    # Export (dufu.models.hub.save_pretrained, ``dufu convert --to-hf``): the wrapped model's own names and config.
    def state_dict_to_hf(self, sd: dict, model: nn.Module) -> dict:
        tied = model.tied_parameter_names
        return {k.removeprefix("hf."): v for k, v in sd.items() if k not in tied}

    def config_to_hf(self, model: nn.Module) -> dict:
        return {**model.hf.config.to_dict(), "architectures": [type(model.hf).__name__]}

    def tied_hf_names(self, model: nn.Module) -> list[str]:
        return []  # tied names are left out of the state dict already


def _converted_by_transformers(module: nn.Module, path) -> dict:
    """The tensors of ``path`` as transformers loads them into ``module.hf``'s class (renamed and converted),
    without those it could not find there."""
    transformers = _import_transformers()
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    with torch.device("cpu"):
        loaded, info = type(module.hf).from_pretrained(str(path), config=module.hf.config, local_files_only=True,
                                                       output_loading_info=True, **kw)
    missing = {f"hf.{k}" for k in info.get("missing_keys", ())}
    return {f"hf.{k}": v for k, v in loaded.state_dict().items() if f"hf.{k}" not in missing}


class HFAutoModel(ModelBase, nn.Module):
    """A transformers model behind dufu's model contract (``forward(**batch).loss``, sizes as attributes).

    Args:
        model_type: a transformers ``model_type`` ("gpt_neox", "llama", "mistral", "phi", "qwen2", "bert" ...)
            whose config is built from ``config``.
        config: config fields (``hidden_size``, ``num_hidden_layers`` ...), or changes to ``path``'s config.
        path: a local Hugging Face model directory: its config.json defines the model; its weights are recorded as
            ``pretrained_path`` (loaded after the build, see the module docstring) unless ``load_weights`` is False.
        auto_class: the transformers Auto class that picks the architecture (``AutoModelForCausalLM``,
            ``AutoModelForMaskedLM``, ``AutoModelForSequenceClassification`` ...).
        attn_implementation: "sdpa" (default) or "eager".
    """

    main_input_name = "input_ids"
    hf_mapping = AsIsMapping()  # what dufu.models.hub.adapter_for_model returns for this class
    pipeline_unsupported_reason = (
        "a transformers model run as-is declares no `pipeline_layout` (pipeline parallelism needs a model built "
        "from dufu layers).")
    context_parallel_unsupported_reason = (
        "a transformers model run as-is computes attention with its own kernels, which do not fetch the other "
        "ranks' keys and values")

    def __init__(
        self,
        model_type: Optional[str] = None,
        config: Optional[dict] = None,
        path: Optional[str] = None,
        load_weights: bool = True,
        auto_class: str = "AutoModelForCausalLM",
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        transformers = _import_transformers()
        hf_config = build_hf_config(model_type, config, path)
        factory = getattr(transformers, auto_class, None)
        if factory is None or not hasattr(factory, "from_config"):
            raise ConfigError(f"HFAutoModel(auto_class={auto_class!r}) is not a transformers Auto class; use e.g. "
                              "AutoModelForCausalLM or AutoModelForSequenceClassification.")
        if hasattr(hf_config, "use_cache"):
            hf_config.use_cache = False  # training: no key/value cache objects in forward
        # fp32 parameters whatever dtype the checkpoint was saved in: AMP casts per op, the optimizer keeps fp32.
        dtype_kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
        self.hf = factory.from_config(hf_config, attn_implementation=attn_implementation, **dtype_kw)
        self.pretrained_path = str(path) if path is not None and load_weights else None
        self.tied_parameter_names = tied_names(self)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.model_type = hf_config.model_type
        self.vocab_size = getattr(text, "vocab_size", None)
        self.hidden_size = getattr(text, "hidden_size", None)
        self.num_layers = getattr(text, "num_hidden_layers", None)
        self.num_attention_heads = getattr(text, "num_attention_heads", None)
        self.max_position_embeddings = getattr(text, "max_position_embeddings", None)
        self.blocks_found = len(mark_transformer_blocks(self.hf, self.num_layers))

    def forward(self, input_ids: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, **kwargs) -> ModelOutput:
        """``shift_labels`` (B, T): next-token ids for each input position (dufu's LM batches; -100 ignored).
        ``labels`` and any other keyword (attention_mask, token_type_ids ...) go to the transformers model."""
        if shift_labels is not None:
            out = self.hf(input_ids=input_ids, **kwargs)
            logits = out.logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=-100)
            return ModelOutput(loss=loss, logits=logits)
        out = self.hf(input_ids=input_ids, labels=labels, **kwargs) if labels is not None else \
            self.hf(input_ids=input_ids, **kwargs)
        return ModelOutput(loss=getattr(out, "loss", None), logits=getattr(out, "logits", None),
                           last_hidden_state=getattr(out, "last_hidden_state", None))

    def save_pretrained(self, path: str) -> None:
        """Write the wrapped model in Hugging Face format (config.json + model.safetensors)."""
        self.hf.save_pretrained(path)
