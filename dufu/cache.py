"""dufu's on-disk cache: where it lives, the keys of its entries, atomic writes and a cross-process lock.

Everything dufu derives once and reuses across runs lives under one cache directory,
``$DUFU_CACHE_DIR`` if set, else ``~/.cache/dufu``:

* ``<cache>/tokenizers/bpe-<hash>.json``: trained BPE tokenizers (dufu.data.tokenizer);
* ``<cache>/datasets/<hash>/``: preprocessed datasets (dufu.data.dataset), and
  ``<cache>/token_ids/<hash>.json`` the largest token id of a Megatron file (dufu.data.indexed_dataset);
* ``<cache>/streaming/<hash>/``: Hugging Face weights converted for streamed inference (dufu.engine.inference.streaming_source);
* ``<cache>/inductor/``: torch.compile's persistent caches (dufu.parallel.compile);
* ``<cache>/peak_flops.json`` and ``<cache>/plan_hardware.json``: measured matmul peaks (dufu.engine.reporting.flops) and this
  machine's CPU (dufu.plan.cpu).

Each entry is keyed by a hash of everything that determines its content, so an
entry is never stale: a changed input gets a new key. Entries are written to a
temporary name and renamed into place, so a crash never leaves a file that
looks complete. Under ``torchrun`` every rank may try to build the same entry
at once; :func:`file_lock` makes the others wait and then reuse it.

Below every package that keeps something there (data, engine, parallel, plan), and it imports nothing of dufu.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

try:  # POSIX only; without it concurrent builders just duplicate work.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms
    fcntl = None

CACHE_ENV = "DUFU_CACHE_DIR"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir`` if given, else ``$DUFU_CACHE_DIR``, else ``~/.cache/dufu``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dufu"
    return Path(cache_dir).expanduser()


def short_hash(*parts: str | bytes, length: int = 16) -> str:
    """A hex digest of ``parts`` (order matters; parts are length-prefixed so they cannot run together)."""
    return hash_stream(parts, length=length)


def hash_stream(parts: Iterable[str | bytes], length: int = 16) -> str:
    """Like :func:`short_hash` for an iterable, consumed one part at a time (constant memory)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:length]


def temp_path(path: Path) -> Path:
    """A sibling of ``path`` unique to this process, to write into before renaming."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) while the block runs.

    Used so that only one process builds a cache entry; the others block here
    and then find the finished entry.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
