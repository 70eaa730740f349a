# Swin-T (Liu et al. 2021): 224 x 224 images in 4 x 4 patches, 7 x 7 windows, embed_dim 96, depths
# 2-2-6-2, heads 3-6-12-24, 1000 classes: 28,288,354 parameters. The data here are the digits resized to
# 224 x 224 x 3 (the only images that ship offline); the head keeps ImageNet's 1000 classes. Meant for GPUs.
from .common.data.digits import dataloader, tokenization
from .common.models.swin import model
from .common.optim import optim
from .common.train import train

dataloader.train.update(image_size=224, num_channels=3)

optim.update(lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999))
train.update(
    output_dir="output/swin_tiny",
    train_iter=2000,
    train_micro_batch_size=32,
    global_batch_size=256,
    log_period=10,
)
train.scheduler.warmup_iter = 200
train.evaluation.update(eval_period=200, eval_iter=1)
train.checkpointer.period = 1000
