"""Helpers of the planner's tests: configs, and the probe record of a CPU with fixed figures (the measured one
varies by machine; the fixture ``test_cpu`` in conftest.py makes a device of it)."""

from __future__ import annotations

from dufu.config import LazyConfig, resolve_config_path

# The ~30M-parameter GPT of benchmarks/parallel.py's memory table: 8 layers, hidden 512, 8 heads, vocabulary 8,192,
# sequence 64 (29,447,168 parameters, the head tied to the embedding).
GPT30M = ("model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8", "model.vocab_size=8192",
          "model.max_position_embeddings=64", "dataloader.train.seq_length=64")

# A probe record as dufu.plan.cpu.probe_cpu writes it (figures of a 2-core AMD EPYC, one thread unless noted).
PROBE = {
    "cpu": "test CPU", "cores": 2, "date": "2026-11-25", "torch": "2.13", "machine": "x86_64",
    "gemm": {"1": {"fp32": 110e9, "bf16": 500e9, "fp16": 500e9}, "2": {"fp32": 220e9, "bf16": 950e9, "fp16": 950e9}},
    "gemm_half_size": 2.0, "attention_efficiency": 0.35, "elementwise_bandwidth": 130e9,
    "transcendental_bandwidth": 15e9, "optimizer_bandwidth": 75e9, "stream_bandwidth": 35e9,
    "op_overhead_s": 3e-6, "calibration": {"1": 0.12}, "gloo_latency_s": 1e-3,
    "gloo_bandwidth": 1.4e9, "page_fault_bandwidth": 3e9,
}


def load(recipe: str = "gpt_debug", *overrides: str):
    cfg = LazyConfig.load(str(resolve_config_path(recipe)))
    return LazyConfig.apply_overrides(cfg, list(overrides))
