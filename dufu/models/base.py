"""What every dufu model family declares, and the initialisation the families share.

**The contract.** Code above the models (parallelism, the planner, deltas, compression, the engine) never guesses
what a model can do: it reads the names :class:`ModelContract` lists. Each has one declared place,
:class:`ModelBase`, which every family inherits and which holds the documented default a family that says nothing
gets (``supports_context_parallel = False`` with a reason, no ``pipeline_layout`` with a reason, ...). A family
overrides a name as a class attribute (a capability: ``pipeline_layout``, ``pipeline_loss``) or sets it in its
constructor (a size, ``tied_parameter_names``). A few names are state other packages attach to a built model
(``delta_info``, ``quantization_info``, ``context_parallel``, ``tied_parameter_role``); their defaults say "none
yet". A module that is not a dufu family (a plain ``nn.Module`` given to a layout check) is read through
:func:`contract_of`, which answers the same defaults for whatever it does not set itself.

**Initialisation defined one module at a time.** A family implements ``init_module(name, module)``: it
initialises the parameters and buffers that ``module`` holds *directly* (not those of its children), and may look
at ``name`` (its qualified name in the model, e.g. ``blocks.3.attn.out_proj``) for rules such as GPT-2's scaled
residual projections. It must not read other modules, because a sharded, meta-built model materialises each
module on its own: :func:`dufu.parallel.materialize.materialize_` runs ``init_module`` on a copy of one module at a
time, under a seed derived from the module's name. The rules draw through :mod:`dufu.layers.init`, whose values
are defined tile by tile, so a rank computes only the tiles its blocks overlap. So the initial weights are the
same in every parallel layout (and on one device), whatever each rank holds. ``init_weights(seed)`` runs the same
rules over the whole model in place under the same seeds, for a model built on a real device.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from dufu.layers import init
from dufu.layers.moe import GroupedExperts

_NONE: Mapping[str, str] = types.MappingProxyType({})  # an empty mapping no model can change by accident


@runtime_checkable
class ModelContract(Protocol):
    """The names code outside :mod:`dufu.models` reads on a model (defaults and meanings: :class:`ModelBase`)."""

    # inputs and outputs
    main_input_name: str
    return_dict: bool
    fused_loss: bool
    # sizes (None where the family has no such size)
    vocab_size: Optional[int]
    hidden_size: Optional[int]
    num_layers: Optional[int]
    num_attention_heads: Optional[int]
    max_position_embeddings: Optional[int]
    image_size: Optional[tuple]
    num_channels: Optional[int]
    # pipeline parallelism
    pipeline_layout: Optional[Mapping[str, Any]]
    pipeline_unsupported_reason: str
    pipeline_loss: Optional[Callable[..., torch.Tensor]]
    pipeline_forward: Optional[Callable[..., Any]]
    prepare_decoder_input_ids_from_labels: Optional[Callable[..., torch.Tensor]]
    tied_parameter_role: Mapping[str, str]
    # sequence and context parallelism
    sequence_parallel_unsupported_reason: str
    supports_context_parallel: bool
    context_parallel_unsupported_reason: str
    context_parallel: Optional[Any]
    # tied parameters and weights
    tie_word_embeddings: bool
    tied_parameter_names: Mapping[str, str]
    init_module: Optional[Callable[[str, nn.Module], None]]
    pretrained_path: Optional[str]
    hf_mapping: Optional[Any]
    # attached by dufu.delta and dufu.compress
    delta_info: Optional[Any]
    quantization_info: Optional[Any]

    @property
    def attention_layers(self) -> Optional[int]: ...

    def output_head(self) -> Optional[nn.Module]: ...

    def token_embedding(self) -> Optional[nn.Module]: ...

    def tie_weights(self) -> None: ...

    def default_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...


def _members(protocol: type) -> tuple[str, ...]:
    public = [n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    return tuple(dict.fromkeys([*protocol.__annotations__, *public]))


CONTRACT: tuple[str, ...] = _members(ModelContract)
"""Every name of :class:`ModelContract`, in its order."""


class ModelBase:
    """Mixin every model family inherits (before ``nn.Module``): the contract's names with their defaults."""

    # ------------------------------------------------------------------ inputs and outputs
    main_input_name: str = "input_ids"  # the batch key the first pipeline stage takes ("pixel_values" for images)
    # False: forward returns a plain tensor (logits, or hidden states on an inner pipeline stage), as a pipeline
    # stage must; like transformers' ``return_dict``
    return_dict: bool = True
    fused_loss: bool = False  # head and cross entropy computed together, chunk by chunk (no full logits)

    # ------------------------------------------------------------------ sizes
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    image_size: Optional[tuple] = None  # (height, width) of an image model's input
    num_channels: Optional[int] = None  # an image model's input channels

    @property
    def attention_layers(self) -> Optional[int]:
        """Attention layers a token passes through, for the FLOP estimate (12 L H T per token): ``num_layers``
        unless a family has more per layer (T5's decoder also attends to the encoder)."""
        return self.num_layers

    # ------------------------------------------------------------------ pipeline parallelism
    # How :mod:`dufu.parallel.pipeline` splits the model: {"blocks": the block ModuleDict(s), "first": modules the
    # first stage keeps, "last": those the last stage keeps, optionally "before" / "after"}. None: not splittable,
    # for ``pipeline_unsupported_reason``.
    pipeline_layout: Optional[Mapping[str, Any]] = None
    pipeline_unsupported_reason: str = (
        "it declares no `pipeline_layout` (pipeline parallelism needs a model built from dufu layers)")
    # loss(last stage's output, target) -> scalar: what a pipeline's last stage computes (None: no pipeline loss)
    pipeline_loss: Optional[Callable[..., torch.Tensor]] = None
    # A stage's forward when it is not ``forward`` (T5 passes encoder and decoder states between stages)
    pipeline_forward: Optional[Callable[..., Any]] = None
    # Decoder inputs from the labels, for a first stage that never sees the labels (T5; transformers' name)
    prepare_decoder_input_ids_from_labels: Optional[Callable[..., torch.Tensor]] = None
    # Set on a pipeline stage holding one of two tied parameters: {name: "source" | "copy"}
    tied_parameter_role: Mapping[str, str] = _NONE

    # ------------------------------------------------------------------ sequence and context parallelism
    sequence_parallel_unsupported_reason: str = ""  # empty: sequence parallelism works; else why not
    supports_context_parallel: bool = False  # its layers take sequence chunks with their global positions
    context_parallel_unsupported_reason: str = (
        "it does not declare that its layers take sequence chunks (supports_context_parallel)")
    # The rank's ContextParallel, set by dufu.parallel.context_parallel.apply_context_parallel
    context_parallel: Optional[Any] = None

    def default_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The positions of a batch given none: 0 .. T-1 for every sequence, (1, T). Context parallelism computes
        them on the whole sequence before it splits the batch."""
        return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)

    # ------------------------------------------------------------------ tied parameters
    tie_word_embeddings: bool = False
    # Names that hold one shared tensor (alias -> source): a checkpoint that has only one of them serves both
    tied_parameter_names: Mapping[str, str] = _NONE

    def output_head(self) -> Optional[nn.Module]:
        """The module that turns hidden states into per-token vocabulary logits (``lm_head``), or None: a family
        without one, or a pipeline stage other than the last."""
        return None

    def token_embedding(self) -> Optional[nn.Module]:
        """The token embedding table (``wte``), or None: a family without one, or a stage other than the first."""
        return None

    def tie_weights(self) -> None:
        """A tied output head (``tie_word_embeddings``) uses the token embedding's tensor: called at build and
        again after ``to_empty`` (which gives every module its own tensor). A pipeline stage that holds only one
        of the two (the last stage keeps its own copy of the head) has nothing to tie."""
        wte, head = self.token_embedding(), self.output_head()
        if self.tie_word_embeddings and wte is not None and head is not None:
            head.weight = wte.weight

    # ------------------------------------------------------------------ weights
    # init_module(name, module): the family's initialisation rule (module docstring); None: the model has none
    # and cannot be built on the meta device and materialised (a transformers model run as-is)
    init_module: Optional[Callable[[str, nn.Module], None]] = None
    pretrained_path: Optional[str] = None  # where pretrained weights are read from after building (None: none)
    # A Hugging Face mapping the class carries itself; None: its family's, from dufu.models.hub's registry
    hf_mapping: Optional[Any] = None

    # ------------------------------------------------------------------ attached by other packages
    delta_info: Optional[Any] = None  # dufu.delta's DeltaInfo: what trains in a delta run
    quantization_info: Optional[Any] = None  # dufu.compress.quantize's QuantizationInfo


class _Undeclared:
    """A module that does not inherit :class:`ModelBase`, read as a model: what it sets itself, else the default.
    Defaults that are methods or properties run against this view, so they see the same defaults."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        object.__setattr__(self, "module", module)

    def __getattr__(self, name: str):
        if name not in CONTRACT:
            raise AttributeError(f"{name!r} is not a name of the model contract (dufu.models.base.ModelContract)")
        try:
            return getattr(self.module, name)
        except AttributeError:
            default = inspect.getattr_static(ModelBase, name)
        if isinstance(default, property):
            return default.fget(self)
        if inspect.isfunction(default):
            return types.MethodType(default, self)
        return default


