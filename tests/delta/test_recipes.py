"""The packaged delta recipes: llama_lora passes the start-up checks on the meta device without its weights;
bert_classify_lora trains only its adapters and head, and starts from the real MiniLM weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.delta import LoraLinear, apply_delta


def load(recipe: str):
    return LazyConfig.load(resolve_config_path(recipe))


def meta_build(cfg):
    with torch.device("meta"):
        model = instantiate(cfg.model)
        info = apply_delta(model, instantiate(cfg.delta))
    return model, info


# --------------------------------------------------------------------------------------------- llama_lora
def test_llama_lora_is_llama2_7b_with_rank_16_adapters_on_the_attention():
    cfg = load("llama_lora")
    cfg.model.pretrained = None  # the user's Hugging Face directory; the shapes need none
    model, info = meta_build(cfg)
    assert (model.num_layers, model.hidden_size, model.vocab_size, model.num_attention_heads) == (32, 4096, 32000, 32)
    lora = {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert len(lora) == 32 * 4
    assert {n.rsplit(".", 1)[-1] for n in lora} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all(m.lora_rank == 16 and m.lora_scaling == 2.0 for m in lora.values())
    # 4 projections x (16 x 4096 + 4096 x 16) per layer; the 6,738,415,616 of the base stay frozen
    assert info.trainable_count == 32 * 4 * 2 * 16 * 4096 == 16_777_216
    assert info.total_count - info.trainable_count == 6_738_415_616
    assert info.trainable_count / info.total_count < 0.01
    assert all(".lora_" in n for n in info.trainable)
    assert cfg.train.amp.enabled is True and cfg.train.amp.dtype == "bf16"
    assert cfg.optim.lr == pytest.approx(2e-4) and cfg.dataloader.train.data_path == "builtin"


def _llama2_7b_directory(path):
    """A stand-in for a Hugging Face Llama-2-7b-hf directory: its config.json and a tokenizer.json, no weights
    (the start-up checks read the sizes and the tokenizer, never a tensor)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float16",
    }))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 94 for c in range(97, 123)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("nproc,layout", [
    (1, []),
    (8, ["train.dist.data_parallel_size=4", "train.dist.tensor_parallel_size=2",
         "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"]),
    (8, ["train.dist.data_parallel_size=4", "train.dist.pipeline_parallel_size=2"]),
], ids=["1proc", "dp4-tp2-zero3", "dp4-pp2"])
def test_llama_lora_passes_the_start_up_checks_against_a_llama2_directory(nproc, layout, tmp_path):
    from dufu.engine.preflight import plan_run

    hf = _llama2_7b_directory(tmp_path / "Llama-2-7b-hf")
    cfg = load("llama_lora")
    LazyConfig.apply_overrides(cfg, [f"model.pretrained={hf}", f"tokenization.tokenizer.path={hf}",
                                     f"train.output_dir={tmp_path / 'out'}", *layout])
    plan = plan_run(cfg, nproc)
    assert plan.pretrained.path == str(hf) and plan.pretrained.source is not None  # read shard by shard later
    assert plan.model.delta_info.trainable_count == 16_777_216
    assert all(p.is_meta for p in plan.model.parameters())
    assert plan.batch_sizes[1] == 16 and len(plan.valid_ds) >= 16  # one global batch of validation pairs
    if "train.dist.pipeline_parallel_size=2" in layout:
        assert plan.stage_ids == [0] * 16 + [1] * 16


def test_llama_lora_without_its_weights_says_where_they_go(tmp_path):
    from dufu.engine.preflight import plan_run
    from dufu.errors import DufuError

    cfg = load("llama_lora")
    LazyConfig.apply_overrides(cfg, [f"tokenization.tokenizer.path={tmp_path / 'nowhere'}",
                                     f"train.output_dir={tmp_path / 'out'}"])
    with pytest.raises(DufuError, match="nowhere"):
        plan_run(cfg, 1)


# ------------------------------------------------------------------------------------- bert_classify_lora
def test_bert_classify_lora_trains_attention_adapters_and_the_new_head():
    cfg = load("bert_classify_lora")
    model, info = meta_build(cfg)
    lora = {n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert lora == {f"blocks.{i}.attn.{p}" for i in range(6) for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
    head = {"classifier.weight", "classifier.bias"}
    assert head <= set(info.trainable)
    assert set(info.trainable) - head == {f"{n}.lora_{f}.weight" for n in lora for f in "AB"}
    assert not any(n.startswith("pooler") for n in info.trainable)  # pretrained with the encoder: frozen
    assert info.trainable_count == 6 * 4 * 2 * 8 * 384 + 4 * 384 + 4 == 148_996
    assert info.trainable_count / info.total_count < 0.05


def test_bert_classify_lora_differs_from_bert_classify_only_in_the_delta_and_its_rate():
    lora, full = load("bert_classify_lora"), load("bert_classify")
    assert "delta" not in full
    assert lora.model == full.model and lora.dataloader == full.dataloader
    assert lora.tokenization == full.tokenization
    assert lora.optim.lr > full.optim.lr
    lora.optim.lr = full.optim.lr
    assert lora.optim == full.optim
    lora.train.output_dir = full.train.output_dir
    assert lora.train == full.train  # same steps, batch, schedule, evaluation, precision


@pytest.mark.filterwarnings("ignore:BertForSequenceClassification. classifier")  # the head is new
def test_bert_classify_lora_starts_from_minilm_and_saves_only_what_trains(tmp_path):
    """Two steps from the real weights: the frozen encoder keeps MiniLM's values, the factors and head move, and
    the checkpoint holds only them (with their AdamW moments)."""
    from safetensors import safe_open

    import dufu_testing
    from dufu.engine.weights.checkpoint import Checkpointer
    from dufu.models.bert.pretrained import all_minilm_l6_v2

    run = dufu_testing.train(tmp_path / "run", ["train.train_iter=2", "train.amp.enabled=False",
                                                "train.train_micro_batch_size=4", "train.global_batch_size=4",
                                                "train.scheduler.warmup_iter=0"], recipe="bert_classify_lora")
    model = run.trainer.model_parts[0]
    state = {k: v.detach() for k, v in model.state_dict().items()}
    with safe_open(str(Path(all_minilm_l6_v2()) / "model.safetensors"), "pt") as f:
        key = next(k for k in f.keys() if k.endswith("layer.0.attention.self.query.weight"))
        torch.testing.assert_close(state["blocks.0.attn.q_proj.weight"], f.get_tensor(key), rtol=0, atol=0)
    assert torch.count_nonzero(state["blocks.0.attn.q_proj.lora_B.weight"]) > 0  # B starts at zero
    ckpt = Checkpointer(run.output_dir / "checkpoints").latest()
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == set(run.trainer.runtime.delta.trainable)
    assert all(k.startswith(("model.", "optim.")) for k in keys)
    assert "optim.state.classifier.weight.exp_avg" in keys
