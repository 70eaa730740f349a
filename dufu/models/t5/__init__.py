from dufu.models.t5.model import (
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
    count_t5_parameters,
    relative_position_bucket,
    seq2seq_lm_loss,
)

__all__ = ["T5EncoderModel", "T5ForConditionalGeneration", "T5Model", "count_t5_parameters",
           "relative_position_bucket", "seq2seq_lm_loss"]
