"""Sampling: greedy decoding is deterministic and equals argmax decoding by hand; top-k / top-p limits."""

from __future__ import annotations

import pytest
import torch

from dufu.engine.inference.generate import generate, sample_next
from dufu.models.gpt import GPTModel


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPTModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)
    # Larger weights than GPT-2 init, so the distribution is far from uniform and argmax ties are impossible.
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0)
    return m.train()  # generate() must switch to eval mode and back


@pytest.fixture(scope="module")
def prompt():
    return torch.tensor([[84, 104, 101, 32], [65, 32, 99, 108]])  # two prompts of 4 tokens


def greedy_by_hand(model, ids: torch.Tensor, n: int, max_context: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            context = ids if max_context is None else ids[:, -max_context:]
            nxt = model(context).logits[:, -1, :].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_greedy_is_deterministic_and_equals_argmax(model, prompt):
    model.eval()
    expected = greedy_by_hand(model, prompt, 10)
    model.train()
    first = generate(model, prompt, 10, temperature=0)
    second = generate(model, prompt, 10, temperature=0)
    assert first.shape == (2, 14)
    assert torch.equal(first[:, :4], prompt)
    assert torch.equal(first, second)
    assert torch.equal(first, expected)
    assert model.training  # restored


def test_top_k_1_and_tiny_top_p_equal_greedy(model, prompt):
    greedy = generate(model, prompt, 8, temperature=0)
    g = torch.Generator().manual_seed(123)
    assert torch.equal(generate(model, prompt, 8, temperature=1.0, top_k=1, generator=g), greedy)
    assert torch.equal(generate(model, prompt, 8, temperature=0.7, top_p=1e-6, generator=g), greedy)


def test_context_window_is_respected(model):
    ids = torch.randint(0, 257, (1, 30), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, 6, temperature=0, max_context=32)  # would exceed 32 positions without the window
    assert out.shape == (1, 36)
    model.eval()
    assert torch.equal(out, greedy_by_hand(model, ids, 6, max_context=32))
    model.train()


def test_sampling_is_reproducible_with_a_generator(model, prompt):
    a = generate(model, prompt, 8, temperature=1.0, top_k=40, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompt, 8, temperature=1.0, top_k=40, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_eos_stops_and_pads():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 5.0]])

    class Fixed(torch.nn.Module):
        def forward(self, ids):
            return type("Out", (), {"logits": logits[:, None, :].expand(-1, ids.shape[1], -1)})()

    out = generate(Fixed(), torch.zeros(2, 1, dtype=torch.long), 5, temperature=0, eos_id=2)
    # row 1 emits eos (2) at once and is padded with eos; row 0 never does, so all 5 tokens are made
    assert out.tolist() == [[0, 1, 1, 1, 1, 1], [0, 2, 2, 2, 2, 2]]


def test_sample_next_limits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert sample_next(logits, temperature=0).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {1, 2}  # only the two largest logits are ever drawn
    # top_p: p = softmax = [0.087, 0.644, 0.237, 0.032]; the mass before the 3rd-ranked token is 0.88 > 0.85
    draws = {sample_next(logits, 1.0, top_p=0.85, generator=g).item() for _ in range(300)}
    assert draws == {1, 2}
