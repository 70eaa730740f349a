# The run settings the fine-tuning recipes share (gpt_sft, llama_sft): a lower learning rate than pretraining,
# no weight decay, a 2-step warmup and no decay to zero, 20 steps. A recipe calls
# finetune_run(train, optim, "output/<name>").


def finetune_run(train, optim, output_dir: str) -> None:
    optim.lr = 2e-4
    optim.weight_decay = 0.0
    train.update(output_dir=output_dir, train_iter=20)
    train.scheduler.update(warmup_iter=2, min_lr_ratio=1.0)
