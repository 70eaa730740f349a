"""Generation beyond greedy sampling: beam search, repetition penalty, stop strings, batched prompts and T5.

Greedy and beam output equal transformers' ``generate`` token for token on the same random weights (GPT-2,
LLaMA, T5), with and without an end id; the repetition penalty equals transformers' with ``do_sample=False``;
a left-padded batch gives each prompt the tokens it gets alone; T5 decodes the same with and without its KV
cache; stop strings end a row where its text first contains one; ``dufu generate`` takes several prompts, a
prompts file, beams, penalties and stop strings, and generates with T5 from the encoder input."""

from __future__ import annotations

import pytest
import torch

import dufu
from dufu.engine.inference.generate import StopStrings, apply_repetition_penalty, continuation_text, generate
from dufu.errors import ConfigError, DataError
from dufu.layers import KVCache

transformers = pytest.importorskip("transformers")

V, NEW = 256, 20
# (num_beams, length_penalty, early_stopping): the default, early stopping, "never" with a short penalty
BEAMS = [(4, 1.0, False), (3, 2.0, True), (4, 0.5, "never")]


def scaled(model, factor: float = 4.0, skip: str = "\0"):
    """Larger weights than the default init: far-from-uniform predictions, so near-ties are unlikely."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if skip not in name:
                p.mul_(factor)
    return model.eval()


def hf_generate(hf, ids, mask=None, eos=None, **kw):
    """transformers' generate, deterministic; finished rows are filled with the end id (as dufu fills them)."""
    mask = torch.ones_like(ids) if mask is None else mask
    return hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                       pad_token_id=eos if eos is not None else 0, **kw)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def causal(request, tmp_path_factory):
    """(transformers model, the same weights imported into dufu)."""
    torch.manual_seed(0)
    if request.param == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None))
    hf = scaled(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, dufu.from_pretrained(path)


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                dropout_rate=0.0, decoder_start_token_id=0)
    hf = scaled(transformers.T5ForConditionalGeneration(cfg), skip="layer_norm")
    path = tmp_path_factory.mktemp("t5")
    hf.save_pretrained(path)
    ours = dufu.from_pretrained(path)
    assert type(ours).__name__ == "T5ForConditionalGeneration"
    return hf, ours


PROMPTS = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(1))


def end_ids(greedy: torch.Tensor, start: int) -> list[int]:
    """End ids that occur in the middle of the greedy outputs, so they end some searches early."""
    return [int(greedy[0, start + 3]), int(greedy[1, start + 8]), int(greedy[2, start + 5])]


def padded_batch(lengths=(6, 3, 4)):
    """PROMPTS left-padded to `lengths` real tokens each: (ids with padding 0, attention mask)."""
    mask = torch.zeros_like(PROMPTS)
    for i, n in enumerate(lengths):
        mask[i, PROMPTS.shape[1] - n:] = 1
    return PROMPTS.masked_fill(mask == 0, 0), mask


# --------------------------------------------------------------------- causal LMs against transformers
def test_greedy_and_beam_equal_transformers(causal):
    hf, ours = causal
    T = PROMPTS.shape[1]
    greedy = generate(ours, PROMPTS, NEW, temperature=0)
    assert torch.equal(greedy, hf_generate(hf, PROMPTS))
    ended = 0  # best sequences that end with an end id
    for eos in [None, *end_ids(greedy, T)]:
        if eos is not None:
            got = generate(ours, PROMPTS, NEW, temperature=0, eos_id=eos)
            assert torch.equal(got, hf_generate(hf, PROMPTS, eos=eos)), eos
        for beams, length_penalty, early in BEAMS:
            kw = dict(num_beams=beams, length_penalty=length_penalty, early_stopping=early)
            got = generate(ours, PROMPTS, NEW, temperature=0, eos_id=eos, **kw)
            assert torch.equal(got, hf_generate(hf, PROMPTS, eos=eos, **kw)), (eos, kw)
            ended += int((got[:, T:] == eos).any(1).sum()) if eos is not None else 0
            if eos is None:  # the cache, reordered by beam every step, changes nothing
                assert torch.equal(generate(ours, PROMPTS, NEW, use_cache=False, **kw), got)
    assert ended >= 3  # the end ids did end the best hypotheses of several searches


