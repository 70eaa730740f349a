"""A torchrun worker: ``dufu train`` with every tensor read from a Hugging Face directory recorded, per rank,
in ``$DUFU_TEST_READS/rank<r>.txt``, one a line, written at once (dufu ends its workers with ``os._exit``):
``name`` for a whole tensor, ``name[start:stop,...]`` for a block of one. Used to check that each rank reads
only what it holds."""

import os
import sys
from pathlib import Path

from dufu.cli import main
from dufu.models import hub

_original = hub.HFWeights.__getitem__
_log = Path(os.environ["DUFU_TEST_READS"]) / f"rank{os.environ.get('RANK', '0')}.txt"
_log.touch()


def _recording(self, key):
    with _log.open("a") as f:
        f.write(key + "\n")
    return _original(self, key)


_original_slice = hub.HFWeights.read_slice


def _recording_slice(self, key, index):
    with _log.open("a") as f:
        f.write(f"{key}[{','.join(f'{i.start}:{i.stop}' for i in index)}]\n")
    return _original_slice(self, key, index)


hub.HFWeights.__getitem__ = _recording
hub.HFWeights.read_slice = _recording_slice
sys.exit(main(sys.argv[1:]))
