# BERT with the masked-LM head (Devlin et al. 2019). Sizes here are BERT-base (110M); recipes edit them.
# The classes share these keys: BertModel (headless), BertForSequenceClassification (+ num_labels,
# classifier_dropout) and the RoBERTa variants in dufu.models.bert.
from dufu.config import LazyCall as L
from dufu.models.bert import BertForMaskedLM

model = L(BertForMaskedLM)(
    vocab_size=30522,
    hidden_size=768,
    num_layers=12,
    num_attention_heads=12,
    head_dim=None,  # hidden_size // num_attention_heads; a pruned model keeps its heads' size with fewer heads
    ffn_hidden_size=None,  # 4 x hidden_size
    max_position_embeddings=512,
    type_vocab_size=2,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    layernorm_epsilon=1e-12,
    activation="gelu",
    pad_token_id=0,
    initializer_range=0.02,
    tie_word_embeddings=True,
)
