"""What a run tells people: the start-up summary, the records and progress lines while it trains, and the end
summary. Rank 0 writes and prints; the other ranks keep the same counters and stay silent."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.engine.inference.generate import generate
from dufu.engine.resilience.preemption import resume_command_here
from dufu.engine.reporting import memory
from dufu.engine.reporting.flops import count_matmul_params, flops_per_token
from dufu.engine.reporting.logger import MetricsWriter, ProgressBar, plot_loss_curve, read_metrics
from dufu.parallel.data_parallel import describe_zero_stage
from dufu.parallel.env import collective_device
from dufu.models.base import contract_of


def model_flops_per_token(model, seq_length: int) -> float:
    """The model FLOPs of one trained token (6N + 12*L*H*T), for MFU.

    12 L H T is, per layer, 6 T (d_qk + d_v): forward and backward (x 3) of the scores q k^T (2 T d_qk per token)
    and of their product with the values (2 T d_v), where d_qk = d_v = H = heads x head dimension. A model whose
    attention has other widths counts them per attention module (:func:`attention_widths`): multi-head latent
    attention (DeepSeek-V2/V3) has heads x (qk_nope + qk_rope) query/key and heads x v_head_dim value features,
    Qwen3's heads x head_dim is not its hidden size; a multi-token-prediction module (DeepSeek-V3's ``mtp``) counts
    as its parameters do (every trained token passes through it), with the output head it shares once more per
    depth."""
    declared = contract_of(model)
    widths = attention_widths(model)
    if widths is not None:
        params = count_matmul_params(model)
        head = declared.output_head()
        if getattr(model, "mtp", None) is not None and head is not None:
            # each multi-token-prediction depth runs the output head it shares with the main model once more
            params += len(model.mtp) * head.weight.numel()
        return 6.0 * params + 6.0 * seq_length * sum(qk + v for qk, v in widths)
    attention_layers = declared.attention_layers or 0  # T5: encoder + decoder
    return flops_per_token(count_matmul_params(model), attention_layers, declared.hidden_size or 0, seq_length)


def attention_widths(model) -> list[tuple[int, int]] | None:
    """(query/key, value) features of every attention module of ``model`` (heads x per-head dimension), or None
    when every one is the usual heads x head_dim = its input width (12 L H T counts those exactly)."""
    from dufu.layers.attention import Attention
    from dufu.layers.mla import MLA

    widths, usual = [], True
    for m in model.modules():
        if isinstance(m, MLA):
            widths.append((m.num_heads * m.qk_head_dim, m.num_heads * m.v_head_dim))
            usual = False
        elif isinstance(m, Attention):
            width = m.num_heads * m.head_dim
            widths.append((width, width))
            usual = usual and width == getattr(getattr(m, "q_proj", None), "in_features", width)
    return None if usual else widths


def describe(runtime, planned=None) -> str:
    """The start-up summary: model, layout, batch arithmetic, data, MFU basis, the planned memory peak
    (``planned``: a :class:`~dufu.engine.reporting.memory.PlannedMemory`), weights, output, notices."""
    t = runtime.cfg.train
    amp = runtime.precision.name
    zero = f", {describe_zero_stage(t.zero_optimization.stage)}" if t.zero_optimization.enabled else ""
    extras = []
    if t.dist.sequence_parallel:
        extras.append("sequence parallel")
    if runtime.schedule is not None:
        extras.append(f"{t.dist.pipeline_schedule} schedule")
    if t.activation_checkpoint.enabled:
        extras.append(f"{t.activation_checkpoint.mode} activation checkpointing")
    valid = len(runtime.valid_ds) if runtime.valid_ds is not None else 0
    return "\n".join([
        f"dufu: {runtime.model_name} with {runtime.num_parameters / 1e6:.2f}M parameters "
        f"{'(' + runtime.moe.describe(runtime.num_parameters) + ') ' if runtime.moe else ''}"
        f"on {runtime.device.type} ({amp})",
        f"  layout       {runtime.dims.describe()}{zero}{'; ' + ', '.join(extras) if extras else ''}",
        f"  batch        global {runtime.global_batch_size} = micro {runtime.micro_batch_size} x dp "
        f"{runtime.dims.data_parallel_size} x accumulation {runtime.num_accumulation_steps}; "
        f"{runtime.tokens_per_step:,} tokens/step",
        *data_lines(runtime, valid),
        f"  precision    {amp}: {runtime.precision.reason}",
        *([planned.line()] if planned is not None else []),
        f"  compile      {runtime.compile.reason}",
        f"  MFU          {runtime.flops_per_token / 1e6:,.1f} MFLOP/token (6N + 12*L*H*T); peak {runtime.peak_source}",
        weights_line(runtime),
        *([f"  delta        {runtime.delta.summary()}"] if runtime.delta is not None else []),
        f"  output       {runtime.output_dir}",
        *(f"  notice       {n}" for n in runtime.notices),
    ])


def data_lines(runtime, valid: int) -> list[str]:
    """The data line; for a blend (:class:`~dufu.data.blend.BlendedDataset`) also one line per dataset with its
    training tokens, weight and the epochs of it the run sees: train_iter x global batch x weight / its samples."""
    train = runtime.train_ds
    vocab = f"tokenizer vocab {runtime.tokenizer.vocab_size:,}"
    names = getattr(train, "names", None)
    if names is None or not hasattr(train, "datasets"):
        return [f"  data         {len(train):,} training samples, {valid:,} validation samples; {vocab}"]
    seen = runtime.cfg.train.train_iter * runtime.global_batch_size
    lines = [f"  data         blend of {len(names)} datasets, {len(train):,} training samples per pass, {valid:,} "
             f"validation samples; {vocab}"]
    width = max(len(n) for n in names)
    for name, ds, weight in zip(names, train.datasets, train.weights):
        tokens = getattr(ds, "num_tokens", None)
        tokens = f"{tokens:,} tokens, " if tokens is not None else ""
        epochs = seen * float(weight) / len(ds)
        lines.append(f"               {name:<{width}}  {tokens}{len(ds):,} samples, weight {weight:.3g}: "
                     f"{epochs:.3g} epochs in {runtime.cfg.train.train_iter:,} steps")
    return lines


def weights_line(runtime) -> str:
    """Where the weights come from and how much of the model this rank holds (people read it on rank 0)."""
    if runtime.resume_from is not None:
        source = f"from checkpoint {runtime.resume_from.name}"
    elif runtime.pretrained.path is not None:
        source = f"pretrained, {runtime.pretrained.path}"
    else:
        source = f"random init (seed {runtime.cfg.train.seed})"
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for p in {id(p): p for part in runtime.model_parts for p in part.parameters()}.values())
    build = "built on the meta device" if runtime.meta_init else "built in full on every rank"
    return f"  weights      {source}; {build}, rank {runtime.rank} holds {held / 1e6:.2f}M parameters"


def evaluation_line(step: int, ev: dict) -> str:
    acc = f", accuracy {100 * ev['eval_accuracy']:.1f}%" if "eval_accuracy" in ev else ""
    each = ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in ev.items() if k.startswith("eval_loss/"))
    each = f" ({each})" if each else ""  # a blend: each dataset's validation loss
    return f"step {step}: validation loss {ev['eval_loss']:.4f}{each}, perplexity {ev['eval_ppl']:.1f}{acc}"


def window_rates(tokens_per_step: int, steps: int, seconds: float, flops_per_token: float,
                 peak_flops: float | None, world_size: int) -> dict:
    """Throughput of a log window of ``steps`` steps that took ``seconds`` of wall time (every rank's steps
    included, see :class:`StepClock`): global tokens per second, seconds per step, and MFU, the model FLOPs per
    second over the peak of all ``world_size`` devices of the job (None without a known peak: an unknown GPU
    and no train.peak_tflops)."""
    tokens_per_s = tokens_per_step * steps / seconds
    mfu = flops_per_token * tokens_per_s / (peak_flops * world_size) if peak_flops else None
    return {"tokens_per_s": tokens_per_s, "step_time_s": seconds / steps, "mfu": mfu}


def max_over_ranks(value: float) -> float:
    """The largest ``value`` of all ranks (one all-reduce of one number on the default group's device)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class StepClock:
    """The wall time of the training steps of a log window, with every rank's steps in it.

    Rank 0's clock alone is not that time: a rank's steps can end after rank 0's (under pipeline parallelism
    rank 0 is the first stage, the last stage finishes a step's work later), and ranks reach the first step at
    different moments. So each rank times its own window, from the moment it left the previous synchronisation
    (a point every rank has passed) to the end of its last step, without the evaluations and checkpoint saves
    in between (:meth:`pause`), and the window is the longest of them: one all-reduce of one number per log
    period (``reduce_max``). It is at least the time any rank spent in the window's steps."""

    def __init__(self, reduce_max: Callable[[float], float] = max_over_ranks,
                 clock: Callable[[], float] = time.perf_counter):
        self.reduce_max, self.clock = reduce_max, clock
        self.mark = self.paused_from = self.paused = 0.0

    def start(self) -> float:
        """Every rank starts timing once all have arrived; returns this rank's start time."""
        self.reduce_max(0.0)
        self.mark = self.paused_from = self.clock()
        self.paused = 0.0
        return self.mark

    def step_done(self) -> None:
        """A step ended; whatever this rank does until :meth:`pause` is not training."""
        self.paused_from = self.clock()

    def pause(self) -> None:
        """An evaluation or checkpoint save since the last step ended: leave its time out of the window."""
        now = self.clock()
        self.paused += now - self.paused_from
        self.paused_from = now

    def window(self) -> float:
        """Seconds of training since the previous window, the longest over ranks (every rank calls this)."""
        own = self.clock() - self.mark - self.paused
        seconds = self.reduce_max(own)
        self.mark = self.paused_from = self.clock()
        self.paused = 0.0
        return seconds


class RunLog:
    """The records (metrics.jsonl, TensorBoard) and lines of a run in progress, and its end summary."""

    def __init__(self, trainer, clock: StepClock | None = None):
        t = trainer.cfg.train
        self.trainer, self.train_iter, self.log_period = trainer, t.train_iter, t.log_period
        self.runtime = rt = trainer.runtime
        self.writer = MetricsWriter(rt.output_dir, tensorboard=t.tensorboard,
                                    resume_step=trainer.step if rt.resume_from else None) if rt.is_main else None
        self.bar = None
        self.clock = clock or StepClock()
        self.peaks = memory.RunPeaks()  # every rank's memory peak, from the records

    def start(self) -> None:
        """The progress bar and the clocks of throughput and train.stop_after_minutes start here (on every rank
        at once: one synchronisation)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restart and self.writer is not None:  # a worker group restarted by --max-restarts: on the record
            tr, rt = self.trainer, self.runtime
            self.writer.write({"step": tr.step, "restart": restart,
                               "resumed_from": rt.resume_from.name if rt.resume_from is not None else None})
            tr.log(f"restart {restart} of the worker group: continuing at step {tr.step}")
        self.bar = ProgressBar(self.train_iter, initial=self.trainer.step, enabled=self.trainer.is_main)
        self.start_step, self.window_steps = self.trainer.step, 0
        self.timed_steps, self.timed_seconds = 0, 0.0  # the logged windows, for the end summary
        # the start-up's peak (the build, a resume), then the high-water mark starts again for the first window
        self.peaks.add(memory.gather_memory_records(memory.memory_record(self.runtime.device))[1])
        self.t_start = self.clock.start()

    def step(self, numbers=None) -> None:
        """Count a finished step; every train.log_period steps (and at the last) write a record of ``numbers``
        (the step's :class:`~dufu.engine.step_stats.StepRecord`, read back from the device by the loop for these
        steps only). Every rank calls this after every step (the record's time is reduced over ranks)."""
        tr, rt, step = self.trainer, self.runtime, self.trainer.step
        self.window_steps += 1
        if step % self.log_period == 0 or step == self.train_iter:
            if numbers is None or numbers.step != step:
                raise RuntimeError(f"RunLog.step at step {step} (a log step) needs that step's numbers")
            loss = numbers.loss
            seconds = self.clock.window()
            peak, per_rank = memory.gather_memory_records(memory.memory_record(rt.device))  # max over ranks
            self.peaks.add(per_rank)
            rates = window_rates(rt.tokens_per_step, self.window_steps, seconds, rt.flops_per_token, rt.peak_flops,
                                 rt.world_size)
            self.timed_steps, self.timed_seconds = self.timed_steps + self.window_steps, self.timed_seconds + seconds
            record = {
                "step": step, "loss": loss, "lr": tr.last_lr, "grad_norm": numbers.grad_norm,
                "tokens_per_s": rates["tokens_per_s"], "mfu": rates["mfu"], "step_time_s": rates["step_time_s"],
                "consumed_samples": tr.sampler.state_dict()["consumed_samples"], **peak,
            }
            if rt.compile_watch is not None:  # compilations after the warm-up (dufu.parallel.compile)
                record["recompiles"] = rt.compile_watch.recompile_count
            record.update(numbers.parts)  # the loss's named parts (e.g. lm_loss, mtp_loss), as the loss: this step's
            if numbers.skipped:
                record["skipped_steps"] = numbers.skipped
            if rt.moe:  # a mixture-of-experts model: its load balance (dufu.engine.moe_monitor)
                record.update(rt.moe.record(rt, step))
            if rt.scaler is not None:
                record["loss_scale"] = rt.scaler.scale
                record["skipped_steps"] = rt.scaler.skipped_steps
            self.writer and self.writer.write(record)
            self.window_steps = 0
            self.bar.update(0, loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}",
                            **{"tok/s": f"{rates['tokens_per_s']:,.0f}"}, mfu=f"{100 * rates['mfu']:.1f}%" if rates["mfu"] is not None else "n/a")
        self.bar.update(1)
        self.clock.step_done()

    def evaluation(self, ev: dict) -> None:
        """After an evaluation (every rank calls this): write it, and keep its time out of the throughput."""
        self.clock.pause()
        step = self.trainer.step
        self.writer and self.writer.write({"step": step, **ev})
        (self.bar.write if self.bar is not None else self.trainer.log)(evaluation_line(step, ev))

    def checkpoint(self, path) -> None:
        self.clock.pause()  # a save is not training time either
        saving = "saving" if self.trainer.checkpointer.async_save else "saved"
        self.bar.write(f"step {self.trainer.step}: {saving} checkpoint {path}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def mean_rates(self) -> dict:
        """Throughput and MFU over all logged windows: their tokens over their summed (training) time."""
        if not self.timed_steps or self.timed_seconds <= 0:
            return {"mean_tokens_per_s": None, "mean_mfu": None}
        rt = self.runtime
        rates = window_rates(rt.tokens_per_step, self.timed_steps, self.timed_seconds, rt.flops_per_token,
                             rt.peak_flops, rt.world_size)
        return {"mean_tokens_per_s": rates["tokens_per_s"], "mean_mfu": rates["mfu"]}

    def finish(self, stop_reason, samples: Callable[[], list]) -> dict:
        """Close the bar, say why the run stopped early (if it did), and return the end summary; rank 0 also
        prints it and draws loss.png. ``samples()``: generated text, which every rank takes part in."""
        tr = rt = self.runtime
        step = self.trainer.step
        self.close()
        if stop_reason:  # the command as this job was started: one process, or --nproc N (and --nnodes)
            tr.log(f"stopped at step {step} of {self.train_iter}: {stop_reason}. The checkpoint is complete; "
                   f"continue with: {resume_command_here(tr.output_dir)}")
        elapsed = time.perf_counter() - self.t_start
        summary = {"steps": step - self.start_step, "seconds": elapsed, "final_step": step,
                   "memory_peak_per_rank": self.peaks.per_rank,
                   "memory": self.peaks.text(self.trainer.planned_memory, self.trainer.start_rss)}
        texts = samples()
        if not tr.is_main:
            return summary
        self.writer.close()
        records = read_metrics(tr.output_dir / "metrics.jsonl")
        train_recs = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        summary.update(
            final_loss=train_recs[-1]["loss"] if train_recs else None,
            **self.mean_rates(),
            samples=texts,
        )
        for key in ("eval_loss", "eval_ppl", "eval_accuracy"):
            if evals and key in evals[0] and key in evals[-1]:
                summary[f"{key}_start"], summary[f"{key}_end"] = evals[0][key], evals[-1][key]
        if evals:
            summary["eval_steps"] = (evals[0]["step"], evals[-1]["step"])
        summary.setdefault("eval_ppl_start", None)
        summary.setdefault("eval_ppl_end", None)
        plot_loss_curve(tr.output_dir / "metrics.jsonl", tr.output_dir / "loss.png",
                        title=f"{tr.model_name} - {tr.dims.describe()}")
        if rt.moe:
            rt.moe.plot(title=f"{tr.model_name} - {tr.dims.describe()}")
        tr.log(summary_text(summary, tr.output_dir))
        return summary


def summary_text(s: dict, output_dir) -> str:
    """The end summary. Its headline is what the task is judged by: accuracy for classification (a class label
    per sample), perplexity for language modelling; the validation loss follows as a secondary line."""
    lines = ["", "=" * 72, f"finished: {s['steps']} steps in {s['seconds']:.1f} s (now at step {s['final_step']})"]
    if s.get("final_loss") is not None:
        lines.append(f"  final train loss     {s['final_loss']:.4f}")
    if s.get("eval_accuracy_start") is not None:
        lines.append(f"  validation accuracy  {100 * s['eval_accuracy_start']:.1f}% -> "
                     f"{100 * s['eval_accuracy_end']:.1f}%")
        lines.append(f"  validation loss      {s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f}")
    elif s.get("eval_ppl_start") is not None:
        steps = s.get("eval_steps")
        if steps is not None and steps[0] == steps[1]:  # one evaluation: nothing to compare
            lines.append(f"  validation ppl       {s['eval_ppl_end']:.2f} (step {steps[1]}, the only evaluation)")
        else:
            lines.append(f"  validation ppl       {s['eval_ppl_start']:.1f} -> {s['eval_ppl_end']:.2f}  "
                         f"({change(s['eval_ppl_start'], s['eval_ppl_end'])})")
    if s.get("mean_tokens_per_s"):
        mfu = f"MFU {100 * s['mean_mfu']:.1f}%" if s.get("mean_mfu") is not None else "MFU n/a"
        lines.append(f"  throughput           {s['mean_tokens_per_s']:,.0f} tokens/s, {mfu}")
    if s.get("memory"):
        lines.append("  peak memory          " + s["memory"].removeprefix("  peak memory  "))
    written = written_files(output_dir)
    lines.append(f"  written to           {output_dir}/" + (f" ({', '.join(written)})" if written else ""))
    for prompt, text in s.get("samples", []):
        lines.append("-" * 72)
        lines.append(f"{prompt}\u2502{text}")
    lines.append("=" * 72)
    return "\n".join(lines)


def change(start: float, end: float) -> str:
    """How a value that should fall (perplexity) moved: ``10.0x lower``, ``1.3x higher``, and in percent when the
    factor is under 1.1 (``3.2% lower``)."""
    if end == start:
        return "unchanged"
    word = "lower" if end < start else "higher"
    factor = max(start, end) / min(start, end) if min(start, end) > 0 else float("inf")
    if factor >= 1.1:
        return f"{factor:.1f}x {word}"
    return f"{100 * abs(end - start) / start:.1f}% {word}"


# What a run writes into its output_dir, in the order the summary names them (any other entry follows, sorted).
RUN_FILES = ("config.yaml", "metrics.jsonl", "loss.png", "tokenizer.json", "tensorboard", "checkpoints")


def written_files(output_dir) -> list[str]:
    """The entries of ``output_dir`` as the summary lists them (a directory with a trailing /): what is there,
    not what a run may write (no tensorboard/ without train.tensorboard, no checkpoints/ without a save)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    present = {p.name: p.is_dir() for p in root.iterdir() if not p.name.startswith(".")}
    order = [n for n in RUN_FILES if n in present] + sorted(n for n in present if n not in RUN_FILES)
    return [f"{n}/" if present[n] else n for n in order]


def sample_text(runtime) -> list[tuple[str, str]]:
    """A few generated continuations (all ranks take part under TP/FSDP; not under pipeline parallelism; under
    context parallelism every rank runs the whole prompt, its chunking paused)."""
    g = runtime.cfg.train.generation
    if not g.enabled or runtime.schedule is not None:
        return []
    out = []
    gen = torch.Generator(device=runtime.device).manual_seed(runtime.cfg.train.seed)
    for prompt in g.prompts:
        ids = torch.tensor([runtime.tokenizer.encode(prompt)], device=runtime.device)
        with runtime.autocast(loss=False), (runtime.cp.paused() if runtime.cp else contextlib.nullcontext()):
            full = generate(
                runtime.model, ids, g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                max_context=contract_of(runtime.model).max_position_embeddings, generator=gen,
            )
        out.append((prompt, runtime.tokenizer.decode(full[0, ids.shape[1]:].tolist())))
    return out
