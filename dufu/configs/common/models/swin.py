# Swin Transformer image classifier (Liu et al. 2021). Sizes here are Swin-T at 224 x 224 with 1000 classes
# (28.3M); recipes edit them.
from dufu.config import LazyCall as L
from dufu.models.swin import SwinForImageClassification

model = L(SwinForImageClassification)(
    image_size=224,
    patch_size=4,
    num_channels=3,
    num_labels=1000,
    embed_dim=96,
    depths=[2, 2, 6, 2],
    num_heads=[3, 6, 12, 24],
    window_size=7,
    mlp_ratio=4.0,
    qkv_bias=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    drop_path_rate=0.2,
    activation="gelu",
    use_absolute_embeddings=False,
    layer_norm_eps=1e-5,
    initializer_range=0.02,
)
