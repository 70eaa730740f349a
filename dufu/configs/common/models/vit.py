# Vision Transformer image classifier (Dosovitskiy et al. 2021). Sizes here are ViT-B/16 at 224 x 224 with
# 1000 classes (86.6M); recipes edit them.
from dufu.config import LazyCall as L
from dufu.models.vit import ViTForImageClassification

model = L(ViTForImageClassification)(
    image_size=224,
    patch_size=16,
    num_channels=3,
    num_labels=1000,
    hidden_size=768,
    num_layers=12,
    num_attention_heads=12,
    ffn_hidden_size=None,  # 4 x hidden_size
    hidden_dropout=0.0,
    attention_dropout=0.0,
    layer_norm_eps=1e-12,
    qkv_bias=True,
    activation="gelu",
    initializer_range=0.02,
)
