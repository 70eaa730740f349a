"""Packed supervised fine-tuning (llama_sft with ``dataloader.train.packing=True``: several prompt/response samples
per row, position ids restarting at each, attention block-causal) trains to the same numbers in parallel layouts
as on one process. The position ids are model keyword arguments: every pipeline stage gets them and builds the
same mask, and under sequence parallelism the attention, which gathers the sequence, gets the whole mask. Under
context parallelism every rank holds two of each row's 2 cp chunks: the documents are numbered on the whole row
before the split and every attention builds its chunks' block-causal mask over the gathered keys
(dufu.parallel.context_parallel): all-gathering K/V alone and with pipeline stages, and Ulysses' all-to-all with
tensor + sequence parallelism.

The built-in pairs (71 training samples of 102-642 byte tokens) at seq_length 1024 pack into 40 rows, 1-3 samples
each; fp32, fixed global batch 8 and micro-batch 2, 5 steps, from the same pretrained llama_debug weights (with
1024 positions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dufu_testing import train
from parity import Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

SEQ = 1024
DP2 = "train.dist.data_parallel_size=2"
TP2 = "train.dist.tensor_parallel_size=2"
CP2 = "train.dist.context_parallel_size=2"
PP2 = "train.dist.pipeline_parallel_size=2"
SP = "train.dist.sequence_parallel=True"
# layout: (processes, overrides)
LAYOUTS = {
    "dp2": (2, [DP2]),
    "dp2-zero3": (2, [DP2, "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"]),
    "tp2-sp": (2, [TP2, SP]),
    "pp2": (2, [PP2]),
    "cp2": (2, [CP2]),  # K/V all-gathered
    # Ulysses: each tensor-parallel rank's 2 query heads split over cp 2, its one K/V head repeated to 2
    "cp2-tp2-sp-ulysses": (4, [CP2, TP2, SP, "train.dist.context_parallel_mode=all_to_all"]),
    "cp2-pp2": (4, [CP2, PP2]),
}


def packing_args() -> list[str]:
    """Packing at seq_length 1024."""
    return ["dataloader.train.packing=True", f"dataloader.train.seq_length={SEQ}",
            f"model.max_position_embeddings={SEQ}"]


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory, dufu_cache_dir, reference_run):
    root = tmp_path_factory.mktemp("packed_sft")
    pretrained = root / "pretrained"
    train(pretrained, ["train.train_iter=2", "train.checkpointer.period=2", f"model.max_position_embeddings={SEQ}"],
          recipe="llama_debug")
    args = [f"model.pretrained={pretrained}", *packing_args()]
    reference = reference_run("llama_sft", *args)  # one process, in this one
    data = yaml.safe_load((Path(reference.output_dir) / "config.yaml").read_text())["dataloader"]["train"]
    assert data["packing"] is True and data["seq_length"] == SEQ
    return args, reference


@pytest.fixture(scope="module")
def layout_runs(packed_reference, shared_runs):
    """Every layout's run, launched together (tests/parity.py's SharedRuns)."""
    args, _ = packed_reference
    return shared_runs({layout: Spec(nproc, (*args, *overrides), config="llama_sft")
                        for layout, (nproc, overrides) in LAYOUTS.items()})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_sft_layout_matches_single_process(layout, packed_reference, layout_runs):
    args, reference = packed_reference
    got = layout_runs.result(layout)
    assert_matches_reference(got, reference, f"packed llama_sft {layout}")
