"""The run's tokenizer: the config's, unless the training data was preprocessed with another one.

A dataset made by ``dufu preprocess`` carries its tokenizer (``<prefix>.tokenizer.json``). Its token ids mean
text only through that tokenizer, so a run on it trains, evaluates, generates and saves ``tokenizer.json`` with
the data's tokenizer: when the config names a different one, the run adopts the data's, says so in its start-up
lines, and writes the adopted tokenizer into its config (``config.yaml`` then reproduces the run).
"""

from __future__ import annotations

from typing import Optional

from dufu.config import instantiate
from dufu.data.dataset import data_tokenizer_file


def run_tokenizer(cfg) -> tuple[object, Optional[str]]:
    """(tokenizer, notice or None); edits ``cfg.tokenization.tokenizer`` when it adopts the data's."""
    configured = instantiate(cfg.tokenization.tokenizer)
    train_data = cfg.dataloader.get("train")
    data_path = train_data.get("data_path") if hasattr(train_data, "get") else None
    saved = data_tokenizer_file(data_path) if data_path is not None else None
    if saved is None:
        return configured, None
    node = cfg.tokenization.tokenizer
    adopted = instantiate(type(node)(node, kind="pretrained", path=str(saved.resolve()), vocab_size=None))
    if adopted.fingerprint == configured.fingerprint:
        return configured, None
    node.update(kind="pretrained", path=str(saved.resolve()), vocab_size=None)
    return adopted, (f"tokenizer: the data was preprocessed with {saved} ({adopted.vocab_size:,} tokens), not the "
                     f"config's {configured.name} tokenizer ({configured.vocab_size:,} tokens): training with the "
                     "data's (tokenization.tokenizer.path in config.yaml)")
