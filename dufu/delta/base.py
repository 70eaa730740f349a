"""The base a delta belongs to: a checkpoint of a delta run holds only the delta, so it records which base it
was trained on, and a resumed run refuses another one.

The fingerprint of a pretrained directory (a Hugging Face model or a dufu run) hashes, for every weight file,
its relative name, its size and its first and last 1 MiB: reading a multi-GB model in full at every start
would cost more than the check is worth, and a different model differs in these. A base that dufu
initialised is identified by the seed and the model's config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".metadata")
_EDGE = 1 << 20


def base_fingerprint(pretrained: Optional[str], seed: int, model_cfg) -> dict:
    """``{"base": path or None, "fingerprint": hex}`` for the checkpoint's metadata."""
    h = hashlib.sha256()
    if pretrained is None:
        h.update(f"seed {seed}\n".encode())
        h.update(json.dumps(_plain(model_cfg), sort_keys=True, default=str).encode())
        return {"base": None, "fingerprint": h.hexdigest()}
    root = Path(pretrained)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and
                                                 p.name.endswith(_WEIGHT_SUFFIXES) and "delta" not in p.parts)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(root) if f != root else f.name} {size}\n".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            if size > 2 * _EDGE:
                fh.seek(size - _EDGE)
                h.update(fh.read(_EDGE))
    return {"base": str(pretrained), "fingerprint": h.hexdigest()}


def _plain(node):
    """A config node as plain data, the same whether it was loaded from Python or from config.yaml."""
    if isinstance(node, dict) or hasattr(node, "items"):
        return {str(k): _plain(v) for k, v in node.items() if k != "pretrained"}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    if callable(node):  # a class or function: its dotted path, as config.yaml writes it
        return f"{node.__module__}.{node.__qualname__}"
    return node
