"""Text generation for causal language models and encoder-decoders: :func:`generate` drives the model with a KV cache
through greedy decoding, sampling (temperature, top-k, top-p) or beam search (:mod:`dufu.engine.inference.generate_beam`),
with CTRL's repetition penalty (the scores: :mod:`dufu.engine.inference.generate_scores`) and stop strings.

A causal model that accepts ``kv_cache=`` (dufu's GPT and LLaMA families) is run once over the prompt and
then one token per step, attending to the keys and values cached from earlier positions
(:class:`dufu.layers.KVCache`). Any other model that returns ``.logits`` is run on the whole sequence every
step. Both give the same tokens.

An encoder-decoder (a model whose ``forward`` takes ``decoder_input_ids``, such as dufu's T5) encodes the
prompt once; the decoder starts from ``model.decoder_start_token_id`` and, with the cache, runs one token per
step: its self-attention keys/values grow in the cache, the cross-attention ones are computed on the first
step and reused.

Batches of prompts of different lengths are left-padded, with ``attention_mask`` marking the real
tokens; positions then count real tokens only (``cumsum(mask) - 1``), as transformers' ``generate`` does.

The model is driven through a small "steps" object (one per kind of model): ``steps(ids, mask)`` returns the
next-token logits (R, V) of the R sequences ``ids``, feeding the model only what it has not seen, and
``steps.reorder(rows)`` makes row i of the state (cache, encoder output) that of old row ``rows[i]``, which is
all beam search needs to fork and drop beams.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from dufu.engine.inference.generate_beam import beam_search
from dufu.engine.inference.generate_scores import apply_repetition_penalty, sample_next
from dufu.errors import ConfigError
from dufu.layers import KVCache
from dufu.models.base import contract_of


def reorder_kv_cache(cache: KVCache, model: torch.nn.Module, rows: torch.Tensor) -> None:
    """Row i of every cached key/value tensor becomes old row ``rows[i]`` (beam search: each beam continues
    the cache of the beam it extends; the first step also expands each prompt into its beams).

    A function over the cache's public get/put rather than a method of KVCache: the cache is keyed by
    attention module, so the model's modules name every entry."""
    for module in model.modules():
        kv = cache.get(module)
        if kv is not None:
            cache.put(module, kv[0].index_select(0, rows), kv[1].index_select(0, rows))  # (R', nkv, S, hs)


