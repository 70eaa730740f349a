"""BERT and RoBERTa: encoders with masked-LM and sequence-classification heads."""

from dufu.models.bert.model import (
    BertForMaskedLM,
    BertForSequenceClassification,
    BertLayer,
    BertModel,
    EncoderOutput,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    RobertaModel,
    masked_lm_loss,
    sequence_classification_loss,
)

__all__ = [
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertLayer",
    "BertModel",
    "EncoderOutput",
    "RobertaForMaskedLM",
    "RobertaForSequenceClassification",
    "RobertaModel",
    "masked_lm_loss",
    "sequence_classification_loss",
]
