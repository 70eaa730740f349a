# Image classification data that ships with scikit-learn: the 1,797 handwritten digits (8 x 8 grayscale,
# 10 classes), resized to image_size, repeated to num_channels and normalised; a seeded 80/20 split.
# The trainer builds a tokenizer for every run; image data ignores it (the byte tokenizer costs nothing).
from dufu.config import LazyCall as L
from dufu.data import build_tokenizer
from dufu.data.images import build_digits_datasets

tokenization = dict(tokenizer=L(build_tokenizer)(kind="byte", vocab_size=None))

dataloader = dict(
    train=L(build_digits_datasets)(image_size=32, num_channels=1, valid_fraction=0.2, seed=1234, mean=0.5, std=0.5),
)