class StopStrings:
    """``stop=`` for :func:`generate`: a row is done once the text of its generated tokens contains one of
    ``strings``; :meth:`cut` cuts a text before the first of them (the stop string itself is not returned).
    ``decode``: token ids -> text (a tokenizer's ``decode``). The text is decoded whole at every step, so a
    stop string that spans several tokens, or ends inside one, is found."""

    def __init__(self, decode: Callable[[list[int]], str], strings: Sequence[str]):
        strings = [strings] if isinstance(strings, str) else list(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ConfigError(f"stop strings {strings!r}: give one or more non-empty strings.")
        self.decode, self.strings = decode, strings

    def __call__(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s in text for s in self.strings)

    def cut(self, text: str) -> str:
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[:min(found)] if found else text


def continuation_text(tokens: Sequence[int], decode: Callable[[list[int]], str], eos_id: Optional[int] = None,
                      stop: Optional[StopStrings] = None) -> str:
    """The text of one row's generated ``tokens``: up to its first ``eos_id``, cut before a stop string."""
    tokens = [int(t) for t in tokens]
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[:tokens.index(eos_id)]
    text = decode(tokens)
    return stop.cut(text) if stop is not None else text


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def is_encoder_decoder(model) -> bool:
    """True for a model that generates from an encoded input (its ``forward`` takes ``decoder_input_ids``)."""
    return _accepts(model, "decoder_input_ids")


def _last_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    if hasattr(logits, "full_tensor"):  # vocabulary-sharded logits under tensor parallelism
        logits = logits.full_tensor()
    return logits[:, -1, :].float()  # (R, V), in fp32 as transformers scores them


def tensor_parallel_size(model) -> int:
    """Ranks along the "tensor" mesh axis that hold the model's DTensor parameters (1 if none)."""
    # here, not at the top: ~0.6 s added to `import dufu.engine.inference.generate`, which a model on one device never needs
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if "tensor" in names:
                return p.device_mesh.shape[names.index("tensor")]
    return 1


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position of every token counting real tokens only; padding gets 0 (it is never attended to)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class _CausalSteps:
    """Next-token logits of a causal LM, feeding it only the tokens its cache has not seen."""

    def __init__(self, model, use_cache: bool, max_context: Optional[int], pad_to_multiple: int):
        self.model, self.max_context, self.pad_to_multiple = model, max_context, pad_to_multiple
        self.cached = use_cache and _accepts(model, "kv_cache")
        self.with_positions = _accepts(model, "position_ids")
        self.cache: Optional[KVCache] = None
        self.fed_mask = None  # (R, S): which of the S positions in `cache` are real tokens (padding may be cached)
        self.consumed = self.window_start = 0  # tokens of `ids` in the cache; first token of the window

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        R = ids.shape[0]
        start = 0 if self.max_context is None else max(0, ids.shape[1] - self.max_context)
        if self.cached and (self.cache is None or start != self.window_start):  # (re)fill the window
            self.cache, self.fed_mask, self.consumed, self.window_start = KVCache(), mask[:, :0], start, start
        first = self.consumed if self.cached else start
        new, new_mask = ids[:, first:], mask[:, first:]  # tokens the model has not seen yet
        pad = (-new.shape[1]) % self.pad_to_multiple
        if pad:
            new = torch.cat([new.new_zeros(R, pad), new], dim=1)
            new_mask = torch.cat([new_mask.new_zeros(R, pad), new_mask], dim=1)
        full_mask = torch.cat([self.fed_mask, new_mask], dim=1) if self.cached else new_mask  # (R, keys)
        kwargs = {"kv_cache": self.cache} if self.cached else {}
        if not bool(full_mask.all()):
            kwargs["attention_mask"] = full_mask
        if self.with_positions:  # real tokens count from 0 in the window; padding is never attended to
            kwargs["position_ids"] = _positions(full_mask)[:, -new.shape[1]:]
        logits = _last_logits(self.model(new, **kwargs))
        if self.cached:
            self.fed_mask, self.consumed = full_mask, ids.shape[1]
        return logits

    def reorder(self, rows: torch.Tensor) -> None:
        if self.cache is not None:
            reorder_kv_cache(self.cache, self.model, rows)
            self.fed_mask = self.fed_mask[rows]


class _Seq2SeqSteps:
    """Next-token logits of an encoder-decoder: the encoder runs once; the decoder reads its output."""

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], use_cache: bool):
        for need in ("encode", "decoder_start_token_id"):
            if not hasattr(model, need):
                raise ConfigError(f"{type(model).__name__} takes decoder_input_ids but has no `{need}`: generation "
                                  "needs model.encode(input_ids, attention_mask) and model.decoder_start_token_id.")
        if contract_of(model).output_head() is None:
            raise ConfigError(f"{type(model).__name__} has no language-model head, so it gives no next-token "
                              "scores; generate with T5ForConditionalGeneration.")
        self.model = model
        self.enc = model.encode(input_ids, attention_mask)  # (B, S, C)
        self.enc_mask = attention_mask
        self.cache = KVCache() if use_cache and _accepts(model, "kv_cache") else None
        self.consumed = 0

    def start_ids(self) -> torch.Tensor:
        B = self.enc.shape[0]
        return torch.full((B, 1), self.model.decoder_start_token_id, dtype=torch.long, device=self.enc.device)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # decoder inputs never have padding: every row starts with the start token
        kwargs = {"kv_cache": self.cache} if self.cache is not None else {}
        new = ids[:, self.consumed:] if self.cache is not None else ids
        out = self.model(attention_mask=self.enc_mask, decoder_input_ids=new, encoder_outputs=self.enc, **kwargs)
        self.consumed = ids.shape[1]
        return _last_logits(out)

    def reorder(self, rows: torch.Tensor) -> None:
        self.enc = self.enc[rows]
        self.enc_mask = self.enc_mask[rows] if self.enc_mask is not None else None
        if self.cache is not None:
            reorder_kv_cache(self.cache, self.model, rows)


