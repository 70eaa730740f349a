import pytest

import dufu.data.tokenizer as tokenizer_module
from dufu.data import Tokenizer, build_tokenizer
from dufu.errors import DataError

SAMPLES = [
    "Hello, world!",
    "héllo wörld — Grüße, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский",
    "  leading spaces\n\ttabs\r\nand \x00 control \x7f bytes  ",
    "a literal <|endoftext|> inside a document",
    "",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert byte_tok.decode(ids) == text


def test_byte_tokenizer_basics(byte_tok):
    assert byte_tok.vocab_size == 257
    assert byte_tok.eod_id == 256
    assert byte_tok.kind == "byte"
    assert byte_tok.decode([104, 105, byte_tok.eod_id]) == "hi<|endoftext|>"
    assert byte_tok.encode_batch(["é", "ab"]) == [[0xC3, 0xA9], [97, 98]]
    # A literal "<|endoftext|>" in text is text, never the end-of-document id.
    assert byte_tok.eod_id not in byte_tok.encode("x <|endoftext|> y")
    with pytest.raises(DataError, match="always has 257 tokens"):
        build_tokenizer("byte", vocab_size=1000)


def test_bpe_train_round_trip_and_cache_hit(cache_dir, monkeypatch):
    tok = build_tokenizer("bpe", vocab_size=1000)
    assert tok.kind == "bpe" and tok.vocab_size == 1000
    assert tok.backend.id_to_token(tok.eod_id) == "<|endoftext|>"
    files = list((cache_dir / "tokenizers").glob("bpe-*.json"))
    assert len(files) == 1
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    text = "The assert statement is a convenient way to insert debugging assertions"
    assert len(tok.encode(text)) < len(text.encode()) / 2  # it learned merges

    # Second call must load the cache, not train: make training impossible.
    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of using the cache")

    monkeypatch.setattr(tokenizer_module.trainers, "BpeTrainer", no_training)
    again = build_tokenizer("bpe", vocab_size=1000)
    assert again.fingerprint == tok.fingerprint
    assert again.encode(text) == tok.encode(text)


def test_bpe_is_deterministic_and_keyed_by_corpus(tmp_path, text_dir):
    a = build_tokenizer("bpe", vocab_size=600, cache_dir=tmp_path / "c1")
    b = build_tokenizer("bpe", vocab_size=600, cache_dir=tmp_path / "c2")
    assert a.to_str() == b.to_str()
    c = build_tokenizer("bpe", vocab_size=600, corpus=text_dir, cache_dir=tmp_path / "c1")
    assert c.fingerprint != a.fingerprint
    assert len(list((tmp_path / "c1" / "tokenizers").glob("bpe-*.json"))) == 2


def test_bpe_needs_valid_vocab_size():
    with pytest.raises(DataError, match="needs vocab_size >= 257"):
        build_tokenizer("bpe")
    with pytest.raises(DataError, match="needs vocab_size >= 257"):
        build_tokenizer("bpe", vocab_size=100)


def test_unknown_kind_lists_kinds():
    with pytest.raises(DataError, match="'byte'.*'bpe'.*'pretrained'"):
        build_tokenizer("sentencepiece")


def test_pretrained_from_saved_file_and_directory(tmp_path, byte_tok):
    bpe = build_tokenizer("bpe", vocab_size=500)
    path = bpe.save(tmp_path / "tok" / "tokenizer.json")
    for p in (path, tmp_path / "tok"):
        loaded = build_tokenizer("pretrained", path=p)
        assert loaded.kind == "pretrained"
        assert loaded.fingerprint == bpe.fingerprint
        assert (loaded.vocab_size, loaded.eod_id) == (bpe.vocab_size, bpe.eod_id)
        assert loaded.encode(SAMPLES[1]) == bpe.encode(SAMPLES[1])
    assert Tokenizer.from_file(byte_tok.save(tmp_path / "byte.json")).eod_id == 256


def test_pretrained_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="needs path="):
        build_tokenizer("pretrained")
    missing = tmp_path / "nope.json"
    with pytest.raises(DataError, match=f"{missing} does not exist"):
        build_tokenizer("pretrained", path=missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match=f"{corrupt} could not be read"):
        build_tokenizer("pretrained", path=corrupt)
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "vocab.json").write_text("{}")
    with pytest.raises(DataError, match="has no tokenizer.json"):
        build_tokenizer("pretrained", path=tmp_path / "hfdir")


def test_pretrained_eod_lookup(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    backend = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "</s>": 2, "[SEP]": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    assert Tokenizer(backend).eod_id == 2  # </s> comes before [SEP]
    assert Tokenizer(backend, eod_token="[SEP]").eod_id == 3
    bare = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    with pytest.raises(DataError, match="end-of-document"):
        Tokenizer(bare)
