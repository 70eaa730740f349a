"""A Megatron-LM / LiBai ``.bin/.idx`` pair trains as it is, in every layout, to the numbers of dufu's own format.

The built-in corpus is tokenized as gpt_debug does (byte tokenizer, end-of-document id after each document)
into dufu's format, and the same documents are written by megatron-core's ``IndexedDatasetBuilder``, each as
two sequences (so dufu must join a document's sequences). gpt_debug trained on the Megatron pair in 1 process,
dp2, tp2 and pp2 logs the losses, evaluation results and final weights of one process trained on dufu's pair
(fp32; tolerances in tests/parity.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from parity import EVAL_ARGS, Spec, assert_matches_reference

with warnings.catch_warnings():  # megatron-core warns that apex / transformer-engine are not installed
    warnings.simplefilter("ignore")
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")

pytestmark = pytest.mark.multiprocess

LAYOUTS = {
    "1proc": (1, []),
    "dp2": (2, ["train.dist.data_parallel_size=2"]),
    "tp2": (2, ["train.dist.tensor_parallel_size=2"]),
    "pp2": (2, ["train.dist.pipeline_parallel_size=2"]),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(dufu prefix, Megatron prefix) holding the same documents of the built-in corpus."""
    import torch

    from dufu.data import IndexedDataset, build_tokenizer, preprocess

    root = tmp_path_factory.mktemp("megatron_data")
    own = preprocess("builtin", root / "dufu", build_tokenizer("byte"), show_progress=False)
    ds = IndexedDataset(own)
    megatron = str(root / "megatron")
    builder = mc.IndexedDatasetBuilder(megatron + ".bin", dtype=np.uint16)
    for i in range(ds.num_documents):
        doc = np.asarray(ds.document(i), dtype=np.int64)
        for part in np.array_split(doc, 2):
            builder.add_item(torch.from_numpy(part))
        builder.end_document()
    builder.finalize(megatron + ".idx")
    got = IndexedDataset(megatron)
    assert got.format == "megatron" and len(got.sequence_lengths) == 2 * ds.num_documents
    assert np.array_equal(got.doc_offsets, ds.doc_offsets)
    return own, megatron


@pytest.fixture(scope="module")
def reference(pairs, reference_run):
    return reference_run("gpt_debug", f"dataloader.train.data_path={pairs[0]}", *EVAL_ARGS)  # in this process


@pytest.fixture(scope="module")
def layout_runs(pairs, shared_runs, reference_run):
    """The multi-process layouts' runs, launched together (tests/parity.py's SharedRuns); one process: in this one."""
    args = (f"dataloader.train.data_path={pairs[1]}", *EVAL_ARGS)
    runs = shared_runs({layout: Spec(nproc, (*args, *overrides)) for layout, (nproc, overrides) in LAYOUTS.items()
                        if nproc > 1})
    return lambda layout: reference_run("gpt_debug", *args) if LAYOUTS[layout][0] == 1 else runs.result(layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_pair_trains_like_dufu_format(layout, pairs, reference, layout_runs):
    got = layout_runs(layout)
    assert sorted(got.evals) == [0, 5], f"{layout}: evaluations at steps {sorted(got.evals)}"
    assert_matches_reference(got, reference, f"Megatron data, {layout}")
