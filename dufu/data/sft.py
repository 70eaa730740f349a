"""Supervised fine-tuning data: prompt/response pairs, with the loss on the response only.

A record is a prompt and a response (a ``.jsonl`` line ``{"prompt": "...", "response": "..."}``; the field
names are arguments). A sample is the tokens of ``prompt + response + EOS`` as a causal language model reads
them, with the targets of the prompt (and of the padding) set to -100, which the loss ignores::

    tokens        P  P  P  R  R  E  .  .       (P prompt, R response, E end-of-document, . padding)
    input_ids     P  P  P  R  R  E  .          the first seq_length tokens
    shift_labels  -  -  R  R  E  -  -          the next token of each position; - = -100

So the model is trained to write the response (and to stop after it) given the prompt, as in Megatron-LM's
and torchtitan's SFT data, LiBai's instruction tuning and TRL's "completion only" loss. ``shift_labels``
(transformers' name) are already the next-token ids, so no position is wasted and a pipeline's last stage
takes them as its target unchanged. Padding is on the right: a causal model never attends to what comes
after a position, so the padding changes no logit of a real token and no attention mask is needed; every
parallel layout, pipeline parallelism included, takes these samples.

Lengths: a sample holds ``seq_length + 1`` tokens (inputs and targets overlap by all but one, like the
pretraining samples of :mod:`~dufu.data.dataset`). A prompt longer than ``max_prompt_length`` (default half
of ``seq_length``) keeps its last tokens — the ones next to the response — so every sample has response
targets; then the response (with its EOS) is cut at the end to fit.

Packing (``packing=True``, as in Megatron-LM, torchtune and TRL): on short pairs most of a padded sample is
padding, so instead several samples share one row of ``seq_length``, each keeping only its real positions (the
``seq_length + 1``-token sample above without its padding: inputs up to the token before its EOS, targets up to
the EOS), packed best-fit in dataset order by :class:`~dufu.data.packing.PackedDataset`::

    input_ids     P  P  R  R  p  p  p  r  r  .  .      (two samples, then padding)
    shift_labels  -  R  R  E  -  -  r  r  e  -  -
    position_ids  0  1  2  3  0  1  2  3  4  0  1      restart at each sample: the attention stays inside it

The position ids restart at every sample, so each sees positions ``0 .. len - 1`` as when padded alone, and the
models mask attention to each sample's own tokens (block-causal, :func:`dufu.layers.attention.document_mask`):
a packed sample's logits and loss are the ones it has padded. Position ids are model keyword arguments every
pipeline stage gets, so packed samples run in every layout padded ones do. The validation split is packed too.

The loss the models compute is the mean over the target tokens of each micro-batch; the trainer weights each
micro-batch by its share of the global batch's targets, so a step's loss is the mean over all the response
tokens of the global batch, whatever the micro-batch size and layout (docs/parallelism.md, "The loss of a
step").

The built-in data set (``data_path="builtin"``) needs no download: for each topic of CPython's
``pydoc_data`` (the built-in corpus, see :mod:`~dufu.data.corpus`) the prompt is ``Explain the Python
topic: <name>`` and a newline, and the response the opening paragraphs of the topic's text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence, Union

import numpy as np
from pydoc_data.topics import topics

from dufu.errors import DataError

from . import hf_datasets
from .corpus import BUILTIN, read_jsonl_fields, resolve_sources
from .packing import PackedDataset
from .sampler import Sample
from .tokenizer import Tokenizer

IGNORE_INDEX = -100
BUILTIN_PROMPT = "Explain the Python topic: {name}\n"

SFTInput = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


# ------------------------------------------------------------------------------------------------ records
def builtin_sft_records(max_chars: int = 600) -> list[dict[str, str]]:
    """``{"prompt", "response"}`` for every ``pydoc_data`` topic in sorted order: ``Explain the Python topic:
    <name>`` (and a newline) and the topic's text without its titles, whole paragraphs up to about ``max_chars``
    characters."""
    records = []
    for name in sorted(topics):
        lines = topics[name].strip().splitlines()
        if len(lines) > 1 and lines[1].strip() and set(lines[1].strip()) <= set("*=-"):
            lines = lines[2:]  # the title and its underline
        paragraphs = [p.strip("\n").rstrip() for p in "\n".join(lines).split("\n\n")]
        paragraphs = [p for p in paragraphs if p.strip() and not _is_heading(p)]
        response = ""
        for p in paragraphs:
            if response and len(response) + 2 + len(p) > max_chars:
                break
            response = f"{response}\n\n{p}" if response else p
        records.append({"prompt": BUILTIN_PROMPT.format(name=name), "response": response[:max_chars]})
    return records


def _is_heading(paragraph: str) -> bool:
    """A section title: one line of text underlined with ``*``, ``=`` or ``-``."""
    lines = paragraph.strip().splitlines()
    return len(lines) == 2 and set(lines[1].strip()) <= set("*=-")


def read_sft_records(data_path: SFTInput = BUILTIN, prompt_key: str = "prompt",
                     response_key: str = "response") -> list[tuple[str, str]]:
    """(prompt, response) pairs of an input: ``"builtin"``, a ``.jsonl`` file (one JSON object per line,
    blank lines skipped), a ``.parquet`` / ``.arrow`` file or ``datasets`` ``save_to_disk`` directory (through
    :mod:`dufu.data.hf_datasets`), a directory of such files (sorted, recursively) or a list of these."""
    pairs: list[tuple[str, str]] = []
    for source in resolve_sources(data_path):
        if source == BUILTIN:
            pairs.extend((r["prompt"], r["response"]) for r in builtin_sft_records())
        elif hf_datasets.is_hf_source(source):  # .parquet, .arrow, a save_to_disk directory
            fields = {prompt_key: ("dataloader.train.prompt_key", "prompt"),
                      response_key: ("dataloader.train.response_key", "response")}
            pairs.extend((r[prompt_key], r[response_key])
                         for r in hf_datasets.read_records(source, fields, what="SFT data"))
        elif source.suffix != ".jsonl":
            raise DataError(
                f"SFT data file {source} is a {source.suffix} file, but prompt/response records come from "
                f'.jsonl files: one JSON object per line such as {{"{prompt_key}": "...", "{response_key}": '
                '"..."}. Convert it, or use "builtin".'
            )
        else:
            pairs.extend(_read_jsonl_pairs(source, prompt_key, response_key))
    if not pairs:
        raise DataError(
            f"SFT data {data_path} holds no records. Each line of a .jsonl file must be an object such as "
            f'{{"{prompt_key}": "...", "{response_key}": "..."}}.'
        )
    return pairs


def _read_jsonl_pairs(path: Path, prompt_key: str, response_key: str) -> Iterator[tuple[str, str]]:
    fields = {prompt_key: ("dataloader.train.prompt_key", "prompt"),
              response_key: ("dataloader.train.response_key", "response")}
    for prompt, response in read_jsonl_fields(path, fields, what="SFT data"):
        yield prompt, response


# ------------------------------------------------------------------------------------------------ samples
class SFTDataset:
    """``dataset[i]`` is ``Sample(input_ids=(T,), shift_labels=(T,))`` for record ``i`` (see the module
    docstring); ``T = seq_length``.

    Args:
        pairs: (prompt, response) texts.
        tokenizer: the run's tokenizer; its end-of-document id ends each response and pads.
        seq_length: tokens the model reads per sample.
        max_prompt_length: prompt tokens kept at most (its last ones); default ``seq_length // 2``.
        prompt_template: how a prompt is written before the response, ``{prompt}`` standing for it (e.g.
            ``"### Question:\\n{prompt}\\n### Answer:\\n"``); the template is part of the prompt (no loss).
    """

    def __init__(self, pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, seq_length: int,
                 max_prompt_length: int | None = None, prompt_template: str = "{prompt}"):
        if int(seq_length) != seq_length or seq_length < 2:
            raise DataError(f"seq_length must be an integer of at least 2, got {seq_length!r}.")
        seq_length = int(seq_length)
        if max_prompt_length is None:
            max_prompt_length = seq_length // 2
        if int(max_prompt_length) != max_prompt_length or not 0 <= max_prompt_length < seq_length:
            raise DataError(
                f"max_prompt_length must be an integer in [0, seq_length) = [0, {seq_length}) so that every sample "
                f"has response tokens to learn, got {max_prompt_length!r}."
            )
        if "{prompt}" not in prompt_template:
            raise DataError(
                f"prompt_template {prompt_template!r} has no '{{prompt}}' placeholder; write it where the prompt "
                "goes, e.g. '### Question:\\n{prompt}\\n### Answer:\\n'."
            )
        if not pairs:
            raise DataError("SFTDataset needs at least one (prompt, response) record.")
        self.seq_length = seq_length
        self.max_prompt_length = int(max_prompt_length)
        self.prompt_template = prompt_template
        eos = tokenizer.eod_id
        n, width = len(pairs), seq_length + 1
        prompts = tokenizer.encode_batch([prompt_template.replace("{prompt}", p) for p, _ in pairs])
        responses = tokenizer.encode_batch([r for _, r in pairs])
        self.eos = eos
        self.tokens = np.full((n, width), eos, dtype=np.int64)  # (N, T + 1), padded with EOS ids
        self.is_target = np.zeros((n, width), dtype=bool)  # (N, T + 1): response and EOS tokens
        self.lengths = np.zeros(n, dtype=np.int64)  # (N,): tokens of prompt + response + EOS (no padding)
        self.prompt_truncated = self.response_truncated = 0
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            if len(prompt) > self.max_prompt_length:
                prompt = prompt[len(prompt) - self.max_prompt_length:]  # keep the end, next to the response
                self.prompt_truncated += 1
            answer = response + [eos]
            if len(prompt) + len(answer) > width:
                answer = answer[: width - len(prompt)]
                self.response_truncated += 1
            row = prompt + answer
            self.tokens[i, : len(row)] = row
            self.is_target[i, len(prompt): len(row)] = True
            self.lengths[i] = len(row)
        self.pairs = list(pairs)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        tokens, target = self.tokens[i], self.is_target[i]
        # position t predicts token t + 1: a target only where that token is part of the response
        shift_labels = np.where(target[1:], tokens[1:], IGNORE_INDEX)  # (T,)
        return Sample(input_ids=tokens[:-1], shift_labels=shift_labels)

    @property
    def input_lengths(self) -> np.ndarray:
        """(N,) positions of each sample that are not padding: its tokens but the last (the EOS is a target only)."""
        return self.lengths - 1

    def __repr__(self) -> str:
        return (f"SFTDataset({len(self)} samples of {self.seq_length} tokens; prompts cut to their last "
                f"{self.max_prompt_length} tokens: {self.prompt_truncated}, responses cut: {self.response_truncated})")


def build_sft_datasets(
    tokenizer: Tokenizer,
    data_path: SFTInput = BUILTIN,
    seq_length: int = 512,
    prompt_key: str = "prompt",
    response_key: str = "response",
    valid_fraction: float = 0.1,
    max_prompt_length: int | None = None,
    prompt_template: str = "{prompt}",
    packing: bool = False,
) -> tuple[SFTDataset | PackedDataset, SFTDataset | PackedDataset | None]:
    """Train and validation SFT datasets from ``data_path`` (``"builtin"``, ``.jsonl`` files or directories
    of them, see :func:`read_sft_records`). The last ``valid_fraction`` of the records (at least one) are
    validation, the rest train, in file order; ``valid_fraction=0`` returns ``(train, None)``. ``packing``:
    several samples per row, each split packed on its own (see the module docstring)."""
    if not 0 <= valid_fraction < 1:
        raise DataError(
            f"valid_fraction must be in [0, 1), got {valid_fraction}. Use e.g. 0.1 for 10% of the records, or 0 "
            "for no validation set."
        )
    pairs = read_sft_records(data_path, prompt_key, response_key)

    def make(part):
        padded = SFTDataset(part, tokenizer, seq_length, max_prompt_length, prompt_template)
        return PackedDataset(padded, padded.input_lengths, pad_id=padded.eos) if packing else padded

    if valid_fraction == 0:
        return make(pairs), None
    n_valid = max(1, round(len(pairs) * valid_fraction))
    if len(pairs) - n_valid < 1:
        raise DataError(
            f"SFT data {data_path} has {len(pairs)} record(s); a split with valid_fraction={valid_fraction} needs "
            "at least 2 (one for training, one for validation). Add records, or set valid_fraction=0."
        )
    return make(pairs[:-n_valid]), make(pairs[-n_valid:])
