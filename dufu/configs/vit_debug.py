# The tiny ViT the tests and multi-process checks use: 16 x 16 digits in 4 x 4 patches (16 + [CLS]
# positions), 2 layers, hidden 32, 4 heads (2 per rank under tensor_parallel_size=2), 10 classes, fp32.
from .vit_digits import dataloader, model, optim, tokenization, train

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

optim.lr = 1e-3
train.update(
    output_dir="output/vit_debug",
    train_iter=20,
    train_micro_batch_size=4,
    log_period=1,
)
train.scheduler.warmup_iter = 2
train.evaluation.update(eval_period=10, eval_iter=4)
train.checkpointer.period = 10
train.tensorboard = False
