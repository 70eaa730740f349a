# T5 span-corruption data (dufu.data.span_corruption): 15% of the tokens dropped in spans of mean length 3,
# each span replaced by a sentinel in the input and listed after it in the target; the same corruption for a
# sample index and seed in every layout. Sentinels are the num_sentinels ids just above the tokenizer's
# vocabulary, so model.vocab_size must be at least tokenizer vocab + num_sentinels.
from dufu.config import LazyCall as L
from dufu.data import build_tokenizer
from dufu.data.span_corruption import build_span_corruption_datasets

tokenization = dict(
    tokenizer=L(build_tokenizer)(kind="bpe", vocab_size=2048, corpus="builtin", path=None),
)

dataloader = dict(
    # tokenizer is filled in by the trainer from `tokenization.tokenizer`
    train=L(build_span_corruption_datasets)(
        data_path="builtin",
        inputs_length=128,
        noise_density=0.15,
        mean_noise_span_length=3.0,
        num_sentinels=100,
        valid_fraction=0.05,
        seed=1234,
    ),
)
