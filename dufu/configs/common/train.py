# The `train` namespace: every run-level setting, with LiBai's names and defaults.
from dufu.config import LazyCall as L
from dufu.engine.lr_scheduler import WarmupCosineLR

train = dict(
    output_dir="output/run",
    train_iter=1000,
    # Batch arithmetic (Megatron/LiBai): global = micro x data_parallel_size x num_accumulation_steps.
    # Set any two; the third is derived (None).
    train_micro_batch_size=8,
    global_batch_size=None,
    num_accumulation_steps=None,
    seed=1234,
    # End the run early, after writing a checkpoint, as if it had been interrupted; the LR schedule and
    # everything else still follow train_iter (Megatron's exit interval / exit duration). None: off.
    stop_at_iter=None,
    stop_after_minutes=None,
    # A non-finite loss or gradient: "stop" (name the step and the first offending tensor) or
    # "skip" (drop the update, count it, log it).
    nan_policy="stop",
    log_period=10,
    clip_grad_norm=1.0,
    # max_iter and optimizer are filled in by the trainer.
    scheduler=L(WarmupCosineLR)(warmup_iter=100, warmup_factor=0.0, min_lr_ratio=0.1),
    # Mixed precision. enabled: "auto" (autocast where this device's measured bf16, or fp16, matmul throughput beats
    # fp32's, else fp32: dufu.engine.precision), True (autocast to dtype), False (fp32), "bf16" or "fp16".
    amp=dict(
        enabled="auto",
        dtype="bf16",  # for enabled=True: "bf16" | "fp16" (fp16 uses dynamic loss scaling)
        # fp16's dynamic loss scaler (Micikevicius et al. 2018; the values torch.amp.GradScaler starts from):
        # the scale halves on an overflowing step (which is skipped) and doubles after growth_interval clean ones
        loss_scaler=dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                         min_scale=1.0),
        # Cast each weight to the autocast dtype once per step, not once per micro-batch (not under ZeRO-3).
        cache_weight_casts=True,
    ),
    # True: build the model on the meta device and allocate only each rank's shards after splitting and
    # sharding (dufu.parallel.materialize). False: every rank builds the full fp32 model first (what a
    # model without a per-module init, such as HFAutoModel, always gets). The initial weights are the same.
    meta_init=True,
    # Recompute activations in the backward pass, per transformer block (dufu.parallel.activation_checkpoint):
    # "selective" keeps matmul and attention outputs and recomputes norms, activations, dropout and casts;
    # "full" keeps only each block's input and recomputes the whole block.
    activation_checkpoint=dict(enabled=False, mode="selective"),
    # torch.compile each transformer block: true, false or "auto" (on where it measured faster, warm-up
    # included: dufu.parallel.compile.decide_compile). Compiled code is cached in the dufu cache directory.
    compile=dict(enabled="auto"),
    # period: save every N steps (0: no periodic saves); the last step (and an early stop) is always saved, so
    # a finished run can be resumed, converted and sampled. async_save: write in the background while training
    # goes on (torch DCP async_save).
    checkpointer=dict(period=1000, max_to_keep=3, async_save=False),
    # Every eval_period steps (and at the last), the mean over eval_iter global batches of the validation set.
    evaluation=dict(enabled=True, eval_period=500, eval_iter=20),
    generation=dict(
        enabled=False,
        prompts=["The "],
        max_new_tokens=64,
        temperature=0.8,
        top_k=40,
        top_p=None,
    ),
    dist=dict(
        data_parallel_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        # Mixture-of-experts models: their experts split over this many data-parallel ranks (it divides
        # data_parallel_size; tokens reach their experts by all-to-all). dufu.parallel.expert_parallel
        expert_parallel_size=1,
        # Long sequences: every sample's tokens split over this many ranks through the whole model (attention
        # gathers the other ranks' keys/values); a factor of the world, dp x cp x tp x pp.
        # dufu.parallel.context_parallel
        context_parallel_size=1,
        sequence_parallel=False,
        pipeline_num_layers=None,
        custom_pipeline_stage_id=None,
        pipeline_schedule="1f1b",
        virtual_pipeline_size=1,
        # A collective that waits longer than this (a dead or hung rank) stops the job with an error.
        timeout_minutes=10.0,
    ),
    zero_optimization=dict(enabled=False, stage=1),
    # SIGTERM / SIGUSR1 (a scheduler's preemption): every rank finishes its step, saves a checkpoint and exits
    # with code 75; the launcher gives the workers grace_seconds before it kills them. dufu.engine.preemption
    preemption=dict(enabled=True, grace_seconds=120),
    # Training through failures without a restart (torchft): this job is replica group replica_group_id of
    # replica_parallel_size groups that train one model, coordinated by `dufu lighthouse` at `lighthouse`
    # (http://HOST:PORT). mode: "replicate" (gradients averaged over the live groups every step), "diloco" (an
    # outer Nesterov SGD step on the averaged pseudo-gradients every sync_every steps; the paper's lr 0.7,
    # momentum 0.9) or "local_sgd" (weights averaged every sync_every steps). dufu.engine.fault_tolerance,
    # docs/faults.md
    fault_tolerance=dict(enabled=False, lighthouse=None, replica_group_id=0, replica_parallel_size=1,
                         min_replica_size=1, mode="replicate", sync_every=100,
                         outer_optimizer=dict(lr=0.7, momentum=0.9, nesterov=True), timeout_seconds=60.0,
                         quorum_timeout_seconds=300.0, connect_timeout_seconds=10.0),
    # Peak FLOP/s of one device for MFU, in TFLOP/s; None = data sheet (known GPUs) or a measured matmul (CPU).
    peak_tflops=None,
    tensorboard=True,
    device="auto",
)
