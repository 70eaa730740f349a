"""SFT data: prompt + response + EOS, right-padded; targets only on the response (and its EOS)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dufu.data import collate
from dufu.data.sft import (
    IGNORE_INDEX,
    SFTDataset,
    build_sft_datasets,
    builtin_sft_records,
    read_sft_records,
)
from dufu.errors import DataError


def write_jsonl(path, records, raw_lines=()):
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_sample_layout_masks_prompt_and_padding(byte_tok):
    eos = byte_tok.eod_id
    ds = SFTDataset([("Q: 2+2?\n", "4")], byte_tok, seq_length=16)
    s = ds[0]
    prompt, response = byte_tok.encode("Q: 2+2?\n"), byte_tok.encode("4")
    row = prompt + response + [eos]
    assert s.shape == (17,) and s["input_ids"].shape == s["shift_labels"].shape == (16,)
    # inputs: the sequence, then padding (the EOS id; a causal model never looks right of a position)
    assert s["input_ids"][: len(row)].tolist() == row and (s["input_ids"][len(row):] == eos).all()
    # targets: position t predicts token t + 1, counted only when that token is response or EOS
    expected = [IGNORE_INDEX] * 16
    expected[len(prompt) - 1] = response[0]  # the prompt's last position predicts the answer's first token
    expected[len(prompt)] = eos  # and the answer is followed by the end
    assert s["shift_labels"].tolist() == expected


def test_targets_are_exactly_the_response_tokens(byte_tok):
    pairs = [("Explain: for\n", "The for statement iterates."), ("x", "yz"), ("", "only a response")]
    ds = SFTDataset(pairs, byte_tok, seq_length=48)
    for i, (p, r) in enumerate(pairs):
        s = ds[i]
        kept = s["shift_labels"][s["shift_labels"] != IGNORE_INDEX].tolist()
        answer = byte_tok.encode(r) + [byte_tok.eod_id]
        # an empty prompt: the first response token has nothing before it to be predicted from
        assert kept == (answer[1:] if not p else answer)


def test_long_prompt_keeps_its_end_and_response_is_cut(byte_tok):
    prompt, response = "p" * 10 + "0123456789", "r" * 40
    ds = SFTDataset([(prompt, response)], byte_tok, seq_length=16, max_prompt_length=8)
    s = ds[0]
    tokens = np.append(s["input_ids"], ds.tokens[0, -1])  # the seq_length + 1 tokens of the sample
    assert byte_tok.decode(tokens[:8]) == "23456789"  # the last 8 prompt tokens, next to the response
    assert byte_tok.decode(tokens[8:]) == "r" * 9  # the response fills the rest, cut at the end (no EOS)
    assert (s["shift_labels"][:7] == IGNORE_INDEX).all() and (s["shift_labels"][7:] != IGNORE_INDEX).all()
    assert (ds.prompt_truncated, ds.response_truncated) == (1, 1)
    # the default keeps at most half of seq_length of the prompt: every sample has response targets
    default = SFTDataset([("p" * 100, "r")], byte_tok, seq_length=16)
    assert (default[0]["shift_labels"] != IGNORE_INDEX).sum() == 2  # "r" and EOS


def test_prompt_template_is_part_of_the_prompt(byte_tok):
    ds = SFTDataset([("hi", "yo")], byte_tok, seq_length=64, prompt_template="### Q:\n{prompt}\n### A:\n")
    n_prompt = len(byte_tok.encode("### Q:\nhi\n### A:\n"))
    assert byte_tok.decode(ds[0]["input_ids"][:n_prompt]) == "### Q:\nhi\n### A:\n"
    assert (ds[0]["shift_labels"][: n_prompt - 1] == IGNORE_INDEX).all()
    with pytest.raises(DataError, match=r"no '\{prompt\}' placeholder"):
        SFTDataset([("hi", "yo")], byte_tok, seq_length=32, prompt_template="### Q:\n")


def test_collate_gives_model_inputs(byte_tok):
    ds = SFTDataset([("a", "b"), ("cc", "dd")], byte_tok, seq_length=8)
    batch = collate(ds, [0, 1])
    assert set(batch) == {"input_ids", "shift_labels"}
    assert batch["input_ids"].dtype == batch["shift_labels"].dtype == torch.int64
    assert batch["input_ids"].shape == batch["shift_labels"].shape == (2, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_length=1), "seq_length must be an integer of at least 2"),
        (dict(seq_length=16, max_prompt_length=16), r"max_prompt_length must be an integer in \[0, seq_length\)"),
        (dict(seq_length=16, max_prompt_length=-1), "max_prompt_length must be an integer"),
    ],
)
def test_bad_lengths(byte_tok, kwargs, message):
    with pytest.raises(DataError, match=message):
        SFTDataset([("a", "b")], byte_tok, **kwargs)


def test_jsonl_records_with_custom_fields_and_split(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"question": f"q{i}", "answer": f"a{i}", "id": i} for i in range(10)],
                       raw_lines=["", "   "])
    assert read_sft_records(path, "question", "answer")[3] == ("q3", "a3")
    train, valid = build_sft_datasets(byte_tok, path, seq_length=16, prompt_key="question", response_key="answer",
                                      valid_fraction=0.2)
    assert (len(train), len(valid)) == (8, 2)
    assert valid.pairs == [("q8", "a8"), ("q9", "a9")]  # the last records, in file order
    only, none = build_sft_datasets(byte_tok, [path, path], seq_length=16, prompt_key="question",
                                    response_key="answer", valid_fraction=0)
    assert len(only) == 20 and none is None


@pytest.mark.parametrize(
    "lines, fragments",
    [
        (['{"prompt": "a", "response": "b"}', '{"prompt": "a", "response": '],
         ["Line 2 of {path} is not valid JSON", "one JSON object such as", "fix or remove that line"]),
        (['{"prompt": "a", "response": "b"}', '["a", "b"]'],
         ["Line 2 of {path} is a JSON list, not an object"]),
        (['{"prompt": "a", "response": "b"}', '', '{"prompt": "a", "text": "b"}'],
         ["Line 3 of {path} has no field 'response' (found: ['prompt', 'text'])",
          "Set dataloader.train.response_key to the field that holds the response"]),
        (['{"question": "a", "response": "b"}'],
         ["Line 1 of {path} has no field 'prompt'", "dataloader.train.prompt_key"]),
        (['{"prompt": 3, "response": "b"}'],
         ["Line 1 of {path}: field 'prompt' is a int, not a string"]),
        (['', '  '], ["holds no records"]),
    ],
)
def test_jsonl_errors_name_the_file_and_line(tmp_path, lines, fragments):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        read_sft_records(path)
    for fragment in fragments:
        assert fragment.format(path=path) in str(info.value)


def test_other_inputs_are_refused_clearly(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("plain text", encoding="utf-8")
    with pytest.raises(DataError, match=r"notes.txt is a .txt file, but prompt/response records come from .jsonl"):
        read_sft_records(text)
    with pytest.raises(DataError, match="does not exist"):
        read_sft_records(tmp_path / "missing.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl is not valid UTF-8"):
        read_sft_records(tmp_path / "latin1.jsonl")


def test_builtin_records(byte_tok):
    records = builtin_sft_records()
    from pydoc_data.topics import topics

    assert len(records) == len(topics)
    first = records[0]
    assert first["prompt"] == f"Explain the Python topic: {sorted(topics)[0]}\n"
    assert first["response"] and first["response"] in topics[sorted(topics)[0]]  # its opening, title dropped
    assert all(r["response"].strip() and "\n*****" not in r["response"] for r in records)
    train, valid = build_sft_datasets(byte_tok, "builtin", seq_length=64)
    assert len(train) + len(valid) == len(records) and len(valid) == round(len(records) * 0.1)
    assert all((train[i]["shift_labels"] != IGNORE_INDEX).any() for i in range(len(train)))
