"""Packed samples and document masks (dufu.data.packing, dufu.layers.attention.document_mask): a packed sample's
loss is the one it has padded alone, no token attends across a sample or document boundary, and batches that are
not packed (unbroken position ids, left-padded prompts, generation) run exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dufu.models.llama.model as llama_module
from dufu.data import IndexedDataset, IndexedDatasetWriter, TokenDataset, collate
from dufu.data.packing import (
    DocumentMaskedDataset,
    PackedDataset,
    document_position_ids,
    pack_best_fit,
)
from dufu.data.sft import IGNORE_INDEX, SFTDataset, build_sft_datasets
from dufu.delta import PrefixTuning, PromptTuning, apply_delta
from dufu.engine.batch import count_loss_targets, to_model_inputs
from dufu.engine.inference.generate import generate
from dufu.errors import DataError
from dufu.layers.attention import Attention, document_mask
from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel
from dufu.models.moe.model import MoEModel

SEQ = 64
PAIRS = [("What is 2+2?\n", "4"), ("Name a colour.\n", "Blue, like the sky on a clear day."),
         ("x", "yz"), ("Say hello.\n", "Hello!"), ("", "A response without a prompt."),
         ("Explain the for statement.\n", "It iterates over the items of a sequence."),
         ("Q\n", "A"), ("Count to five.\n", "1 2 3 4 5"), ("Is water wet?\n", "Yes."),
         ("Spell dufu.\n", "d-u-f-u")]


def llama(max_positions: int = SEQ) -> LlamaModel:
    torch.manual_seed(0)  # llama_debug's sizes
    return LlamaModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      ffn_hidden_size=176, max_position_embeddings=max_positions, rms_norm_eps=1e-6).eval()


def gpt(max_positions: int = SEQ) -> GPTModel:
    torch.manual_seed(0)  # gpt_debug-like sizes
    return GPTModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4,
                    max_position_embeddings=max_positions).eval()


def moe(max_positions: int = SEQ) -> MoEModel:
    torch.manual_seed(0)  # moe_debug's sizes; dropless routing is per token, so packing changes no routing
    return MoEModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    ffn_hidden_size=64, max_position_embeddings=max_positions, num_experts=8, top_k=2,
                    moe_ffn_hidden_size=64).eval()


MODELS = {"llama": llama, "gpt": gpt, "moe": moe}


def token_losses(model, batch: dict) -> torch.Tensor:
    """(B, T) cross entropy of every position against ``shift_labels`` (0 where the label is -100)."""
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    logits = model(**inputs).logits  # (B, T, V)
    labels = batch["shift_labels"]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")


# ------------------------------------------------------------------------------------------ packing
def test_best_fit_in_dataset_order():
    # 6 opens row 0 (room 4 left), 5 opens row 1 (room 5); 3 goes where the least room holds it: row 0 (1 left);
    # 4 only fits row 1 (1 left); 1 fills row 0, the earlier of the two rows with room 1; 2 fits nowhere: row 2
    assert pack_best_fit([6, 5, 3, 4, 1, 2], capacity=10) == [[0, 2, 4], [1, 3], [5]]
    # on a tie in room the earliest row wins; empty items are left out
    assert pack_best_fit([7, 7, 0, 3], capacity=10) == [[0, 3], [1]]
    assert pack_best_fit([10, 10], capacity=10) == [[0], [1]]
    with pytest.raises(DataError, match="sample 1 has 11 tokens, more than the 10"):
        pack_best_fit([3, 11], capacity=10)


def test_packed_sft_rows_hold_every_sample_once(byte_tok):
    padded = SFTDataset(PAIRS, byte_tok, seq_length=SEQ)
    packed = PackedDataset(padded, padded.input_lengths, pad_id=byte_tok.eod_id)
    assert len(packed) < len(padded) and packed.seq_length == SEQ and packed.num_samples == len(PAIRS)
    assert sorted(s for row in packed.rows for s in row) == list(range(len(PAIRS)))
    seen_targets = 0
    for r in range(len(packed)):
        row = packed[r]
        assert row.shape == (SEQ + 1,) and {k: v.shape for k, v in row.items()} == {
            "input_ids": (SEQ,), "shift_labels": (SEQ,), "position_ids": (SEQ,)}
        end = 0
        for s, start, n in packed.spans(r):
            alone = padded[s]
            assert start == end and n == padded.lengths[s] - 1
            assert (row["input_ids"][start:start + n] == alone["input_ids"][:n]).all()
            assert (row["shift_labels"][start:start + n] == alone["shift_labels"][:n]).all()
            assert row["position_ids"][start:start + n].tolist() == list(range(n))
            # the padded sample has nothing to learn after its real positions
            assert (alone["shift_labels"][n:] == IGNORE_INDEX).all()
            end = start + n
        # the tail: padding ids, no targets, positions of their own
        assert (row["input_ids"][end:] == byte_tok.eod_id).all() and (row["shift_labels"][end:] == IGNORE_INDEX).all()
        assert row["position_ids"][end:].tolist() == list(range(SEQ - end))
        seen_targets += int((row["shift_labels"] != IGNORE_INDEX).sum())
    everything = to_model_inputs(collate(padded, range(len(padded))))
    assert seen_targets == int(count_loss_targets(everything))  # the loss averages over the same targets
    assert 0 < packed.padding_share < 1 and "best-fit" in repr(packed)


def test_build_sft_datasets_packs_both_splits(byte_tok):
    train, valid = build_sft_datasets(byte_tok, seq_length=1024, packing=True)
    plain_train, plain_valid = build_sft_datasets(byte_tok, seq_length=1024)
    assert isinstance(train, PackedDataset) and isinstance(valid, PackedDataset)
    assert (train.num_samples, valid.num_samples) == (len(plain_train), len(plain_valid))
    assert len(train) < len(plain_train) and train.seq_length == 1024
    batch = collate(train, [0, 1])
    assert set(batch) == {"input_ids", "shift_labels", "position_ids"}
    assert all(t.dtype == torch.int64 and t.shape == (2, 1024) for t in batch.values())


# ------------------------------------------------------------------------------------------ the proof
@pytest.mark.parametrize("family", list(MODELS))
def test_packed_losses_equal_padded_losses_per_sample(family, byte_tok):
    model = MODELS[family]()
    padded = SFTDataset(PAIRS, byte_tok, seq_length=SEQ)
    packed = PackedDataset(padded, padded.input_lengths, pad_id=byte_tok.eod_id)
    assert max(len(row) for row in packed.rows) >= 3  # really packed
    with torch.no_grad():
        alone = token_losses(model, collate(padded, range(len(padded))))  # (N, T)
        rows = token_losses(model, collate(packed, range(len(packed))))  # (R, T)
        for r in range(len(packed)):
            for s, start, n in packed.spans(r):
                targets = int((padded[s]["shift_labels"] != IGNORE_INDEX).sum())
                want = alone[s].sum() / targets
                got = rows[r, start:start + n].sum() / targets
                assert abs(got - want) <= 1e-5, (family, s, got.item(), want.item())
        # and the batch loss the trainer takes: the mean over all response tokens, either way
        loss_padded = model(**to_model_inputs(collate(padded, range(len(padded))))).loss
        loss_packed = model(**to_model_inputs(collate(packed, range(len(packed))))).loss
    assert abs(loss_packed - loss_padded) <= 1e-5 * loss_padded


@pytest.mark.parametrize("family", list(MODELS))
def test_a_token_never_sees_another_document(family):
    model = MODELS[family]()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 384, (2, 40), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in (12, 9, 19)])[None].expand(2, -1)  # 3 documents per row
    other = ids.clone()
    other[:, 12:21] = torch.randint(0, 384, (2, 9), generator=g)  # change the middle document only
    with torch.no_grad():
        a = model(ids, position_ids=position_ids).logits
        b = model(other, position_ids=position_ids).logits
        first_alone = model(ids[:, :12]).logits
        last_alone = model(ids[:, 21:]).logits
    assert not torch.allclose(a[:, 12:21], b[:, 12:21])
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[:, 21:], b[:, 21:], rtol=0, atol=1e-6)
    # each document is computed as if it were alone in the row
    torch.testing.assert_close(a[:, :12], first_alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(a[:, 21:], last_alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(MODELS))
def test_unbroken_position_ids_are_bit_identical_to_none(family):
    model = MODELS[family]()
    ids = torch.randint(0, 384, (3, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids).logits
        for position_ids in (torch.arange(30)[None], torch.arange(30)[None].expand(3, -1)):
            assert torch.equal(model(ids, position_ids=position_ids).logits, plain)


def test_document_mask_keeps_unbroken_rows_on_the_plain_path():
    assert document_mask(torch.arange(16)[None]) is None
    assert document_mask(torch.arange(5, 21)[None].expand(4, -1)) is None  # after a cache of 5: still one run
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding repeats 0; a right-padded row runs on
    assert document_mask(positions, mask) is mask
    # the same positions without the padding mask: the padding is a document of its own
    assert document_mask(positions).shape == (3, 1, 5, 5)


def test_document_mask_is_block_causal_and_keeps_padding_out():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    keep = document_mask(position_ids)[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    want = (doc[:, None] == doc[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(keep, want)
    # a padding mask on top: a padded key is never attended to, and padding breaks no document
    position_ids = torch.tensor([[0, 1, 0, 0, 1, 2, 0, 1]])  # [doc a: 2][pad][doc b: 3][doc c: 2]
    pad = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])
    keep = document_mask(position_ids, pad)[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    want = (doc[:, None] == doc[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril() & pad.bool()
    assert torch.equal(keep, want)
    with pytest.raises(ValueError, match="combine with a"):
        document_mask(position_ids, torch.zeros(1, 1, 8, 8))


def test_boolean_mask_is_the_whole_mask_in_attention():
    torch.manual_seed(0)
    attn = Attention(32, 4, num_key_value_heads=2).eval()
    x = torch.randn(2, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(attn(x, attention_mask=causal[None, None]), attn(x), rtol=0, atol=1e-6)
        # not causal: the mask says everything (here: attend to all)
        full = attn(x, attention_mask=torch.ones(1, 1, 10, 10, dtype=torch.bool))
        assert not torch.allclose(full, attn(x))


def test_prefix_tuning_keeps_its_prefix_visible_to_every_document():
    model = llama()
    apply_delta(model, PrefixTuning(num_virtual_tokens=4))
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(n) for n in (12, 9, 19)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits
        torch.testing.assert_close(packed[:, 12:21], model(ids[:, 12:21]).logits, rtol=0, atol=1e-5)
    # prompt tuning's virtual tokens lengthen the sequence inside the model: refused with the reason
    model = llama()
    apply_delta(model, PromptTuning(num_virtual_tokens=4))
    with pytest.raises(ValueError, match="prompt tuning's virtual tokens"):
        model(ids, position_ids=position_ids)


def test_generation_never_builds_a_document_mask(monkeypatch):
    model = llama()
    calls = []

    def spy(position_ids, attention_mask=None):
        out = document_mask(position_ids, attention_mask)
        calls.append(out is attention_mask)
        return out

    monkeypatch.setattr(llama_module, "document_mask", spy)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 384, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :2] = 0
    with_cache = generate(model, prompts, 6, temperature=0, attention_mask=mask)
    without = generate(model, prompts, 6, temperature=0, attention_mask=mask, use_cache=False)
    assert torch.equal(with_cache, without)
    assert calls and all(calls)  # the no-cache steps passed positions and a padding mask: unchanged
    for row in range(3):  # each prompt alone gives what it gave in the padded batch
        start = int((mask[row] == 0).sum())
        alone = generate(model, prompts[row:row + 1, start:], 6, temperature=0)
        assert torch.equal(alone[0], with_cache[row, start:])


# ------------------------------------------------------------------------------------------ document masks
def test_document_position_ids_restart_at_every_document():
    offsets = np.array([0, 5, 8, 20, 21, 30])
    assert document_position_ids(0, 10, offsets).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert document_position_ids(6, 6, offsets).tolist() == [0, 1, 0, 1, 2, 3]  # a cut document starts at 0
    assert document_position_ids(8, 4, offsets).tolist() == [0, 1, 2, 3]  # the window starts on a boundary
    assert document_position_ids(18, 5, offsets).tolist() == [0, 1, 0, 0, 1]  # a one-token document


def write_documents(prefix, docs, vocab=384):
    with IndexedDatasetWriter(prefix, vocab) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


def test_document_masked_samples_are_the_token_samples_with_their_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 383, n) for n in (13, 4, 30, 7, 9, 25)]
    indexed = write_documents(tmp_path / "docs", docs)
    tokens = TokenDataset(indexed, seq_length=16, start_token=3)
    masked = DocumentMaskedDataset(tokens)
    assert len(masked) == len(tokens) and masked.seq_length == 16 and masked.num_tokens == tokens.num_tokens
    for i in range(len(tokens)):
        s, window = masked[i], tokens[i]
        assert (s["input_ids"] == window[:-1]).all() and (s["shift_labels"] == window[1:]).all()
        start = 3 + 16 * i
        doc_start = {int(o) - start for o in indexed.doc_offsets if start < o < start + 16}
        assert {t for t in range(1, 16) if s["position_ids"][t] == 0} == doc_start
    # and the model computes each document of a sample as if it were alone
    model = llama(max_positions=16)
    s = masked[1]
    ids, pos = torch.from_numpy(s["input_ids"])[None], torch.from_numpy(s["position_ids"])[None]
    with torch.no_grad():
        whole = model(ids, position_ids=pos).logits
        starts = [t for t in range(16) if pos[0, t] == 0] + [16]
        for a, b in zip(starts, starts[1:]):
            torch.testing.assert_close(whole[:, a:b], model(ids[:, a:b]).logits, rtol=0, atol=1e-5)


def test_build_lm_datasets_with_document_mask(tmp_path, byte_tok):
    from dufu.data import build_lm_datasets

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "document number {i} says {"hello " * i}"}}\n' for i in range(30)))
    train, valid = build_lm_datasets(data_path=str(path), tokenizer=byte_tok, seq_length=32, valid_fraction=0.1,
                                     document_mask=True)
    assert isinstance(train, DocumentMaskedDataset) and isinstance(valid, DocumentMaskedDataset)
    batch = to_model_inputs(collate(train, [0, 1, 2]))
    assert set(batch) == {"input_ids", "shift_labels", "position_ids"}
    assert (batch["position_ids"][:, 1:] == 0).any()  # documents start inside samples
    plain, _ = build_lm_datasets(data_path=str(path), tokenizer=byte_tok, seq_length=32, valid_fraction=0.1)
    assert isinstance(plain, TokenDataset) and (plain[0] == train.tokens[0]).all()