def contract_of(model: nn.Module) -> ModelContract:
    """``model`` read through the contract: the model itself when it is a dufu family (it inherits
    :class:`ModelBase`), otherwise a view that answers :class:`ModelBase`'s defaults for what it does not set."""
    return model if isinstance(model, ModelBase) else _Undeclared(model)


class InitByModule(ModelBase):
    """Mixin for ``nn.Module`` models: ``init_weights`` from a per-module rule (see the module docstring)."""

    def finish_init(self, pretrained=None) -> None:
        """The end of every family's constructor: tie the head, remember where pretrained weights come from
        (``pretrained_path``) and, unless built on the meta device, initialise. Nothing is read here: whoever
        builds the model loads the weights as a separate step (the trainer shard by shard after a meta build,
        or :func:`dufu.engine.weights.pretrained.load_pretrained` in place)."""
        self.tie_weights()
        self.pretrained_path = None if pretrained is None else str(pretrained)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_module(self, name: str, module: nn.Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def is_tied_alias(self, qualified_name: str) -> bool:
        """True for a parameter (e.g. ``lm_head.weight``) that is another's tensor (a tied output head): it
        is initialised through its twin, never by its own rule."""
        return qualified_name in self.tied_parameter_names

    def init_normal(self, name: str, module: nn.Module, std: float) -> None:
        """The common rule (GPT-2, BERT, LLaMA): matrices and embeddings N(0, std) (a tied head excepted),
        biases 0, norm weights 1."""
        if isinstance(module, nn.Linear):
            if not self.is_tied_alias(f"{name}.weight"):
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, GroupedExperts):
            module.reset_parameters(std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Initialise every module in place by its rule, under ``module_seed(seed, its name)``
        (:func:`dufu.layers.init.init_scope`): the values :func:`dufu.parallel.materialize.materialize_` gives
        with the same seed. ``seed`` None: one drawn from torch's default generator."""
        self.tie_weights()
        seed = init.fresh_seed() if seed is None else seed
        for name, module in self.named_modules():
            with init.init_scope(init.module_seed(seed, name), module):
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
