# A small Swin trained from scratch on the handwritten digits in about a minute of CPU time: images resized
# to 16 x 16, 2 x 2 patches (an 8 x 8 map), 4 x 4 windows, two stages (8 x 8 with shifted windows, patch
# merging, then 4 x 4), embed_dim 48, heads 2-4. Reaches about 94% validation accuracy after 900 steps of
# 32 images (chance: 10%).
from .common.data.digits import dataloader, tokenization
from .common.models.swin import model
from .common.optim import optim
from .common.train import train

model.update(
    image_size=16,
    patch_size=2,
    num_channels=1,
    num_labels=10,
    embed_dim=48,
    depths=[2, 2],
    num_heads=[2, 4],
    window_size=4,
    drop_path_rate=0.0,
)
dataloader.train.update(image_size=16, num_channels=1)

optim.update(lr=3e-3, weight_decay=0.05, betas=(0.9, 0.999))
train.update(
    output_dir="output/swin_digits",
    train_iter=900,
    train_micro_batch_size=32,
    log_period=20,
)
train.scheduler.warmup_iter = 30
train.evaluation.update(eval_period=300, eval_iter=20)
train.checkpointer.period = 900
train.tensorboard = False
