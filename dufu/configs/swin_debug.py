# The tiny Swin the tests and multi-process checks use: 16 x 16 digits in 2 x 2 patches (an 8 x 8 map),
# 4 x 4 windows, two stages of 2 blocks (8 x 8 with shifted windows, patch merging, 4 x 4), embed_dim 16,
# heads 2-4 (divisible by tensor_parallel_size=2), 10 classes, no drop path, fp32.
from .swin_digits import dataloader, model, optim, tokenization, train
from .common.debug import debug_run

model.update(
    image_size=16,
    patch_size=2,
    num_channels=1,
    num_labels=10,
    embed_dim=16,
    depths=[2, 2],
    num_heads=[2, 4],
    window_size=4,
    drop_path_rate=0.0,
)
dataloader.train.update(image_size=16, num_channels=1)

debug_run(train, optim, "output/swin_debug")
