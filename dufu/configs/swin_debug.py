# The tiny Swin the tests and multi-process checks use: 16 x 16 digits in 2 x 2 patches (an 8 x 8 map),
# 4 x 4 windows, two stages of 2 blocks (8 x 8 with shifted windows, patch merging, 4 x 4), embed_dim 16,
# heads 2-4 (divisible by tensor_parallel_size=2), 10 classes, no drop path, fp32.
from .swin_digits import dataloader, model, optim, tokenization, train

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

optim.lr = 1e-3
train.update(
    output_dir="output/swin_debug",
    train_iter=20,
    train_micro_batch_size=4,
    log_period=1,
)
train.scheduler.warmup_iter = 2
train.evaluation.update(eval_period=10, eval_iter=4)
train.checkpointer.period = 10
train.tensorboard = False
