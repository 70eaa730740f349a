"""ZeRO-3 at scale: the model states against the ZeRO paper's formula, and the lifetimes of a 175B GPT's units.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3.1 and
Table 1): mixed-precision Adam keeps 2 + 2 + K bytes per parameter (fp16 weights and gradients, K = 12 for fp32
master weights and two moments); stage 3 shards all of it, (2 + 2 + K) Psi / N_d per device. dufu keeps the same
16 bytes split differently: fp32 weights, which are the master copy (autocast casts a low-precision copy per use,
:mod:`dufu.engine.precision`; FSDP gathers fp32, :func:`dufu.parallel.data_parallel.apply_fsdp` sets no
``mp_policy``), fp32 gradients and AdamW's two fp32 moments: 4 + 4 + 8. A GPT with a tied head also keeps the
output unit's sharded copy of the embedding (4 / N_d bytes per table entry, ``TiedCopies``).

The 175B case is Narayanan et al. 2021's ZeRO-3 baseline ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 2): GPT-3 175B (96 layers, hidden 12,288), ZeRO-3 without model parallelism,
global batch 1,536, full recomputation, on 384 A100-80GB at micro-batch 4 and 768 at micro-batch 2.
"""

from __future__ import annotations

import pytest

from plan_testing import load
import dufu.plan.memory as memory
from dufu.plan import estimate
from dufu.plan.search import model_info

SEQ = 2048


def gpt(hidden: int, layers: int, heads: int, *overrides: str):
    return load("gpt2_small", "model.vocab_size=51200", f"model.hidden_size={hidden}",
                f"model.num_attention_heads={heads}", f"model.num_layers={layers}",
                f"model.max_position_embeddings={SEQ}", f"dataloader.train.seq_length={SEQ}", *overrides)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, *overrides: str):
    return load("llama2_7b", f"model.hidden_size={hidden}", f"model.num_layers={layers}",
                f"model.num_attention_heads={heads}", f"model.num_key_value_heads={kv_heads}",
                f"model.ffn_hidden_size={ffn}", f"dataloader.train.seq_length={SEQ}", *overrides)


def zero3(n: int, micro_batch: int = 1, global_batch=None) -> tuple:
    return (f"train.dist.data_parallel_size={n}", "train.zero_optimization.enabled=True",
            "train.zero_optimization.stage=3", "train.activation_checkpoint.enabled=True",
            "train.activation_checkpoint.mode=full", f"train.train_micro_batch_size={micro_batch}",
            f"train.global_batch_size={global_batch or n * micro_batch}")


# name: (config maker, sizes, N_d)
MODELS = {
    "7B": (llama, (4096, 32, 32, 32, 11008), 64),  # Llama 2 7B
    "70B": (llama, (8192, 80, 64, 8, 28672), 512),  # Llama 2 70B
    "175B": (gpt, (12288, 96, 96), 1024),  # GPT-3
    "1T": (gpt, (25600, 128, 160), 1024),  # Narayanan et al. 2021's 1T GPT
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_states_follow_the_zero_papers_stage_3_formula(name):
    make, sizes, n = MODELS[name]
    cfg = make(*sizes, *zero3(n))
    info = model_info(cfg)
    psi = info.num_params
    states = estimate(cfg, n, "a100-80gb").model_states
    tied = info.tied_elems if info.tied else 0
    assert states["parameters"] == pytest.approx(4 * (psi + tied) / n, rel=1e-6)  # fp32 weights (+ tied copy)
    assert states["gradients"] == pytest.approx(4 * psi / n, rel=1e-6)  # fp32 gradients
    assert states["optimizer"] == pytest.approx(8 * psi / n, rel=1e-6)  # AdamW's two fp32 moments
    paper = (2 + 2 + 12) * psi / n
    assert sum(states.values()) == pytest.approx(paper, rel=0.005)  # the tied copy: < 0.5% of a GPT's states
    if name == "1T":  # the paper's trillion parameters on 1,024 devices: about 16 GB of model states each
        assert 15e9 < sum(states.values()) < 17e9


GPT3 = (12288, 96, 96)
BLOCK = 12 * 12288**2 + 13 * 12288  # one GPT-3 block's parameters


@pytest.mark.parametrize("gpus, micro_batch", [(384, 4), (768, 2)])
def test_175b_zero3_holds_one_block_and_the_next_at_a_time(gpus, micro_batch):
    est = estimate(gpt(*GPT3, *zero3(gpus, micro_batch, 1536)), gpus, "a100-80gb")
    assert est.dtype == "bf16" and est.layout["num_accumulation_steps"] == 1
    block = 4 * BLOCK  # fp32, as FSDP gathers it
    mem = est.memory
    # at the peak: the block in backward and the next one prefetched, gathered, plus the reduce-scatter buffer of
    # the block before; its full-size gradient (up to one block's) and every shard, not the blocks' gradients
    assert mem["communication"] <= 3 * block * 1.01
    assert mem["gradients"] <= block + 4 * 175e9 / gpus
    assert mem["temporaries"] < 2 * block
    # each block keeps its input for recomputation: (micro-batch, 2048, 12288) fp32 (the residual stream)
    assert mem["activations"] == pytest.approx(96 * micro_batch * SEQ * 12288 * 4, rel=0.05)
    assert est.memory_per_gpu_bytes < 80e9, est.memory
    if gpus == 768:
        assert est.fits  # within the 77 GB the catalog leaves for tensors (80 GB less 3 for the runtime)


def test_175b_zero3_with_autocasts_cache_would_not_fit(monkeypatch):
    """Why dufu's autocast runs without its cache under ZeRO-3 with fp32 gathers (train.amp.param_dtype=fp32;
    dufu.engine.runtime.Runtime.autocast): with it, the forward's end holds a bf16 copy of all 96 blocks' weights,
    gathered ones, 2 B per parameter of the whole model on every rank, and no dp-only layout of GPT-3 fits in 80 GB.
    (With the default, FSDP gathers bf16 weights and autocast copies none.)"""
    monkeypatch.setattr(memory, "low_precision_units", lambda layout, setup: False)  # param_dtype=fp32
    monkeypatch.setattr(memory, "autocast_caches_weights", lambda layout: True)
    est = estimate(gpt(*GPT3, *zero3(768, 2, 1536)), 768, "a100-80gb")
    # in the forward of the last block but one, with the last one prefetched: 95 blocks' copies made
    assert est.peak_where == "forward of block 94"
    assert est.memory["temporaries"] >= 2 * 95 * BLOCK
    assert not est.fits
