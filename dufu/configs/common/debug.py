# The run settings every *_debug recipe shares (tests and multi-process checks use them): 20 steps of
# micro-batch 4 at lr 1e-3 with a 2-step warmup, fp32, a log line per step, evaluation (4 batches) and a
# checkpoint every 10 steps, no TensorBoard. A recipe calls debug_run(train, optim, "output/<name>").


def debug_run(train, optim, output_dir: str) -> None:
    optim.lr = 1e-3
    train.update(output_dir=output_dir, train_iter=20, train_micro_batch_size=4, log_period=1)
    train.amp.enabled = False
    train.scheduler.warmup_iter = 2
    train.evaluation.update(eval_period=10, eval_iter=4)
    train.checkpointer.period = 10
    train.tensorboard = False
