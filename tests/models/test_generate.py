"""Generation with a KV cache: greedy tokens equal transformers' ``generate(do_sample=False)`` for imported
GPT-2 and LLaMA weights (also left-padded batches), equal decoding without the cache, and the
``dufu generate`` command on a dufu run and on a Hugging Face directory."""

from __future__ import annotations

import pytest
import torch

import dufu
from dufu.engine.inference.generate import generate
from dufu.layers import KVCache

transformers = pytest.importorskip("transformers")

V, NEW = 96, 24


def scaled(model):
    """Larger weights than the default init: far-from-uniform predictions, so argmax ties are impossible."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def pair(request, tmp_path_factory):
    """(transformers model, the same weights imported into dufu)."""
    torch.manual_seed(0)
    kind = request.param
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=None, eos_token_id=None)
        hf = transformers.GPT2LMHeadModel(cfg)
    else:
        common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
        hf = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)) if kind == "llama" else
              transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True)))
    hf = scaled(hf)
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path)
    return hf, dufu.from_pretrained(path)


@pytest.fixture(scope="module")
def prompts():
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 4 tokens, left-padded
    return ids, mask


def test_greedy_equals_transformers_and_no_cache(pair, prompts):
    hf, ours = pair
    ids, _ = prompts
    # (an explicit mask: otherwise transformers takes every token equal to pad_token_id for padding)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)
    cached = generate(ours, ids, NEW, temperature=0)
    assert torch.equal(cached, expected)
    assert torch.equal(generate(ours, ids, NEW, temperature=0, use_cache=False), cached)


def test_left_padded_batch_equals_transformers_and_single_prompts(pair, prompts):
    hf, ours = pair
    ids, mask = prompts
    ids = ids.masked_fill(mask == 0, 0)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    cached = generate(ours, ids, NEW, temperature=0, attention_mask=mask)
    assert torch.equal(cached, expected)
    assert torch.equal(generate(ours, ids, NEW, temperature=0, attention_mask=mask, use_cache=False), cached)
    alone = generate(ours, ids[1:, 3:], NEW, temperature=0)  # padding does not change the continuation
    assert torch.equal(cached[1, 3:], alone[0])


def test_incremental_logits_equal_full_forward(pair, prompts):
    """The cached decode (a 4-token prefill, then one token at a time) gives the full forward's logits up to
    fp32 rounding. The two paths add the same products in different orders (a (2, 1, 64) matmul against a
    (2, 7, 64) one, attention over the cache's 5-7 keys against a causal 7 x 7 one): each logit ends a chain of
    five reductions (two blocks' attention and MLP, then the head) of at most 128 terms, and reordering a K-term
    fp32 sum moves it by about sqrt(K) and at most K units of rounding (6e-8) of its terms' magnitude. So the
    tolerance is relative to the logits' scale, not to each logit (one near 0 carries its row's rounding, not a
    small one of its own): atol = 1e-5 x max|logit|, about 84 fp32 epsilons (1e-4 here: max|logit| is
    8.5-10.8). Measured max|diff| / max|logit|: 0.7-0.9e-6 with AVX-512 kernels, 1.8-2.0e-6 (2.1e-5 absolute)
    with AVX2 ones, so 5x room; a position off by one in the cached steps moves the logits by 0.9-8.8, 10^4
    times the bound."""
    _, ours = pair
    ids, _ = prompts
    ours.eval()
    with torch.no_grad():
        full = ours(ids).logits
        cache = KVCache()
        parts = [ours(ids[:, :4], kv_cache=cache).logits] + [ours(ids[:, t:t + 1], kv_cache=cache).logits
                                                            for t in range(4, ids.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5 * full.abs().max().item())


def test_context_window_and_padding_to_a_multiple(pair, prompts):
    _, ours = pair
    ids, _ = prompts
    # 7 + 70 tokens through a 64-position window: the cache is rebuilt on the window once it is full
    windowed = generate(ours, ids, 70, temperature=0, max_context=64)
    assert windowed.shape == (2, 77)
    assert torch.equal(generate(ours, ids, 70, temperature=0, max_context=64, use_cache=False), windowed)
    # every forward padded (masked, on the left) to a multiple of 3, as sequence parallelism needs
    assert torch.equal(generate(ours, ids, NEW, temperature=0, pad_to_multiple=3), windowed[:, :7 + NEW])


def test_sampling_with_a_seed_is_reproducible(pair, prompts):
    _, ours = pair
    ids, _ = prompts
    a = generate(ours, ids, 8, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b = generate(ours, ids, 8, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------- dufu generate
def test_cli_on_a_dufu_run(debug_run, capsys):
    from dufu.cli.generate import load_for_generation, main

    assert main([str(debug_run.output_dir), "--prompt", "The ", "--greedy", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    model, tokenizer, eos = load_for_generation(debug_run.output_dir / "checkpoints" / "step_0000010")
    assert eos == tokenizer.eod_id
    prompt = torch.tensor([tokenizer.encode("The ")])
    new = generate(model, prompt, 12, temperature=0, eos_id=eos)[0, prompt.shape[1]:].tolist()
    new = new[:new.index(eos)] if eos in new else new
    assert printed == "The " + tokenizer.decode(new)


def test_cli_on_a_hugging_face_directory(tmp_path, capsys):
    from dufu.data import build_tokenizer
    from dufu.cli.generate import main
    from dufu.models.llama import LlamaModel

    torch.manual_seed(0)
    model = scaled(LlamaModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, ffn_hidden_size=176, max_position_embeddings=64))
    dufu.save_pretrained(model, tmp_path)
    build_tokenizer("byte").save(tmp_path / "tokenizer.json")
    assert main([str(tmp_path), "--prompt", "Hi", "--greedy", "--max-new-tokens", "5"]) == 0
    out = generate(model, torch.tensor([[72, 105]]), 5, temperature=0, eos_id=256)[0, 2:].tolist()
    out = out[:out.index(256)] if 256 in out else out
    assert capsys.readouterr().out.rstrip("\n") == "Hi" + build_tokenizer("byte").decode(out)


def test_cli_command_is_wired(run_cli, tmp_path):
    proc = run_cli("generate", tmp_path / "missing", "--prompt", "x")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
