# T5 encoder-decoder with the language-model head (Raffel et al. 2020). Sizes here are T5-base (223M);
# recipes edit them. The headless T5Model and the encoder-only T5EncoderModel (dufu.models.t5) take the same
# keys (T5EncoderModel: without the decoder and head ones).
from dufu.config import LazyCall as L
from dufu.models.t5 import T5ForConditionalGeneration

model = L(T5ForConditionalGeneration)(
    vocab_size=32128,
    d_model=768,
    d_kv=64,
    d_ff=3072,
    num_layers=12,
    num_decoder_layers=None,  # = num_layers
    num_heads=12,
    feed_forward_proj="relu",  # "gated-gelu" for T5 v1.1 (with tie_word_embeddings=False)
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.1,
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=True,
    scale_decoder_outputs=None,  # = tie_word_embeddings
    pad_token_id=0,
    decoder_start_token_id=None,  # = pad_token_id
    initializer_factor=1.0,
)
