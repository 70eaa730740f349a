"""The memory side of ``benchmarks/parallel.py``: the models it measures memory with, the theory of what a rank
should hold (the ZeRO paper's model states, FSDP2's working set, dufu's mechanism; the meta-device build), and
the memory-recording runs (``dufu train`` under torchrun with :class:`harness.memory.MemoryPhases`, against a
baseline of the same layout with a tiny model). ``benchmarks/plan_accuracy.py`` and ``benchmarks/delta.py`` run
the same jobs; the module docstring of ``parallel.py`` says what is measured and why.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from harness import launch
from harness.memory import ALLOCATORS, memory_job, phase_mib  # noqa: F401 (ALLOCATORS: also for its importers)
from harness.results import fmt

MiB = 1024 * 1024

MEMORY_MODEL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=8192, max_position_embeddings=64)
QUICK_MEMORY_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=2048,
                          max_position_embeddings=64)
BASELINE_MODEL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=384, max_position_embeddings=64)
MEMORY_SEQ = 64
MEMORY_STEPS = 2  # step 1 creates AdamW's state; step 2 runs forward/backward with every model state alive

COMMON = [
    "train.evaluation.enabled=False",
    "train.tensorboard=False",
    "train.checkpointer.period=0",  # the trainer still saves once, after the last step
    "train.log_period=1",
]


def model_overrides(model: dict, seq: int) -> list[str]:
    return [f"model.{k}={v}" for k, v in model.items()] + [f"dataloader.train.seq_length={seq}"]


# ----------------------------------------------------------------------------- memory
def parameter_counts(model: dict, recipe: str = "gpt_debug") -> dict:
    """Exact parameter counts of ``recipe``'s model with ``model``'s sizes, built on the meta device: total, root
    unit (everything outside the blocks), one block, the FSDP end units of ``dufu.parallel.data_parallel`` (embedding tables,
    final norm + head, a tied head counted in both) and the tied copy a rank holds under ZeRO, and the largest
    module's own parameters and buffers (what the meta-device initialisation fills in full at once:
    ``dufu.parallel.materialize.ModuleInitializer``)."""
    import torch

    from dufu.config import LazyConfig, instantiate, resolve_config_path
    from dufu.parallel import transformer_blocks
    from dufu.parallel.data_parallel import end_units

    cfg = LazyConfig.load(str(resolve_config_path(recipe)))
    cfg = LazyConfig.apply_overrides(cfg, [f"model.{k}={v}" for k, v in model.items()])
    with torch.device("meta"):
        m = instantiate(cfg.model)
    unique = lambda ps: sum(p.numel() for p in {id(p): p for p in ps}.values())  # noqa: E731 (tied weights once)
    total = unique(m.parameters())
    blocks = transformer_blocks(m)
    in_blocks = sum(unique(b.parameters()) for _, b in blocks)
    embeddings, last = end_units(m)
    tied_copy = sum(m.get_parameter(a).numel() for a, s in getattr(m, "tied_parameter_names", {}).items()
                    if m.get_parameter(a) is m.get_parameter(s))
    own = {name: sum(t.numel() * t.element_size() for t in [*mod._parameters.values(), *mod._buffers.values()]
                     if t is not None) for name, mod in m.named_modules()}
    largest = max(own, key=own.get)
    return {"total": total, "root": total - in_blocks, "per_block": in_blocks // max(1, len(blocks)),
            "num_blocks": len(blocks), "embedding_unit": unique(p for e in embeddings for p in e.parameters()),
            "head_unit": unique(p for h in last for p in h.parameters()), "tied_copy": tied_copy,
            "largest_module": largest, "largest_module_bytes": own[largest]}


def theory_bytes(P: int, stage: int, dp: int) -> float:
    """ZeRO paper, fp32 + AdamW: parameters 4 B, gradients 4 B, optimizer states 8 B per parameter."""
    params, grads, optim = 4.0 * P, 4.0 * P, 8.0 * P
    if stage >= 1:
        optim /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return params + grads + optim


def working_set_bytes(counts: dict) -> float:
    """What FSDP2 holds beyond the shards while one unit is in backward, the larger of: a block's gathered
    parameters and full-size gradient, and the next block's parameters (FSDP2 gathers one unit ahead in
    backward), 12 B per block parameter; at the end, the embedding tables' full-size gradient and the
    reduce-scatter buffer it is copied into (never gathered: an embedding's backward needs only the indices),
    8 B per parameter of the end units."""
    end_unit = max(counts.get("embedding_unit", 0), counts.get("head_unit", 0))
    return max(12.0 * counts["per_block"], 8.0 * end_unit)


def dufu_estimate_bytes(counts: dict, stage: int, dp: int) -> float:
    """The peak memory of dufu's mechanism (see the module docstring)."""
    P = counts["total"]
    if stage == 0:
        return 16.0 * P  # replicate: everything on every rank
    if stage == 3:  # + the tied head's sharded copy of the embedding
        return 16.0 * P / dp + 4.0 * counts.get("tied_copy", 0) / dp + working_set_bytes(counts)
    # Stages 1 and 2: blocks and the root (embeddings, head, final norm) stay gathered from forward to
    # backward; at the start of backward the head's full gradient (the tied one held to the end) comes on top.
    gathered = counts["num_blocks"] * counts["per_block"] + counts["root"]
    start_of_backward = 12.0 * P / dp + 4.0 * gathered + 4.0 * counts["head_unit"]
    return max(start_of_backward, 16.0 * P / dp + working_set_bytes(counts))


def derive_memory_figures(mem: dict) -> None:
    """(Re)compute each row's model states, ZeRO figure and mechanism estimate from the parameter counts."""
    for r in mem["rows"]:
        if r["kind"] != "model":
            continue
        c = mem["parameters_untied" if r.get("variant") == "untied" else "parameters"]
        states = theory_bytes(c["total"], r["zero_stage"], r["dp"])
        r.update(theory_mib=states / MiB, dufu_estimate_mib=dufu_estimate_bytes(c, r["zero_stage"], r["dp"]) / MiB,
                 zero_figure_mib=(states + working_set_bytes(c)) / MiB if r["zero_stage"] else None)
    # The paper's figure counts model states only; activations are its "residual states", and every rank holds
    # those of its own micro-batch whatever the ZeRO stage. Measured, not modelled: the 1-process run's training
    # peak above baseline minus its model states (same micro-batch, same sequence as every dp rank here).
    one = next((r for r in mem["rows"] if r["kind"] == "model" and r["dp"] == 1 and not r.get("variant")
                and r.get("allocator", "mmap64k") == "mmap64k" and "train_minus_baseline_mib" in r), None)
    mem["activations_mib"] = (one["train_minus_baseline_mib"]["max"] - one["theory_mib"]) if one else None
    for r in mem["rows"]:
        if r["kind"] == "model" and r.get("zero_figure_mib") is not None and mem["activations_mib"] is not None:
            r["zero_figure_activations_mib"] = r["zero_figure_mib"] + mem["activations_mib"]


def worker_job(label: str, nproc: int, global_batch: int, model: dict, overrides: list[str], allocator: str,
               work: Path, cache: Path, timeout: float, steps: int = MEMORY_STEPS,
               recipe: str = "gpt_debug") -> tuple[launch.Run, list[dict] | None]:
    """One memory-recording training run of ``recipe`` with ``model``'s sizes (:func:`harness.memory.memory_job`),
    micro-batch 1, ``steps`` steps; every rank's record. Its ``metrics.jsonl`` stays in ``<work>/memory/<label>/run``."""
    out = work / "memory" / label
    argv = [recipe, *COMMON, f"train.train_iter={steps}", "train.train_micro_batch_size=1",
            f"train.global_batch_size={global_batch}",
            "train.peak_tflops=1.0",  # skip the peak-FLOP/s matmul measurement (3 x 16 MiB of buffers)
            *model_overrides(model, MEMORY_SEQ), *overrides]
    run, ranks = memory_job(label, nproc, argv, out, cache, timeout, allocator)
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)
    return run, ranks


def zero_job(label: str, dp: int, stage: int, model: dict, allocator: str, work: Path, cache: Path,
             timeout: float) -> tuple[launch.Run, list[dict] | None]:
    zero = ["train.zero_optimization.enabled=False"] if stage == 0 else [
        "train.zero_optimization.enabled=True", f"train.zero_optimization.stage={stage}"]
    return worker_job(label, dp, dp, model, [f"train.dist.data_parallel_size={dp}", *zero], allocator, work, cache,
                      timeout)


@dataclass
class MemoryJob:
    kind: str  # "model" or "baseline"
    dp: int
    stage: int
    allocator: str
    variant: str = ""  # "untied": the same model with tie_word_embeddings=False

    @property
    def label(self) -> str:
        if self.kind == "baseline":
            return f"baseline-dp{self.dp}-{self.allocator}"
        return f"dp{self.dp}-zero{self.stage}-{self.allocator}{'-' + self.variant if self.variant else ''}"

    def describe(self) -> str:
        if self.kind == "baseline":
            return "baseline (tiny model)"
        what = f"ZeRO-{self.stage}" if self.stage else ("1 process" if self.dp == 1 else "ZeRO off (DDP)")
        return what + (", untied head" if self.variant == "untied" else "")


def memory_jobs(dps: list[int], stages: list[int], default_malloc: list[tuple[int, int]], reference: bool) -> list:
    jobs = []
    if reference:  # one process: the plain 16 B/param case, with and without the tied embedding/head
        jobs += [MemoryJob("baseline", 1, 0, "mmap64k"), MemoryJob("model", 1, 0, "mmap64k"),
                 MemoryJob("model", 1, 0, "mmap64k", "untied")]
    for dp in dps:
        jobs.append(MemoryJob("baseline", dp, 0, "mmap64k"))
        jobs += [MemoryJob("model", dp, s, "mmap64k") for s in stages]
    # No separate baseline for the default allocator: the tiny model makes almost no allocation of 64 KiB or
    # more, so its RSS is the same under both settings (measured: within 2 MiB).
    jobs += [MemoryJob("model", dp, s, "default") for dp, s in default_malloc]
    return jobs


def memory_runs(jobs: list[MemoryJob], model: dict, work: Path, cache: Path, timeout: float, progress) -> dict:
    counts = {"tied": parameter_counts(model), "untied": parameter_counts({**model, "tie_word_embeddings": False})}
    baselines, rows = {}, []
    for i, job in enumerate(jobs, 1):
        job_model = BASELINE_MODEL if job.kind == "baseline" else (
            {**model, "tie_word_embeddings": False} if job.variant == "untied" else model)
        run, ranks = zero_job(job.label, job.dp, job.stage, job_model, job.allocator, work, cache, timeout)
        row = {"kind": job.kind, "variant": job.variant, "dp": job.dp, "zero_stage": job.stage,
               "allocator": job.allocator, "returncode": run.rc, "wall_s": round(run.seconds, 1),
               "load_avg_before": round(run.load_before, 2)}
        head = f"[memory {i}/{len(jobs)}] dp{job.dp} {job.describe():<26} {job.allocator:<8}"
        if ranks is None:
            last = (run.log_tail.strip().splitlines() or [""])[-1][:160]
            progress(f"{head} FAILED (exit {run.rc}): {last}")
            rows.append({**row, "error": run.log_tail})
            continue
        peaks = [phase_mib(r, "peak") for r in ranks]
        progress(f"{head} peak RSS per rank {', '.join(f'{p:,.0f}' for p in peaks)} MiB  "
                 f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
        row.update(ranks=ranks, peak_mib_max_rank=max(peaks), meta_init=ranks[0].get("meta_init"))
        if job.kind == "baseline":
            baselines[(job.dp, job.allocator)] = ranks
            rows.append(row)
            continue
        c = counts["untied" if job.variant == "untied" else "tied"]
        row.update(parameters=c["total"])
        base = baselines.get((job.dp, job.allocator)) or baselines.get((job.dp, "mmap64k"))
        if base is not None:
            row["baseline_peak_mib_max_rank"] = max(phase_mib(b, "peak") for b in base)
            for phase in ("peak", "build", "train", "checkpoint"):
                diffs = [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(ranks, base)]
                row[f"{phase}_minus_baseline_mib"] = {"max": max(diffs), "min": min(diffs)}
        rows.append(row)
    mem = {"model": model, "parameters": counts["tied"], "parameters_untied": counts["untied"],
           "steps": MEMORY_STEPS, "seq_length": MEMORY_SEQ, "micro_batch_size": 1, "allocators": ALLOCATORS,
           "rows": rows}
    derive_memory_figures(mem)
    return mem


# ----------------------------------------------------------------------------- build memory: meta vs full init
def shard_divisor(layout) -> int:
    """n in the rough per-rank parameter share P / n: ZeRO shards the parameters over dp (every stage runs on
    FSDP2, whose parameters rest sharded; ZeRO off, i.e. DDP, replicates them), TP over tp, PP splits the
    blocks over pp stages."""
    return (layout.dp if layout.zero else 1) * layout.tp * layout.pp


def baseline_label(layout) -> str:
    return f"init-baseline-dp{layout.dp}-tp{layout.tp}-pp{layout.pp}"


def init_overrides(layout, meta_init: bool) -> list[str]:
    zero = [] if layout.zero is not None else ["train.zero_optimization.enabled=False"]
    return [*layout.overrides(), *zero, f"train.meta_init={meta_init}"]


def init_theory_mib(counts: dict, meta_init: bool, held_bytes: float) -> float:
    """What the build phase should hold: meta -- the rank's own parameters plus the largest module, filled in
    full before its shard is cut; full -- every parameter (4 B each in fp32) plus the largest module, since
    ``meta_init=False`` fills the full model through the same per-module initialiser (same weights)."""
    if meta_init:
        return (held_bytes + counts["largest_module_bytes"]) / MiB
    return (4.0 * counts["total"] + counts["largest_module_bytes"]) / MiB


def _spread(values: list[float]) -> dict:
    return {"max": max(values), "min": min(values), "per_rank": values}


def derive_init_row(row: dict, counts: dict, base: list[dict] | None) -> None:
    """The theory and the differences to the baseline, per rank, from the raw rank records."""
    ranks = row["ranks"]
    held = [r.get("held_parameter_bytes", 4.0 * counts["total"] / row["shard_divisor"]) for r in ranks]
    row["theory_build_mib"] = _spread([init_theory_mib(counts, row["meta_init"], h) for h in held])
    if base is None:
        return
    for phase in ("peak", "build", "train", "checkpoint"):
        row[f"{phase}_minus_baseline_mib"] = _spread(
            [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(ranks, base)])
    row["build_minus_theory_mib"] = _spread(
        [b - t for b, t in zip(row["build_minus_baseline_mib"]["per_rank"], row["theory_build_mib"]["per_rank"])])


def rederive_init(init: dict) -> None:
    """Recompute the derived numbers of a results file's build comparison (for ``--from-json``)."""
    base = {r["key"]: r.get("ranks") for r in init["rows"] if r["kind"] == "baseline"}
    for row in init["rows"]:
        if row["kind"] == "model" and row.get("ranks"):
            derive_init_row(row, init["parameters"], base.get(row.get("baseline")))


def init_runs(layouts: list, model: dict, work: Path, cache: Path, timeout: float, progress) -> dict:
    """Every layout twice, ``train.meta_init=True`` and ``False``, after a baseline of the same layout (a tiny
    model with as many layers as pipeline stages)."""
    counts = parameter_counts(model)
    baselines: dict[tuple, list[dict] | None] = {}
    rows = []
    n_jobs = len({(l.dp, l.tp, l.pp) for l in layouts}) + 2 * len(layouts)
    i = 0
    for layout in layouts:
        shape = (layout.dp, layout.tp, layout.pp)
        gb = layout.dp * layout.pp  # micro-batch 1; a pipeline needs pp micro-batches
        if shape not in baselines:
            i += 1
            label = baseline_label(layout)
            tiny = {**BASELINE_MODEL, "num_layers": max(BASELINE_MODEL["num_layers"], layout.pp)}
            run, ranks = worker_job(label, layout.nproc, gb, tiny, init_overrides(layout, True), "mmap64k", work,
                                    cache, timeout)
            baselines[shape] = ranks
            rows.append({"kind": "baseline", "key": label, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
                         "model": tiny, "returncode": run.rc, "wall_s": round(run.seconds, 1),
                         "load_avg_before": round(run.load_before, 2),
                         **({"ranks": ranks} if ranks else {"error": run.log_tail})})
            state = ("peak RSS per rank " + ", ".join(f"{phase_mib(r, 'peak'):,.0f}" for r in ranks) + " MiB"
                     if ranks else f"FAILED (exit {run.rc})")
            progress(f"[init {i}/{n_jobs}] {'baseline ' + label[14:]:<28} {state}  "
                     f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
        base = baselines[shape]
        for meta_init in (True, False):
            i += 1
            label = f"init-{layout.key}-{'meta' if meta_init else 'full'}"
            run, ranks = worker_job(label, layout.nproc, gb, model, init_overrides(layout, meta_init), "mmap64k",
                                    work, cache, timeout)
            row = {"kind": "model", "key": layout.key, "layout": layout.title, "dp": layout.dp, "tp": layout.tp,
                   "pp": layout.pp, "zero_stage": layout.zero, "nproc": layout.nproc, "meta_init": meta_init,
                   "returncode": run.rc, "wall_s": round(run.seconds, 1), "load_avg_before": round(run.load_before, 2),
                   "shard_divisor": shard_divisor(layout),
                   "baseline": baseline_label(layout)}
            head = f"[init {i}/{n_jobs}] {layout.title:<18} meta_init={str(meta_init):<5}"
            if ranks is None:
                last = (run.log_tail.strip().splitlines() or [""])[-1][:160]
                progress(f"{head} FAILED (exit {run.rc}): {last}")
                rows.append({**row, "error": run.log_tail})
                continue
            if any(r.get("meta_init") is not None and r["meta_init"] != meta_init for r in ranks):
                row["note"] = "the trainer reported a different meta_init than requested"
            row.update(ranks=ranks, peak_mib_max_rank=max(phase_mib(r, "peak") for r in ranks),
                       held_parameters=[r.get("held_parameters") for r in ranks])
            derive_init_row(row, counts, base)
            build = row.get("build_minus_baseline_mib")
            progress(f"{head} build - baseline {fmt(build and build['max'])} MiB (theory "
                     f"{row['theory_build_mib']['max']:,.0f}), peak RSS {row['peak_mib_max_rank']:,.0f} MiB  "
                     f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
            rows.append(row)
    return {"model": model, "parameters": counts, "steps": MEMORY_STEPS, "seq_length": MEMORY_SEQ,
            "micro_batch_size": 1, "allocator": "mmap64k", "rows": rows}


def prepare_data_cache(recipe: str = "gpt_debug") -> None:
    """Tokenize ``recipe``'s corpus into DUFU_CACHE_DIR once, here, so no measured run pays for (or holds memory of)
    it."""
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path(recipe)))
    tokenizer = instantiate(cfg.tokenization.tokenizer)
    node = cfg.dataloader.train
    node.tokenizer = tokenizer
    node.seq_length = MEMORY_SEQ
    instantiate(node)

