# The tiny ViT the tests and multi-process checks use: 16 x 16 digits in 4 x 4 patches (16 + [CLS]
# positions), 2 layers, hidden 32, 4 heads (2 per rank under tensor_parallel_size=2), 10 classes, fp32.
from .vit_digits import dataloader, model, optim, tokenization, train
from .common.debug import debug_run

model.update(
    image_size=16,
    patch_size=4,
    num_channels=1,
    num_labels=10,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
dataloader.train.update(image_size=16, num_channels=1)

debug_run(train, optim, "output/vit_debug")
