"""T5: the encoder-decoder, its encoder alone, and conditional generation."""

from dufu.models.t5.model import (
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
    count_t5_parameters,
    seq2seq_lm_loss,
)
from dufu.models.t5.relative_bias import relative_position_bucket

__all__ = ["T5EncoderModel", "T5ForConditionalGeneration", "T5Model", "count_t5_parameters",
           "relative_position_bucket", "seq2seq_lm_loss"]
