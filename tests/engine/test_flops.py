"""Model FLOPs per token (6N + 12 L H T) and the peak FLOP/s used for MFU."""

from __future__ import annotations

import json

import pytest
import torch

from dufu.engine.reporting import flops
from dufu.models.gpt import GPTModel
from dufu_testing import count_gpt_parameters

V, H, L, P = 384, 64, 2, 32


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_parameters_exclude_lookup_tables(tied):
    model = GPTModel(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=4, max_position_embeddings=P,
                     tie_word_embeddings=tied)
    total = count_gpt_parameters(V, H, L, P, tied=tied)
    # The position table is a pure lookup; the token table counts once when it is also the output head.
    expected = total - P * H if tied else total - P * H - V * H
    assert flops.count_matmul_params(model) == expected


def test_flops_per_token_formula():
    assert flops.flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32


def test_peak_override_and_best_measurement_kept(monkeypatch, tmp_path):
    monkeypatch.delenv("DUFU_PEAK_TFLOPS", raising=False)
    peak, source = flops.device_peak_flops(torch.device("cpu"), torch.float32, override_tflops=2.5)
    assert peak == 2.5e12 and "given in the config" in source
    monkeypatch.setenv("DUFU_PEAK_TFLOPS", "0.5")
    assert flops.device_peak_flops(torch.device("cpu"), torch.float32)[0] == 0.5e12
    monkeypatch.delenv("DUFU_PEAK_TFLOPS")

    # The CPU peak is measured at every start and the best reading is kept in the cache directory,
    # so a reading taken while other processes share the cores does not stick.
    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path))
    readings = iter([3.0e11, 2.0e11, 4.0e11])
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, device: next(readings))
    peaks = [flops.device_peak_flops(torch.device("cpu"), torch.bfloat16)[0] for _ in range(3)]
    assert peaks == [3.0e11, 3.0e11, 4.0e11]
    table = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(table.values()) == [4.0e11] and "bfloat16" in next(iter(table))
