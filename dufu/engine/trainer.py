"""The Trainer: a constructor that only wires parts together, and one readable training loop."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from pathlib import Path
from typing import Optional

import torch

from dufu.config import LazyConfig, instantiate
from dufu.data import ResumableBatchSampler, collate
from dufu.dist import ParallelDims
from dufu.engine import env
from dufu.engine.checkpoint import Checkpointer
from dufu.engine.flops import count_matmul_params, device_peak_flops, flops_per_token
from dufu.engine.generate import generate
from dufu.engine.logger import MetricsWriter, ProgressBar, plot_loss_curve, read_metrics
from dufu.engine.validate import resolve_batch_sizes, validate_config
from dufu.errors import ConfigError, DufuError
from dufu.parallel import parallelize

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_model_inputs(batch) -> dict:
    """A (B, T+1) token tensor becomes next-token inputs and labels; dict batches pass through."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch[:, :-1], "labels": batch[:, 1:]}
    return dict(batch)


class Trainer:
    def __init__(self, cfg, resume: bool = False, log=print):
        self.log = log
        validate_config(cfg)
        self.cfg = cfg
        t = cfg.train
        self.rank, self.local_rank, self.world_size = env.world_info()
        self.is_main = self.rank == 0
        self.dims = ParallelDims.from_config(t.dist, self.world_size)
        self.micro_batch_size, self.global_batch_size, self.num_accumulation_steps = resolve_batch_sizes(
            t.train_micro_batch_size, t.global_batch_size, t.num_accumulation_steps, self.dims.data_parallel_size
        )
        self.device = env.pick_device(self.local_rank) if t.get("device", "auto") == "auto" else torch.device(t.device)
        self.output_dir = Path(t.output_dir)
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", t.checkpointer.max_to_keep, self.rank)
        self.resume_from = self._find_resume_checkpoint(resume)

        torch.manual_seed(t.seed)
        self.tokenizer = instantiate(cfg.tokenization.tokenizer)
        self.train_ds, self.valid_ds = self._build_datasets()
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.scheduler = instantiate(with_kwargs(t.scheduler, optimizer=self.optimizer, max_iter=t.train_iter))
        self.sampler = ResumableBatchSampler(
            len(self.train_ds), self.global_batch_size, self.micro_batch_size,
            data_parallel_rank=0, data_parallel_size=self.dims.data_parallel_size, seed=t.seed,
        )
        self.amp_dtype = AMP_DTYPES[t.amp.dtype] if t.amp.enabled else None
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype == torch.float16 else None
        self.step = 0
        seq_length = self.train_ds[0].shape[0] - 1
        self.tokens_per_step = self.global_batch_size * seq_length
        self.flops_per_token = flops_per_token(
            count_matmul_params(self.model), getattr(self.model, "num_layers", 0),
            getattr(self.model, "hidden_size", 0), seq_length,
        )
        self.peak_flops, self.peak_source = device_peak_flops(
            self.device, self.amp_dtype or torch.float32, t.get("peak_tflops")
        )

    # ------------------------------------------------------------- building
    def _find_resume_checkpoint(self, resume: bool) -> Optional[Path]:
        latest = self.checkpointer.latest()
        if resume:
            if latest is None:
                raise DufuError(
                    f"--resume was given but {self.checkpointer.root} holds no complete checkpoint. "
                    "Check train.output_dir, or start the run without --resume."
                )
            return latest
        if latest is not None or (self.output_dir / "metrics.jsonl").exists():
            raise DufuError(
                f"train.output_dir '{self.output_dir}' already holds a run"
                f"{f' (latest checkpoint {latest.name})' if latest else ''}. Nothing was changed. To continue it, add "
                "--resume; to start a new run, choose another directory (train.output_dir=...) or delete this one."
            )
        return None

    def _build_datasets(self):
        ds_cfg = with_kwargs(self.cfg.dataloader.train, tokenizer=self.tokenizer)
        train_ds, valid_ds = instantiate(ds_cfg)
        return train_ds, valid_ds

    def _build_model(self) -> torch.nn.Module:
        model = instantiate(self.cfg.model)
        vocab = getattr(model, "vocab_size", None)
        if vocab is not None and self.tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is {vocab}. "
                f"Set model.vocab_size={self.tokenizer.vocab_size} or more (a multiple of 128 is fastest)."
            )
        max_pos = getattr(model, "max_position_embeddings", None)
        seq = self.train_ds[0].shape[0] - 1
        if max_pos is not None and seq > max_pos:
            raise ConfigError(
                f"the data's sequence length {seq} exceeds model.max_position_embeddings {max_pos}; lower "
                f"dataloader.train.seq_length or raise model.max_position_embeddings."
            )
        model.to(self.device)
        t = self.cfg.train
        return parallelize(
            model, self.dims,
            activation_checkpoint=t.activation_checkpoint.enabled,
            compile=t.get("compile", {}).get("enabled", False),
        )

    def _build_optimizer(self):
        optim_cfg = copy.deepcopy(self.cfg.optim)
        if isinstance(optim_cfg.get("params"), dict) and "_target_" in optim_cfg.params:
            optim_cfg.params.model = self.model
        else:
            optim_cfg.params = self.model.parameters()
        return instantiate(optim_cfg)

    # ------------------------------------------------------------ one step
    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def train_step(self, micro_batches: list[list[int]]) -> tuple[float, float]:
        """Forward/backward over the micro-batches of one global batch, clip, update. Returns (loss, grad_norm)."""
        self.model.train()
        total_loss = torch.zeros((), device=self.device)
        n = len(micro_batches)
        for indices in micro_batches:
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in to_model_inputs(collate(self.train_ds, indices)).items()}
            with self.autocast():
                loss = self.model(**inputs).loss / n  # mean over the global batch: micro-batches are equal-sized
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total_loss += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.get("clip_grad_norm") or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total_loss.item(), grad_norm.item()

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean validation loss and perplexity over the first ``eval_iter`` batches of the validation set."""
        ev = self.cfg.train.evaluation
        batch = ev.get("eval_batch_size") or self.micro_batch_size
        n = min(len(self.valid_ds), ev.get("eval_iter", 20) * batch)
        self.model.eval()
        loss_sum, count = 0.0, 0
        for start in range(0, n, batch):
            indices = list(range(start, min(n, start + batch)))
            inputs = {k: v.to(self.device) for k, v in to_model_inputs(collate(self.valid_ds, indices)).items()}
            with self.autocast():
                loss = self.model(**inputs).loss
            loss_sum += loss.item() * len(indices)
            count += len(indices)
        self.model.train()
        mean = loss_sum / max(count, 1)
        return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_samples": count}

    # ------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(
            self.step, self.model, self.optimizer, self.trainer_state(),
            extra_meta={"layout": self.dims.describe(), "global_batch_size": self.global_batch_size},
        )

    def load_checkpoint(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    # ------------------------------------------------------------ samples
    def sample_text(self) -> list[tuple[str, str]]:
        g = self.cfg.train.get("generation", {})
        if not g.get("enabled", False):
            return []
        out = []
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        for prompt in g.get("prompts", []):
            ids = torch.tensor([self.tokenizer.encode(prompt)], device=self.device)
            with self.autocast():
                full = generate(
                    self.model, ids, g.get("max_new_tokens", 64), temperature=g.get("temperature", 0.8),
                    top_k=g.get("top_k"), top_p=g.get("top_p"), max_context=getattr(self.model, "max_position_embeddings", None),
                    generator=gen,
                )
            out.append((prompt, self.tokenizer.decode(full[0, ids.shape[1]:].tolist())))
        return out

    # ------------------------------------------------------------ the loop
    def train(self) -> dict:
        t = self.cfg.train
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
            self.log(f"resumed from {self.resume_from} (step {self.step})")
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            LazyConfig.save(self.cfg, self.output_dir / "config.yaml")
            self.log(self.describe())
        writer = MetricsWriter(self.output_dir, tensorboard=t.get("tensorboard", True),
                               resume_step=self.step if self.resume_from else None) if self.is_main else None
        eval_enabled = t.evaluation.enabled and self.valid_ds is not None
        first_eval = None
        if eval_enabled and self.step == 0:
            first_eval = self.evaluate()
            writer and writer.write({"step": 0, **first_eval})
            self.log(f"step 0: validation loss {first_eval['eval_loss']:.4f}, perplexity {first_eval['eval_ppl']:.1f}")
        bar = ProgressBar(t.train_iter, initial=self.step, enabled=self.is_main)
        start_step, t_start, t_last, last_eval = self.step, time.perf_counter(), time.perf_counter(), first_eval
        window_steps, mfus = 0, []
        while self.step < t.train_iter:
            loss, grad_norm = self.train_step(self.sampler.next_step())
            self.step += 1
            window_steps += 1
            if not math.isfinite(loss):
                bar.close()
                raise DufuError(
                    f"the loss became {loss} at step {self.step}. Lower optim.lr, enable train.clip_grad_norm, "
                    "or use train.amp.dtype=bf16 instead of fp16."
                )
            if self.step % t.log_period == 0 or self.step == t.train_iter:
                now = time.perf_counter()
                tokens_per_s = self.tokens_per_step * window_steps / (now - t_last)
                mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
                mfus.append(mfu)
                record = {
                    "step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
                    "step_time_s": (now - t_last) / window_steps,
                    "consumed_samples": self.sampler.state_dict()["consumed_samples"],
                }
                if self.scaler is not None:
                    record["loss_scale"] = self.scaler.get_scale()
                writer and writer.write(record)
                t_last, window_steps = now, 0
                bar.update(0, loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", **{"tok/s": f"{tokens_per_s:,.0f}"},
                           mfu=f"{100 * mfu:.1f}%")
            bar.update(1)
            if eval_enabled and (self.step % t.evaluation.eval_period == 0 or self.step == t.train_iter):
                last_eval = self.evaluate()
                writer and writer.write({"step": self.step, **last_eval})
                bar.write(f"step {self.step}: validation loss {last_eval['eval_loss']:.4f}, perplexity {last_eval['eval_ppl']:.1f}")
            period = t.checkpointer.period
            if (period and self.step % period == 0) or self.step == t.train_iter:
                path = self.save_checkpoint()
                bar.write(f"step {self.step}: saved checkpoint {path}")
        bar.close()
        elapsed = time.perf_counter() - t_start
        summary = {"steps": self.step - start_step, "seconds": elapsed, "final_step": self.step}
        if self.is_main:
            writer.close()
            records = read_metrics(self.output_dir / "metrics.jsonl")
            train_recs = [r for r in records if "loss" in r]
            evals = [r for r in records if "eval_loss" in r]
            summary.update(
                final_loss=train_recs[-1]["loss"] if train_recs else None,
                eval_ppl_start=evals[0]["eval_ppl"] if evals else None,
                eval_ppl_end=evals[-1]["eval_ppl"] if evals else None,
                mean_tokens_per_s=(self.tokens_per_step * summary["steps"] / elapsed) if elapsed > 0 else None,
                mean_mfu=(sum(mfus) / len(mfus)) if mfus else None,
            )
            plot_loss_curve(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png",
                            title=f"{type(self.model).__name__} - {self.dims.describe()}")
            summary["samples"] = self.sample_text()
            self.log(self.summary_text(summary))
        return summary

    # ------------------------------------------------------------ people
    def describe(self) -> str:
        n_params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        t = self.cfg.train
        amp = f"{t.amp.dtype} autocast" if t.amp.enabled else "fp32"
        return "\n".join([
            f"dufu: {type(self.model).__name__} with {n_params / 1e6:.2f}M parameters on {self.device} ({amp})",
            f"  layout       {self.dims.describe()}",
            f"  batch        global {self.global_batch_size} = micro {self.micro_batch_size} x dp "
            f"{self.dims.data_parallel_size} x accumulation {self.num_accumulation_steps}; "
            f"{self.tokens_per_step:,} tokens/step",
            f"  data         {len(self.train_ds):,} training samples, "
            f"{len(self.valid_ds) if self.valid_ds is not None else 0:,} validation samples; tokenizer vocab "
            f"{self.tokenizer.vocab_size:,}",
            f"  MFU          {self.flops_per_token / 1e6:,.1f} MFLOP/token (6N + 12*L*H*T); peak {self.peak_source}",
            f"  output       {self.output_dir}",
        ])

    def summary_text(self, s: dict) -> str:
        lines = ["", "=" * 72, f"finished: {s['steps']} steps in {s['seconds']:.1f} s (now at step {s['final_step']})"]
        if s.get("final_loss") is not None:
            lines.append(f"  final train loss     {s['final_loss']:.4f}")
        if s.get("eval_ppl_start") is not None:
            ratio = s["eval_ppl_start"] / s["eval_ppl_end"]
            lines.append(
                f"  validation ppl       {s['eval_ppl_start']:.1f} -> {s['eval_ppl_end']:.2f}  ({ratio:.1f}x lower)"
            )
        if s.get("mean_tokens_per_s"):
            lines.append(f"  throughput           {s['mean_tokens_per_s']:,.0f} tokens/s, MFU {100 * (s['mean_mfu'] or 0):.1f}%")
        lines.append(f"  written to           {self.output_dir}/ (config.yaml, metrics.jsonl, loss.png, tensorboard/, checkpoints/)")
        for prompt, text in s.get("samples", []):
            lines.append("-" * 72)
            lines.append(f"{prompt}\u2502{text}")
        lines.append("=" * 72)
        return "\n".join(lines)


def with_kwargs(node, **kwargs):
    """A copy of a LazyCall node with some keyword arguments filled in by the trainer (never saved)."""
    node = copy.deepcopy(node)
    for k, v in kwargs.items():
        node[k] = v
    return node