def _check_options(num_beams, temperature, top_k, top_p, repetition_penalty, early_stopping, stop, fill):
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ConfigError(f"num_beams={num_beams!r}: give a whole number >= 1 (1 = no beam search).")
    if not repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty={repetition_penalty!r}: give a number > 0 (1 = no penalty, "
                          "> 1 discourages repeats).")
    if early_stopping not in (True, False, "never"):
        raise ConfigError(f"early_stopping={early_stopping!r}: give True, False or 'never'.")
    if num_beams > 1 and (temperature not in (0, 1) or top_k is not None or top_p is not None):
        raise ConfigError(f"beam search (num_beams={num_beams}) keeps the most likely sequences and samples "
                          f"nothing; temperature={temperature}, top_k={top_k}, top_p={top_p} are sampling options: "
                          "leave them at their defaults (or use num_beams=1 to sample).")
    if stop is not None and fill is None:
        raise ConfigError("stop= needs eos_id or pad_id: the token that fills a row after it stopped.")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, eos_id: Optional[int] = None,
             max_context: Optional[int] = None, generator: Optional[torch.Generator] = None,
             attention_mask: Optional[torch.Tensor] = None, use_cache: bool = True,
             pad_to_multiple: Optional[int] = None, repetition_penalty: float = 1.0, num_beams: int = 1,
             length_penalty: float = 1.0, early_stopping: bool | str = False,
             stop: Optional[Callable[[list[int]], bool]] = None, pad_id: Optional[int] = None) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after each of the prompts ``input_ids`` (B, T).

    Returns, as transformers' ``generate``: for a causal LM the prompts and their continuations (B, T + new);
    for an encoder-decoder (``input_ids`` are then the encoder input) the decoder sequences (B, 1 + new),
    starting with the model's ``decoder_start_token_id``.

    ``temperature`` 0 is greedy decoding. ``eos_id``: a row that produced it is done. A done row is filled
    with ``pad_id`` (default ``eos_id``), and generation stops when every row is done. ``stop``: a callable
    that gets a row's generated token ids and says whether the row is done (e.g. :class:`StopStrings`).
    ``repetition_penalty``: CTRL's penalty on every token already in the sequence, prompt included
    (:func:`apply_repetition_penalty`). ``max_context``: the model sees at most this many of the last tokens
    (past it the cache is rebuilt on the window every step). ``attention_mask`` (B, T): 1 for prompt tokens,
    0 for left padding. ``use_cache=False`` runs the whole sequence every step. ``pad_to_multiple``: every
    forward of a causal LM gets a sequence length divisible by it, by masked padding on the left, because
    sequence parallelism splits the sequence over the tensor-parallel ranks. Default: the tensor-parallel
    size of a model whose parameters are DTensors on a mesh with a "tensor" axis, else 1.

    ``num_beams`` > 1: beam search (:func:`dufu.engine.inference.generate_beam.beam_search`) with transformers'
    ``length_penalty`` and ``early_stopping``; each prompt gives its best sequence."""
    fill = pad_id if pad_id is not None else eos_id
    _check_options(num_beams, temperature, top_k, top_p, repetition_penalty, early_stopping, stop, fill)
    seq2seq = is_encoder_decoder(model)
    if seq2seq and (max_context is not None or (pad_to_multiple or 1) > 1):
        raise ConfigError(f"{type(model).__name__} is an encoder-decoder: max_context and pad_to_multiple apply "
                          "to causal LMs only (its decoder has relative positions and no sequence parallelism); "
                          "leave them unset.")
    was_training = model.training
    model.eval()
    try:
        if seq2seq:
            steps = _Seq2SeqSteps(model, input_ids, attention_mask, use_cache)
            ids = steps.start_ids()
            mask = torch.ones_like(ids)
        else:
            if pad_to_multiple is None:
                pad_to_multiple = tensor_parallel_size(model)
            steps = _CausalSteps(model, use_cache, max_context, pad_to_multiple)
            ids = input_ids
            mask = attention_mask.to(torch.long) if attention_mask is not None else torch.ones_like(input_ids)
        if num_beams > 1:
            return beam_search(steps, ids, mask, max_new_tokens, num_beams, eos_id=eos_id, fill=fill,
                               length_penalty=length_penalty, early_stopping=early_stopping,
                               repetition_penalty=repetition_penalty, stop=stop)
        return _sample(steps, ids, mask, max_new_tokens, temperature, top_k, top_p, generator, eos_id, fill,
                       repetition_penalty, stop)
    finally:
        model.train(was_training)


def _sample(steps, ids, mask, max_new_tokens, temperature, top_k, top_p, generator, eos_id, fill,
            repetition_penalty, stop) -> torch.Tensor:
    """Greedy decoding or sampling, one token per row and step."""
    n_prompt = ids.shape[1]
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = steps(ids, mask)  # (B, V)
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, ids, repetition_penalty, mask)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if fill is not None:
            nxt = torch.where(done, torch.full_like(nxt, fill), nxt)
        if eos_id is not None:
            done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if stop is not None:
            for row in (~done).nonzero().flatten().tolist():
                done[row] = bool(stop(ids[row, n_prompt:].tolist()))
        if fill is not None and bool(done.all()):
            break
    return ids
