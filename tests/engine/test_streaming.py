"""Generation within a memory budget (dufu.engine.inference.streaming): blocks that do not fit are streamed from the
memory-mapped safetensors, and the tokens equal those of the whole model loaded the usual way."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.inference.generate import generate
from dufu.engine.weights.pretrained import from_pretrained, pretrained_model
from dufu.engine.inference.streaming import format_bytes, load_streaming, parse_bytes, plan_streaming
from dufu.engine.inference.streaming_source import CACHE_SUFFIX, mapped_files
from dufu.errors import DataError, DufuError
from dufu.layers import KVCache
from dufu.models.bert import BertModel
from dufu.models.gpt import GPTModel
from dufu.models.hub import save_pretrained
from dufu.models.llama import LlamaModel

FAMILIES = {
    "gpt": (GPTModel, dict(vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
                           max_position_embeddings=64)),
    "llama": (LlamaModel, dict(vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, ffn_hidden_size=160, max_position_embeddings=64)),
    "qwen2": (LlamaModel, dict(vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, ffn_hidden_size=160, max_position_embeddings=64, qkv_bias=True,
                               tie_word_embeddings=True)),
}
PROMPT = torch.tensor([[3, 141, 59, 26, 53], [0, 0, 97, 93, 23]])  # the second row left-padded
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
NEW = 16


def _model(family: str):
    cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(**kw)
    with torch.no_grad():  # larger weights than the init: logits far from uniform, so no argmax ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_pretrained(_model(request.param), path)
    return path


@pytest.fixture(scope="module")
def unbounded(hf_dir):
    """The tokens and last logits of the whole model loaded the usual way."""
    model = from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(PROMPT, attention_mask=MASK).logits
    return generate(model, PROMPT, NEW, temperature=0, attention_mask=MASK), logits


def one_resident_budget(path) -> int:
    """A budget that holds the resident parts, the streaming slot, the reserved cache and activations and one
    block: one of the four blocks stays resident."""
    parts = plan_streaming(path, 1 << 50, batch_size=2)
    return parts.minimum_bytes + parts.block_bytes["0"]


def test_greedy_tokens_equal_unbounded_with_one_of_four_blocks_resident(hf_dir, unbounded):
    model = load_streaming(hf_dir, one_resident_budget(hf_dir), batch_size=2)
    plan = model.streaming_plan
    assert plan.resident_blocks == ("0",) and plan.streamed_blocks == ("1", "2", "3")
    with torch.no_grad():
        logits = model(PROMPT, attention_mask=MASK).logits
    torch.testing.assert_close(logits, unbounded[1], rtol=0, atol=1e-5)
    out = generate(model, PROMPT, NEW, temperature=0, attention_mask=MASK)
    assert out.tolist() == unbounded[0].tolist()


def test_streamed_weights_are_dropped_after_each_block(hf_dir):
    model = load_streaming(hf_dir, one_resident_budget(hf_dir), batch_size=2)
    plan = model.streaming_plan
    seen, mapped_during = [], []

    def watch(block, args):  # runs after the loading hook: the block holds its streamed weights now
        seen.extend(weakref.ref(p) for p in block.parameters())
        assert not any(p.is_meta for p in block.parameters())
        mapped_during.append(len(mapped_files(plan.directory)))

    model.blocks["2"].register_forward_pre_hook(watch)
    generate(model, PROMPT, 4, temperature=0, attention_mask=MASK)
    assert len(mapped_during) == 4 and min(mapped_during) >= 1  # streamed tensors are views of the map ...
    assert mapped_files(plan.directory) == []  # ... and after generation nothing of the file is mapped
    assert seen and all(ref() is None for ref in seen)  # no streamed tensor is referenced any more
    resident = sum(p.nbytes for p in model.parameters() if not p.is_meta)
    resident += sum(b.nbytes for b in model.buffers())
    assert resident == plan.resident_bytes == plan.fixed_bytes + plan.block_bytes["0"]
    assert resident <= plan.resident_share
    for key in plan.streamed_blocks:
        assert all(p.is_meta for p in model.blocks[key].parameters())


def test_budget_below_the_minimum_is_an_error_naming_it(hf_dir, unbounded):
    minimum = plan_streaming(hf_dir, 1 << 50, batch_size=2).minimum_bytes
    with pytest.raises(DufuError, match=f"minimum of {format_bytes(minimum)}".replace("(", r"\(").replace(")", r"\)")):
        load_streaming(hf_dir, minimum - 1, batch_size=2)
    model = load_streaming(hf_dir, minimum, batch_size=2)  # exactly the minimum: every block streamed
    assert model.streaming_plan.resident_blocks == ()
    assert generate(model, PROMPT, NEW, temperature=0, attention_mask=MASK).tolist() == unbounded[0].tolist()


def test_a_forward_beyond_the_reservation_is_refused(hf_dir):
    model = load_streaming(hf_dir, "1GB", batch_size=1, max_tokens=8)
    assert model.streaming_plan.streamed_blocks == ()  # everything fits; the reservation still holds
    with pytest.raises(DufuError, match="2 sequence"):
        generate(model, PROMPT, 1, temperature=0, attention_mask=MASK)
    assert generate(model, PROMPT[:1], 4, temperature=0).shape == (1, 9)  # the last token is never fed back
    with pytest.raises(DufuError, match="9 tokens"):
        generate(model, PROMPT[:1], 5, temperature=0)  # the fifth step feeds a ninth token


def test_tensors_stored_as_used_are_read_in_place_others_converted_once(hf_dir, dufu_cache_dir):
    plan = plan_streaming(hf_dir, "1GB")
    if not hf_dir.name.startswith("gpt"):  # LLaMA's and Qwen2's tensors are stored as dufu holds them
        assert Path(plan.directory) == hf_dir
        return
    # GPT-2's Conv1D weights are stored transposed, Q, K and V fused: converted into dufu's layout, in the cache
    directory = Path(plan.directory)
    assert directory.parent == dufu_cache_dir / "streaming"
    shard = check_shards(directory, ["wte", "wpe", "ln_f"])
    reference = from_pretrained(hf_dir)
    with safe_open(str(shard), framework="pt") as f:
        assert torch.equal(f.get_tensor("blocks.1.attn.k_proj.weight"), reference.blocks["1"].attn.k_proj.weight)
    written = shard.stat().st_mtime_ns
    assert plan_streaming(hf_dir, "1GB").directory == plan.directory
    assert shard.stat().st_mtime_ns == written  # read again, not rewritten


def check_shards(directory: Path, outside: list[str]) -> Path:
    """A conversion holds one shard per module outside the blocks and one per block; returns block 1's."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {}
    for name, shard in index.items():
        parts = name.split(".")
        shards.setdefault(shard, set()).add(".".join(parts[:2]) if parts[0] == "blocks" else parts[0])
    assert sorted(map(sorted, shards.values())) == sorted([[m] for m in outside] + [[f"blocks.{i}"] for i in range(4)])
    assert sorted(p.name for p in directory.glob("*.safetensors")) == sorted(shards)
    assert "lm_head.weight" not in index  # tied: the embedding serves both
    return directory / index["blocks.1.attn.q_proj.weight"]


