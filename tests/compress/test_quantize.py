"""Post-training quantization on torchao: every family under every scheme stays close to its fp32 logits, the
saved directory reloads to the same logits exactly, bytes shrink by the expected amounts, transformers loads
the directories it can, and bad input is refused with a message that says what to do.

Measured on these tiny random models (hidden 64; relative error = ||q - fp32|| / ||fp32|| of the logits):
int8-weight 0.2-1.4%, int8-dynamic 0.6-1.7%, int4-weight (groups of 32, computing in bf16) 6.5-12.4% (T5 worst:
its decoder compounds the encoder's error). The bounds below leave 1.6-2x room. Trained weights quantize better than
random ones: see benchmarks/results/quantize-*.md.

int8-dynamic on a CPU without an int8 dot-product instruction (as oneDNN sees it; emulated on a newer CPU with
ONEDNN_MAX_CPU_ISA=AVX2): oneDNN's int8 GEMM sums pairs of products in int16, which saturates with the full int8
range (5.7-22% logit error; BERT 3.0%, RoBERTa 0.7%), so dufu reduces weights and activations to [-64, 63]
there (torchao's reduce_range). Its matmuls are then exact -- the logits equal exact integer arithmetic's bit for
bit, the check that catches the saturation in every family -- and one bit less on both operands doubles both
quantization steps: measured 0.6-3.1% (0.9-3.2x the full range's; T5 worst), bounded at 6%, twice the full
range's 3%, with the same room.
"""

from __future__ import annotations

import json
import re
import sys

import launch
import pytest
import torch

from dufu.compress.quantize import (
    SCHEMES,
    QuantizationError,
    int8_matmul_saturates,
    model_bytes,
    quantize_model,
)
from dufu.compress.quantize_io import is_quantized_dir, load_quantized, save_quantized
from dufu.models.bert import BertForMaskedLM, BertForSequenceClassification, RobertaForSequenceClassification
from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel
from dufu.models.swin import SwinForImageClassification
from dufu.models.t5 import T5ForConditionalGeneration
from dufu.models.vit import ViTForImageClassification

pytest.importorskip("torchao")

V, H = 256, 64
REL_TOL = {"int8-weight": 0.03, "int8-dynamic": 0.03, "int4-weight": 0.2}
REL_TOL_REDUCED_RANGE = 0.06  # int8-dynamic in [-64, 63]: both quantization steps doubled (module docstring)