def test_repetition_penalty_equals_transformers(causal):
    hf, ours = causal
    for penalty in (1.5, 0.7):
        for beams in (1, 3):
            got = generate(ours, PROMPTS, NEW, temperature=0, num_beams=beams, repetition_penalty=penalty)
            assert torch.equal(got, hf_generate(hf, PROMPTS, num_beams=beams, repetition_penalty=penalty))
            assert not torch.equal(got, generate(ours, PROMPTS, NEW, temperature=0, num_beams=beams))


def test_left_padded_batch_equals_each_prompt_alone(causal):
    hf, ours = causal
    ids, mask = padded_batch()
    T = ids.shape[1]
    eos = end_ids(generate(ours, PROMPTS, NEW, temperature=0), T)[0]
    # transformers agrees on the padded batch (the repetition penalty differs: it counts the padding too)
    beam = generate(ours, ids, NEW, attention_mask=mask, num_beams=3, eos_id=eos)
    assert torch.equal(beam, hf_generate(hf, ids, mask, eos=eos, num_beams=3))
    for kw in (dict(temperature=0), dict(temperature=0, eos_id=eos, repetition_penalty=1.3),
               dict(num_beams=3, eos_id=eos), dict(num_beams=3, repetition_penalty=1.3)):
        batch = generate(ours, ids, NEW, attention_mask=mask, **kw)
        for i, n in enumerate(mask.sum(1).tolist()):
            alone = generate(ours, ids[i:i + 1, T - n:], NEW, **kw)[0]
            row = batch[i, T - n:]
            assert torch.equal(row[:alone.shape[0]], alone), (kw, i)
            assert (row[alone.shape[0]:] == eos).all()  # a row that ended sooner is filled with its end id


def test_beam_search_across_the_context_window(causal):
    _, ours = causal
    # 6 + 70 tokens through a 64-position window: the cache is rebuilt on the window of every beam
    cached = generate(ours, PROMPTS, 70, num_beams=2, max_context=64)
    assert cached.shape == (3, 76)
    assert torch.equal(generate(ours, PROMPTS, 70, num_beams=2, max_context=64, use_cache=False), cached)
    # every forward padded (masked, on the left) to a multiple of 3, as sequence parallelism needs
    assert torch.equal(generate(ours, PROMPTS, NEW, num_beams=2, pad_to_multiple=3),
                       generate(ours, PROMPTS, NEW, num_beams=2))