def test_the_kv_cache_reservation_is_what_the_cache_holds(hf_dir):
    model = load_streaming(hf_dir, "1GB", batch_size=2, max_tokens=12)
    plan = model.streaming_plan
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 12)), kv_cache=cache)
    held = sum(t.nbytes for block in model.blocks.values() for t in cache.get(block.attn))
    layers = len(model.blocks)
    assert held * (layers + 1) == plan.kv_cache_bytes * layers  # plus one layer's worth while torch.cat grows it


def test_a_dufu_run_is_converted_once_block_by_block(tmp_path):
    model = _model("gpt")  # tied head, fused and transposed tensors on the Hugging Face side
    cfg = {"model": L(GPTModel)(**FAMILIES["gpt"][1])}
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints").save(
        3, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, config_text=LazyConfig.to_yaml(cfg))
    want = generate(pretrained_model(tmp_path / "run"), PROMPT[:1], NEW, temperature=0)
    budget = one_resident_budget(tmp_path / "run")
    cache = ckpt.with_name(ckpt.name + CACHE_SUFFIX)
    shard = check_shards(cache, ["wte", "wpe", "ln_f"])
    assert Checkpointer(ckpt.parent).latest() == ckpt  # the cache is not taken for a checkpoint
    written = shard.stat().st_mtime_ns
    got = generate(load_streaming(tmp_path / "run", budget), PROMPT[:1], NEW, temperature=0)
    assert got.tolist() == want.tolist()
    assert shard.stat().st_mtime_ns == written  # read, not rewritten
    with torch.no_grad():  # the step saved again with other weights: the copy follows the checkpoint
        model.blocks["1"].mlp.fc2.weight.mul_(-1.0)
    Checkpointer(tmp_path / "run" / "checkpoints").save(
        3, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, config_text=LazyConfig.to_yaml(cfg))
    changed = generate(pretrained_model(tmp_path / "run"), PROMPT[:1], NEW, temperature=0)
    assert changed.tolist() != want.tolist()
    got = generate(load_streaming(tmp_path / "run", budget), PROMPT[:1], NEW, temperature=0)
    assert got.tolist() == changed.tolist()


def test_other_families_and_unmappable_weights_are_refused(tmp_path):
    torch.manual_seed(0)
    save_pretrained(BertModel(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4,
                              max_position_embeddings=64), tmp_path / "bert")
    with pytest.raises(DufuError, match=r"decoder families GPT \(gpt2\), LLaMA \(llama\), Qwen2 \(qwen2\)"):
        load_streaming(tmp_path / "bert", "1GB")
    gpt = tmp_path / "gpt"
    save_pretrained(_model("gpt"), gpt)
    (gpt / "model.safetensors").rename(gpt / "pytorch_model.bin")
    with pytest.raises(DataError, match="needs safetensors"):
        load_streaming(gpt, "1GB")


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2_000_000_000), ("2 gb", 2_000_000_000), ("512MiB", 512 * 2**20), ("1.5G", 1_500_000_000),
    ("1.5GiB", 3 * 2**29), ("1.1GB", 1_100_000_000), ("100k", 100_000), ("64Ki", 65536), ("123", 123),
    ("123B", 123), (".5TB", 500_000_000_000), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "2XB", "two GB", "-1GB", "0", "1.2.3G", 0])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(DufuError, match="memory size"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(1536 * 2**20) == "1.50 GiB (1,610,612,736 bytes)"
    assert format_bytes(512) == "512 bytes"