def _ids(*shape, seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def _images():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


FAMILIES = {
    "gpt": (lambda: GPTModel(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4,
                             max_position_embeddings=64),
            lambda: dict(input_ids=_ids(2, 16))),
    "llama": (lambda: LlamaModel(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, ffn_hidden_size=128, max_position_embeddings=64),
              lambda: dict(input_ids=_ids(2, 16))),
    "qwen2": (lambda: LlamaModel(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, ffn_hidden_size=128, max_position_embeddings=64,
                                 qkv_bias=True, tie_word_embeddings=True),
              lambda: dict(input_ids=_ids(2, 16))),
    "bert_cls": (lambda: BertForSequenceClassification(vocab_size=V, hidden_size=H, num_layers=2,
                                                       num_attention_heads=4, ffn_hidden_size=128,
                                                       max_position_embeddings=64, num_labels=3),
                 lambda: dict(input_ids=_ids(2, 16), attention_mask=torch.tensor([[1] * 16, [1] * 10 + [0] * 6]))),
    "roberta_cls": (lambda: RobertaForSequenceClassification(vocab_size=V, hidden_size=H, num_layers=2,
                                                             num_attention_heads=4, ffn_hidden_size=128,
                                                             max_position_embeddings=70, num_labels=3),
                    lambda: dict(input_ids=_ids(2, 16).clamp(min=3))),
    "bert_mlm": (lambda: BertForMaskedLM(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4,
                                         ffn_hidden_size=128, max_position_embeddings=64),
                 lambda: dict(input_ids=_ids(2, 16))),
    "t5": (lambda: T5ForConditionalGeneration(vocab_size=V, d_model=H, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                              relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                              dropout_rate=0.0),
           lambda: dict(input_ids=_ids(2, 16), decoder_input_ids=_ids(2, 8, seed=2))),
    "vit": (lambda: ViTForImageClassification(image_size=16, patch_size=4, num_channels=3, num_labels=7,
                                              hidden_size=H, num_layers=2, num_attention_heads=4, ffn_hidden_size=128),
            lambda: dict(pixel_values=_images())),
    "swin": (lambda: SwinForImageClassification(image_size=16, patch_size=2, num_channels=3, num_labels=5,
                                                embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
                                                drop_path_rate=0.0),
             lambda: dict(pixel_values=_images())),
}
TRANSFORMERS_LOADS = {"llama", "qwen2", "bert_cls", "roberta_cls", "bert_mlm", "t5"}  # gpt, vit, swin: see quantize_io


def make(family: str):
    torch.manual_seed(0)
    build, inputs = FAMILIES[family]
    return build().eval(), inputs()


@torch.no_grad()
def logits(model, inputs):
    return model(**inputs).logits


def expected_linear_bytes(model, names, scheme) -> int:
    """int8: one byte per weight + an fp32 scale and an int8 zero point (0: symmetric) per output row; int4
    (groups of 32): half a byte per weight + a bf16 scale and zero point per group."""
    total = 0
    for n in names:
        out_f, in_f = model.get_submodule(n).weight.shape
        total += out_f * in_f + 5 * out_f if scheme != "int4-weight" else out_f * in_f // 2 + 4 * out_f * in_f // 32
    return total


def exact_int_mm(a, b):
    """``torch._int_mm`` in exact int32 arithmetic (a plain integer matmul, no oneDNN)."""
    return a.to(torch.int32) @ b.to(torch.int32)


def assert_int8_matmuls_exact(model, inputs, got, monkeypatch):
    """The model's int8-dynamic logits equal those of exact integer matmuls, bit for bit: none saturated."""
    with monkeypatch.context() as patch:
        patch.setattr(torch, "_int_mm", exact_int_mm)
        exact = logits(model, inputs)
    torch.testing.assert_close(got, exact, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_quantizes_close_to_fp32_and_reloads_exactly(family, scheme, tmp_path, monkeypatch):
    model, inputs = make(family)
    reference = logits(model, inputs)
    fp32_bytes = sum(t.numel() * 4 for t in {id(p): p for p in model.parameters()}.values())
    info = quantize_model(model, scheme)
    got = logits(model, inputs)
    rel = ((got - reference).norm() / reference.norm()).item()
    saturates = int8_matmul_saturates()
    if scheme == "int8-dynamic":  # the reduced range exactly where the full one saturates, and the report says so
        assert info.reduce_range is (saturates is not None)
        assert any("[-64, 63]" in n and "saturates" in n for n in info.notes) is info.reduce_range
        assert_int8_matmuls_exact(model, inputs, got, monkeypatch)
    else:
        assert info.reduce_range is None
    bound = REL_TOL_REDUCED_RANGE if info.reduce_range else REL_TOL[scheme]
    assert 0 < rel < bound, f"{family} {scheme}: relative logit error {rel:.4f}"

    # what was quantized to what, and the bytes
    layers = [n for n in info.quantized if n not in ("wte", "lm_head")]
    want = "Int4OpaqueTensor" if scheme == "int4-weight" else "Int8Tensor"
    assert layers and all(info.quantized[n] == want for n in layers)
    vocab = {n: k for n, k in info.quantized.items() if n in ("wte", "lm_head")}  # int8 per row in every scheme
    assert set(vocab.values()) <= {"Int8Tensor"} and bool(vocab) is (family not in ("vit", "swin"))
    heads = [n for n in info.kept if n.startswith("classifier")]  # RoBERTa's head: classifier.dense, .out_proj
    assert bool(heads) is (family in ("bert_cls", "roberta_cls", "vit", "swin"))
    assert info.linear_bytes_after == expected_linear_bytes(model, layers, scheme)
    assert info.bytes_before == fp32_bytes + sum(b.numel() * b.element_size() for b in model.buffers())
    assert info.bytes_after < (0.36 if scheme != "int4-weight" else 0.27) * info.bytes_before  # fp32 heads, tables
    tied = getattr(model, "lm_head", None) is not None and getattr(model, "tie_word_embeddings", False)
    if tied:  # one quantized tensor serves the lookup and the head
        assert model.lm_head.weight is model.wte.weight and info.tied == {"lm_head.weight": "wte.weight"}

    out = save_quantized(model, scheme, {"kind": "test"}, tmp_path / "q")
    manifest = json.loads((out / "dufu_quantization.json").read_text())
    assert is_quantized_dir(out) and manifest["scheme"] == scheme and manifest["source"] == {"kind": "test"}
    hf_layout = family in TRANSFORMERS_LOADS and scheme != "int4-weight"
    assert manifest["transformers_loads"] is hf_layout
    assert manifest["weights"] == ("model.safetensors" if hf_layout else
                                   "dufu_model.pt" if scheme == "int4-weight" else "dufu_model.safetensors")
    assert ("quantization_config" in json.loads((out / "config.json").read_text())) is hf_layout
    if tied and scheme != "int4-weight":  # the tied head is stored once: with the embedding
        from safetensors import safe_open

        from dufu.models.hub import adapter_for_model

        ad = adapter_for_model(model)
        head, emb = (ad.hf_names(f"{n}.weight", model, ad.save_prefix(model))[0] if hf_layout else f"{n}.weight"
                     for n in ("lm_head", "wte"))
        with safe_open(str(out / manifest["weights"]), framework="pt") as f:
            stored = set(f.keys())
        assert head not in stored and f"{head.rpartition('.')[0]}._weight_qdata" not in stored
        assert f"{emb.rpartition('.')[0]}._weight_qdata" in stored

    reloaded = load_quantized(out)
    assert type(reloaded) is type(model)
    torch.testing.assert_close(logits(reloaded, inputs), got, rtol=0, atol=0)
    assert reloaded.quantization_info.quantized == info.quantized
    assert reloaded.quantization_info.reduce_range is info.reduce_range
    if tied:
        assert reloaded.lm_head.weight is reloaded.wte.weight
    assert model_bytes(reloaded) == info.bytes_after  # the same tensors, nothing dequantized on the way


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_reduced_range_int8_dynamic_is_exact_and_kept_on_disk(family, tmp_path, monkeypatch):
    """reduce_range=True, asked for on any CPU: weights and activations in [-64, 63], exact int8 matmuls, the
    report says so, and the directory keeps the range (tensors, manifest, transformers' quantization_config)."""
    model, inputs = make(family)
    reference = logits(model, inputs)
    info = quantize_model(model, "int8-dynamic", reduce_range=True)
    assert info.reduce_range is True and any("reduce_range=True asked for" in n for n in info.notes)
    weight = model.get_submodule(next(n for n in info.quantized if n not in ("wte", "lm_head"))).weight
    assert weight.reduce_range and weight.act_quant_kwargs.reduce_range
    assert weight.qdata.min() >= -64 and weight.qdata.max() <= 63
    got = logits(model, inputs)
    assert_int8_matmuls_exact(model, inputs, got, monkeypatch)
    rel = ((got - reference).norm() / reference.norm()).item()
    assert 0 < rel < REL_TOL_REDUCED_RANGE, f"{family}: relative logit error {rel:.4f}"

    out = save_quantized(model, "int8-dynamic", {}, tmp_path / "q")
    assert json.loads((out / "dufu_quantization.json").read_text())["reduce_range"] is True
    config = json.loads((out / "config.json").read_text())["quantization_config"]["quant_type"]["default"]
    layer_configs = [c["_data"] for c in config["_data"]["fqn_to_config"].values()
                     if c and c["_type"] == "Int8DynamicActivationInt8WeightConfig"]
    assert layer_configs and all(c["reduce_range"] is True for c in layer_configs)
    reloaded = load_quantized(out)
    torch.testing.assert_close(logits(reloaded, inputs), got, rtol=0, atol=0)
    assert reloaded.quantization_info.reduce_range is True


CPU_CASES = [  # (CPU flags, oneDNN's ISA limit variables, why it saturates (a regex) or None)
    ((), {}, "no int8 dot-product instruction \\(none of avx512_vnni, avx_vnni, amx_int8\\)"),
    (("avx512_vnni",), {}, None),
    (("avx_vnni",), {}, None),
    (("avx512_vnni", "avx_vnni", "amx_int8"), {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "ONEDNN_MAX_CPU_ISA=AVX2 limits"),
    (("avx512_vnni", "avx_vnni", "amx_int8"), {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "avx512_core limits"),
    (("avx512_vnni", "avx_vnni", "amx_int8"), {"DNNL_MAX_CPU_ISA": "AVX2"}, "DNNL_MAX_CPU_ISA=AVX2 limits"),
    (("avx512_vnni", "avx_vnni"), {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "DNNL_MAX_CPU_ISA": "AVX2"}, None),
    (("avx512_vnni",), {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}, "needs avx_vnni, which this CPU lacks"),
    (("avx512_vnni",), {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, None),
    (("avx512_vnni",), {"ONEDNN_MAX_CPU_ISA": "not-an-isa"}, None),  # oneDNN ignores a value it does not know
    ((), {"ONEDNN_MAX_CPU_ISA": "ALL"}, "none of avx512_vnni"),
]


@pytest.mark.parametrize("flags,limits,why", CPU_CASES)
def test_int8_matmul_saturation_is_judged_as_onednn_sees_the_cpu(flags, limits, why, monkeypatch):
    caps = {"architecture": "x86_64", "avx2": True, **{f: True for f in flags}}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    for var, value in limits.items():
        monkeypatch.setenv(var, value)
    got = int8_matmul_saturates()
    if why is None:
        assert got is None
    else:
        assert got is not None and re.search(why, got), got
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "aarch64"})
    assert int8_matmul_saturates() is None  # vpmaddubsw is x86's


AVX2_INT_MM = """
import json, torch
from dufu.compress.quantize import int8_matmul_saturates
g = torch.Generator().manual_seed(0)
out = {"why": int8_matmul_saturates(), "full_wrong": [], "reduced_wrong": []}
for m, k, n in [(1, 64, 64), (16, 256, 128), (64, 128, 48)]:
    for lo, hi, key in [(-128, 128, "full_wrong"), (-64, 64, "reduced_wrong")]:
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(lo, hi, (k, n), generator=g, dtype=torch.int8)
        a[0], b[:, 0] = 127, hi - 1  # the largest products
        if key == "reduced_wrong":
            a = a.clamp(-64, 63)
        exact = a.long() @ b.long()
        out[key].append((torch._int_mm(a, b).long() != exact).float().mean().item())
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cpu.get_capabilities().get("architecture") != "x86_64", reason="an x86 oneDNN kernel")
def test_onednn_int8_matmul_saturates_on_avx2_and_not_in_the_reduced_range():
    """The cause, on the real kernel: oneDNN held to AVX2 (as on a CPU without VNNI) gets most full-range int8
    products wrong in torch._int_mm, none in [-64, 63], and dufu's check names the limit."""
    proc = launch.run([sys.executable, "-c", AVX2_INT_MM], env={"ONEDNN_MAX_CPU_ISA": "AVX2"}, timeout=300)
    launch.assert_ok(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in out["why"]
    assert min(out["full_wrong"]) > 0.5 and max(out["reduced_wrong"]) == 0, out


def test_full_range_int8_dynamic_is_refused_where_its_matmuls_saturate(tmp_path, monkeypatch):
    model, _ = make("gpt")
    quantize_model(model, "int8-dynamic", reduce_range=False)
    out = save_quantized(model, "int8-dynamic", {}, tmp_path / "q")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # what dufu reads; this process's oneDNN is already set up
    with pytest.raises(QuantizationError, match=r"full int8 range, but ONEDNN_MAX_CPU_ISA=AVX2 limits .*saturates"
                                                r".*logits would be wrong.*reduce_range=True.*or use int8-weight"):
        load_quantized(out)
    here, _ = make("gpt")
    assert quantize_model(here, "int8-dynamic").reduce_range is True  # dufu's choice on such a CPU
    forced, _ = make("gpt")
    info = quantize_model(forced, "int8-dynamic", reduce_range=False)  # the caller's choice, with a warning note
    assert info.reduce_range is False and any("wrong on this CPU" in n for n in info.notes)


@pytest.mark.parametrize("family,scheme", [(f, "int8-weight") for f in sorted(TRANSFORMERS_LOADS)]
                         + [("llama", "int8-dynamic"), ("bert_cls", "int8-dynamic")])
def test_transformers_loads_the_directory(family, scheme, tmp_path):
    """transformers' own torchao integration reads the directory into its model class: the same quantized
    tensors, so the same logits (int8-dynamic BERT: transformers' attention orders float ops differently, so
    an activation now and then rounds to the other int8 step)."""
    transformers = pytest.importorskip("transformers")
    model, inputs = make(family)
    quantize_model(model, scheme)
    expected = logits(model, inputs)
    out = save_quantized(model, scheme, {}, tmp_path / "q")
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(out).eval()
    first = next(m for n, m in hf.named_modules() if n.endswith(("q_proj", "query", ".q")))
    assert type(first.weight).__name__ == "Int8Tensor"
    atol = 5e-3 if scheme == "int8-dynamic" and family.startswith("bert") else 1e-5
    torch.testing.assert_close(logits(hf, inputs), expected, rtol=0, atol=atol)


def test_errors_say_what_is_wrong_and_what_to_do():
    model, _ = make("gpt")
    with pytest.raises(QuantizationError, match="int8-weight, int8-dynamic, int4-weight"):
        quantize_model(model, "int3")
    with pytest.raises(QuantizationError, match="group size applies to int4-weight only"):
        quantize_model(model, "int8-weight", group_size=64)
    with pytest.raises(QuantizationError, match="reduce_range applies to int8-dynamic only"):
        quantize_model(model, "int8-weight", reduce_range=True)
    # ViT with a 48-wide MLP: its fc2 takes 48 inputs, not a multiple of int4's groups of 32
    torch.manual_seed(0)
    vit = ViTForImageClassification(image_size=16, patch_size=4, num_channels=3, num_labels=7, hidden_size=32,
                                    num_layers=2, num_attention_heads=4, ffn_hidden_size=48)
    with pytest.raises(QuantizationError, match=r"int4-weight does not work.*blocks\.0\.mlp\.fc2 \(in_features 48\)"
                                                r".*Use int8-weight"):
        quantize_model(vit, "int4-weight")
    assert quantize_model(vit, "int8-weight").quantized["blocks.0.mlp.fc2"] == "Int8Tensor"  # int8 has no groups
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(vit, "int8-dynamic")

    from dufu.delta import LoRA, apply_delta

    lora_model, _ = make("llama")
    apply_delta(lora_model, LoRA(targets=["q_proj"], rank=4))
    with pytest.raises(QuantizationError, match="carries a delta.*--merge"):
        quantize_model(lora_model, "int8-weight")
    with pytest.raises(QuantizationError, match="not quantized"):
        save_quantized(make("gpt")[0], "int8-weight", {}, "unused")


def test_cli_quantizes_a_run_and_generate_reads_it(train_run, tmp_path, capsys):
    from dufu.cli.generate import load_for_generation
    from dufu.cli.quantize import load_quantized_for_generation, main

    run = train_run("train.train_iter=2")
    out = tmp_path / "q8"
    assert main([str(run.output_dir), "--scheme", "int8-weight", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((out / "dufu_quantization.json").read_text())
    mem = manifest["bytes_in_memory"]
    assert f"{mem['before'] / 1e6:.2f} MB -> {mem['after'] / 1e6:.2f} MB" in printed
    assert "lm_head.weight is wte.weight" in printed and "not transformers" in printed
    assert (out / "tokenizer.json").read_text() == (run.output_dir / "tokenizer.json").read_text()
    assert manifest["source"]["kind"] == "dufu checkpoint" and manifest["source"]["path"].endswith("step_0000002")

    ref, tokenizer, eos = load_for_generation(run.output_dir)
    model, tok, qeos = load_quantized_for_generation(out)
    assert qeos == eos and tok.encode("The class ") == tokenizer.encode("The class ")
    ids = torch.tensor([tokenizer.encode("The class of a")])
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert 0 < ((a - b).norm() / a.norm()).item() < 0.03
    with pytest.raises(Exception, match="already quantized"):
        main([str(out), "--scheme", "int8-weight", "--output", str(tmp_path / "again")])


def test_cli_quantizes_a_hugging_face_directory(tmp_path, capsys):
    """An HF directory in: its weights' size is the 'before' on disk, its tokenizer files are copied, and the
    int4 directory (dufu only) reloads to the quantized logits."""
    from dufu.data import build_tokenizer
    from dufu.engine.weights.pretrained import save_pretrained
    from dufu.cli.quantize import main

    model, inputs = make("llama")
    src = save_pretrained(model, tmp_path / "hf")
    build_tokenizer("byte").save(src / "tokenizer.json")
    out = tmp_path / "q4"
    assert main([str(src), "--scheme", "int4-weight", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    size = (src / "model.safetensors").stat().st_size
    assert f"on disk       {size / 1e6:.2f} MB (the source's weight files)" in printed
    assert "(groups of 32)" in printed and "torchao 0.18 can neither write" in printed
    assert (out / "tokenizer.json").is_file() and (out / "dufu_model.pt").is_file()
    quantized = load_quantized(out)
    assert (out / "dufu_model.pt").stat().st_size < 0.3 * size
    rel = ((logits(quantized, inputs) - logits(model, inputs)).norm() / logits(model, inputs).norm()).item()
    assert 0 < rel < REL_TOL["int4-weight"]