def test_repetition_penalty_rule():
    scores = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    ids = torch.tensor([[0, 1, 1], [0, 1, 3]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # row 1: the 0 is padding and is not penalized
    out = apply_repetition_penalty(scores, ids, 2.0, mask)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [2.0, -2.0, 0.5, 1.5]]


# ------------------------------------------------------------------------------------------ T5
def test_t5_cached_decoder_logits_equal_full_forward(t5):
    _, ours = t5
    x = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    dec = torch.randint(2, V, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = ours(input_ids=x, attention_mask=mask, decoder_input_ids=dec).logits
        enc, cache = ours.encode(x, mask), KVCache()
        parts = [ours(attention_mask=mask, decoder_input_ids=dec[:, :2], encoder_outputs=enc, kv_cache=cache).logits]
        parts += [ours(attention_mask=mask, decoder_input_ids=dec[:, t:t + 1], encoder_outputs=enc,
                       kv_cache=cache).logits for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


def test_t5_greedy_and_beam_equal_transformers_with_and_without_cache(t5):
    hf, ours = t5
    greedy = generate(ours, PROMPTS, NEW, temperature=0)
    assert greedy.shape == (3, 1 + NEW) and (greedy[:, 0] == 0).all()  # decoder start token first
    assert torch.equal(greedy, hf_generate(hf, PROMPTS))
    assert torch.equal(generate(ours, PROMPTS, NEW, temperature=0, use_cache=False), greedy)
    ended = 0
    for eos in end_ids(greedy, 1):
        got = generate(ours, PROMPTS, NEW, temperature=0, eos_id=eos)
        assert torch.equal(got, hf_generate(hf, PROMPTS, eos=eos))
        for beams, length_penalty, early in BEAMS:
            kw = dict(num_beams=beams, length_penalty=length_penalty, early_stopping=early, eos_id=eos)
            got = generate(ours, PROMPTS, NEW, **kw)
            assert torch.equal(got, hf_generate(hf, PROMPTS, eos=eos, num_beams=beams,
                                                length_penalty=length_penalty, early_stopping=early)), kw
            assert torch.equal(generate(ours, PROMPTS, NEW, use_cache=False, **kw), got)
            ended += int((got[:, 1:] == eos).any(1).sum())
    assert ended >= 3
    rep = generate(ours, PROMPTS, NEW, temperature=0, repetition_penalty=1.5)
    assert torch.equal(rep, hf_generate(hf, PROMPTS, repetition_penalty=1.5)) and not torch.equal(rep, greedy)


def test_t5_padded_batch_equals_each_prompt_alone(t5):
    _, ours = t5
    ids, mask = padded_batch()
    T = ids.shape[1]
    for kw in (dict(temperature=0), dict(num_beams=3)):
        batch = generate(ours, ids, NEW, attention_mask=mask, **kw)
        for i, n in enumerate(mask.sum(1).tolist()):
            assert torch.equal(batch[i], generate(ours, ids[i:i + 1, T - n:], NEW, **kw)[0]), (kw, i)


# ------------------------------------------------------------------------------------ stop strings
def letters(tokens) -> str:
    """A decode for the tests: one letter per token."""
    return "".join(chr(ord("a") + int(t) % 26) for t in tokens)


def first_hit(text: str, stop: str) -> int:
    """How many tokens (letters) it takes until the text contains `stop`."""
    return next(k for k in range(len(text) + 1) if stop in text[:k])


def test_stop_strings_end_each_row_where_its_text_first_contains_one(causal):
    _, ours = causal
    T, PAD = PROMPTS.shape[1], 255
    full = generate(ours, PROMPTS[:2], NEW, temperature=0)
    texts = [letters(row[T:]) for row in full]
    stops = [texts[0][6:8], texts[1][3:5]]
    hits = [min(first_hit(t, s) for s in stops if s in t) for t in texts]
    stop = StopStrings(letters, stops)
    out = generate(ours, PROMPTS[:2], NEW, temperature=0, stop=stop, pad_id=PAD)
    assert out.shape == (2, T + max(hits))  # generation ends once every row has stopped
    for row, f, k in zip(out, full, hits):
        assert torch.equal(row[:T + k], f[:T + k]) and (row[T + k:] == PAD).all()
    for row, text in zip(out, texts):
        cut = min(i for i in (text.find(s) for s in stops) if i >= 0)
        assert continuation_text(row[T:].tolist(), letters, PAD, stop) == text[:cut]
    # beam search: a returned sequence ends with the token that completed a stop string, or runs to the end
    beam = generate(ours, PROMPTS, NEW, num_beams=3, stop=stop, pad_id=PAD)
    for row in beam:
        gen = row[T:].tolist()
        gen = gen[:gen.index(PAD)] if PAD in gen else gen
        assert len(gen) == NEW or (stop(gen) and not stop(gen[:-1])), letters(gen)


def test_bad_options_are_refused(causal):
    _, ours = causal
    with pytest.raises(ConfigError, match="sampling options"):
        generate(ours, PROMPTS, 4, num_beams=2, top_k=5)
    with pytest.raises(ConfigError, match="eos_id or pad_id"):
        generate(ours, PROMPTS, 4, temperature=0, stop=StopStrings(letters, ["a"]))
    with pytest.raises(ConfigError, match="early_stopping"):
        generate(ours, PROMPTS, 4, num_beams=2, early_stopping="sometimes")
    with pytest.raises(ConfigError, match="non-empty"):
        StopStrings(letters, [""])


# ------------------------------------------------------------------------------------ dufu generate
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from dufu.data import build_tokenizer
    from dufu.models.llama import LlamaModel

    torch.manual_seed(0)
    model = scaled(LlamaModel(vocab_size=260, hidden_size=64, num_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, ffn_hidden_size=128, max_position_embeddings=64))
    path = tmp_path_factory.mktemp("llama_dir")
    dufu.save_pretrained(model, path)
    build_tokenizer("byte").save(path / "tokenizer.json")
    return path, model, build_tokenizer("byte")


def run(capsys, *argv) -> str:
    from dufu.cli.generate import main

    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out.rstrip("\n")


def test_cli_batched_prompts_and_prompts_file_equal_each_prompt_alone(llama_dir, capsys, tmp_path):
    path, model, tok = llama_dir
    prompts = ["Hi", "Hello there", "A"]
    flags = ["--greedy", "--max-new-tokens", "8", "--repetition-penalty", "1.2"]
    alone = [run(capsys, path, "--prompt", p, *flags) for p in prompts]
    expected = []
    for p in prompts:  # the library, one prompt at a time
        out = generate(model, torch.tensor([tok.encode(p)]), 8, temperature=0, eos_id=tok.eod_id,
                       repetition_penalty=1.2)[0, len(tok.encode(p)):]
        expected.append(p + continuation_text(out.tolist(), tok.decode, tok.eod_id))
    assert alone == expected
    batched = run(capsys, path, *(a for p in prompts for a in ("--prompt", p)), *flags)
    assert batched == "\n\n".join(alone)
    file = tmp_path / "prompts.txt"
    file.write_text("Hello there\n\nA\n")  # the empty line is skipped
    assert run(capsys, path, "--prompt", "Hi", "--prompts-file", file, *flags) == batched


def test_cli_beams_and_stop_strings(llama_dir, capsys):
    path, model, tok = llama_dir
    full = run(capsys, path, "--prompt", "Hi", "--greedy", "--max-new-tokens", "12")[2:]
    # a character that whole tokens spell (random weights also make bytes that decode to U+FFFD)
    stop = next(c for c in full[2:] if c.isascii() and c.isprintable())
    cut = run(capsys, path, "--prompt", "Hi", "--greedy", "--max-new-tokens", "12", "--stop", stop)
    assert cut == "Hi" + full[:full.find(stop)] and len(cut) < len(full) + 2
    beam = run(capsys, path, "--prompt", "Hi", "--num-beams", "3", "--length-penalty", "0.5", "--max-new-tokens", "12")
    out = generate(model, torch.tensor([tok.encode("Hi")]), 12, num_beams=3, length_penalty=0.5, eos_id=tok.eod_id)
    assert beam == "Hi" + continuation_text(out[0, 2:].tolist(), tok.decode, tok.eod_id)
    with pytest.raises(SystemExit):
        run(capsys, path, "--prompt", "Hi", "--num-beams", "3", "--temperature", "0.5")
    with pytest.raises(DataError, match="prompts-file"):
        run(capsys, path, "--prompts-file", path / "missing.txt")


def test_cli_t5_generates_from_the_encoder_input(t5, tmp_path, capsys):
    from dufu.data import build_tokenizer

    hf, _ = t5
    tok = build_tokenizer("byte")
    hf.save_pretrained(tmp_path)
    tok.save(tmp_path / "tokenizer.json")
    eos = hf.config.eos_token_id  # what `dufu generate` reads from config.json
    prompts = ["Hello", "a longer prompt"]
    for flags, kw in ((["--greedy"], {}), (["--num-beams", "3"], dict(num_beams=3))):
        printed = run(capsys, tmp_path, *(a for p in prompts for a in ("--prompt", p)), "--max-new-tokens", "10", *flags)
        expected = []
        for p in prompts:  # transformers, one prompt at a time; T5's inputs end with the end id
            ids = torch.tensor([tok.encode(p) + [eos]])
            out = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=eos, **kw)
            expected.append(continuation_text(out[0, 1:].tolist(), tok.decode, eos))
        assert printed == "\n\n".join(expected)
