# A transformers architecture trained as-is (dufu.models.hf_auto): a tiny GPT-NeoX (transformers'
# GPTNeoXForCausalLM, rotary positions, parallel residual) built from a config dict, no weights, on the built-in
# corpus with the byte vocabulary -- the gpt_debug sizes. Data parallel, ZeRO 1/2/3, AMP and activation
# checkpointing work from config lines; tensor and pipeline parallelism need a dufu-layers model.
from dufu.config import LazyCall as L
from dufu.models.hf_auto import HFAutoModel

from .common.data.corpus import dataloader, tokenization
from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model = L(HFAutoModel)(
    model_type="gpt_neox",
    config=dict(
        vocab_size=384,  # the byte tokenizer's 257, padded
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=32,
        rotary_pct=0.25,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=256,
    ),
    path=None,
    load_weights=True,
    auto_class="AutoModelForCausalLM",
    attn_implementation="sdpa",
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/hf_auto_gpt_neox_debug")
