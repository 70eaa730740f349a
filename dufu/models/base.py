"""What every dufu model family shares: initialisation defined one module at a time.

A family implements ``init_module(name, module)``: it initialises the parameters and buffers that
``module`` holds *directly* (not those of its children), and may look at ``name`` (its qualified name in
the model, e.g. ``blocks.3.attn.out_proj``) for rules such as GPT-2's scaled residual projections. It
must not read other modules, because a sharded, meta-built model materialises each module on its own:
:func:`dufu.parallel.materialize.materialize_` builds a full-size copy of one module at a time, runs
``init_module`` on it under a seed derived from the module's name, and keeps each rank's slice. So the
initial weights are the same in every parallel layout (and on one device), whatever each rank holds.

``init_weights()`` runs the same rules over the whole model in place, for a model built on a real device.
"""

from __future__ import annotations

import torch
from torch import nn

from dufu.layers.moe import GroupedExperts


class InitByModule:
    """Mixin for ``nn.Module`` models: ``init_weights`` from a per-module rule (see the module docstring)."""

    def tie_weights(self) -> None:
        """A tied output head (``tie_word_embeddings``) uses the token embedding's tensor: called at build and
        again after ``to_empty`` (which gives every module its own tensor). A pipeline stage that holds only one
        of the two (the last stage keeps its own copy of the head) has nothing to tie."""
        wte, lm_head = getattr(self, "wte", None), getattr(self, "lm_head", None)
        if getattr(self, "tie_word_embeddings", False) and wte is not None and lm_head is not None:
            lm_head.weight = wte.weight

    def finish_init(self, pretrained=None) -> None:
        """The end of every family's constructor: tie the head, remember where pretrained weights come from
        (``pretrained_path``) and, unless built on the meta device, initialise. Nothing is read here: whoever
        builds the model loads the weights as a separate step (the trainer shard by shard after a meta build,
        or :func:`dufu.engine.pretrained.load_pretrained` in place)."""
        self.tie_weights()
        self.pretrained_path = None if pretrained is None else str(pretrained)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_module(self, name: str, module: nn.Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def is_tied_alias(self, qualified_name: str) -> bool:
        """True for a parameter (e.g. ``lm_head.weight``) that is another's tensor (a tied output head): it
        is initialised through its twin, never by its own rule."""
        return qualified_name in getattr(self, "tied_parameter_names", {})

    def init_normal(self, name: str, module: nn.Module, std: float) -> None:
        """The common rule (GPT-2, BERT, LLaMA): matrices and embeddings N(0, std) (a tied head excepted),
        biases 0, norm weights 1."""
        if isinstance(module, nn.Linear):
            if not self.is_tied_alias(f"{name}.weight"):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, GroupedExperts):
            module.reset_parameters(std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    @torch.no_grad()
    def init_weights(self) -> None:
        self.tie_weights()
        for name, module in self.named_modules():
            self.init_module(name, module)


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name that holds the same tensor as an earlier one (a tied head) -> that earlier name."""
    first, tied = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied
