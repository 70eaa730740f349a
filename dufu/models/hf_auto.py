"""Any Hugging Face transformers architecture, trained as-is (LiBai's "import a HF model" story).

``HFAutoModel`` builds a transformers model -- from a config dict (no weights), or from a local model directory
(its config, and its weights unless ``load_weights=False``) -- and wraps it so the trainer's contract holds:
``model(**batch).loss``. dufu's language-model batches carry ``shift_labels`` (the next-token ids, already
shifted); the wrapper computes the mean token cross entropy over them from the model's logits, exactly as
dufu's own models do, so no token is wasted. Batches with transformers' own ``labels`` (shifted inside the model,
or class labels) go to the model, which returns its loss.

::

    model = L(HFAutoModel)(model_type="gpt_neox", config=dict(hidden_size=64, num_hidden_layers=2, ...))
    model = L(HFAutoModel)(path="/models/my-llama", auto_class="AutoModelForCausalLM")

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
from dufu.models.outputs import ModelOutput


def _import_transformers():
    try:
        import transformers
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


class HFAutoModel(nn.Module):
    """A transformers model behind dufu's model contract (``forward(**batch).loss``, sizes as attributes).

    Args:
        model_type: a transformers ``model_type`` ("gpt_neox", "llama", "mistral", "phi", "qwen2", "bert" ...)
            whose config is built from ``config``.
        config: config fields (``hidden_size``, ``num_hidden_layers`` ...), or changes to ``path``'s config.
        path: a local Hugging Face model directory; its weights are loaded unless ``load_weights`` is False.
        auto_class: the transformers Auto class that picks the architecture (``AutoModelForCausalLM``,
            ``AutoModelForMaskedLM``, ``AutoModelForSequenceClassification`` ...).
        attn_implementation: "sdpa" (default) or "eager".
    """

    main_input_name = "input_ids"

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
        meta = torch.empty(0).is_meta
        # fp32 parameters whatever dtype the checkpoint was saved in: AMP casts per op, the optimizer keeps fp32.
        dtype_kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
        if path is not None and load_weights and not meta:
            self.hf = factory.from_pretrained(str(path), config=hf_config, local_files_only=True,
                                              attn_implementation=attn_implementation, **dtype_kw)
        else:
            self.hf = factory.from_config(hf_config, attn_implementation=attn_implementation, **dtype_kw)
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
