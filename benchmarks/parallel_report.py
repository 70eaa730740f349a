"""The report of ``benchmarks/parallel.py``: its tables (throughput, ZeRO memory, meta-device build) and the
observations computed from a run's numbers (nothing in them is a fixed claim).
"""

from __future__ import annotations

import os

from harness.machine import peaks_text
from harness.results import fmt, signed, table
from parallel_memory import MiB, working_set_bytes

CORES = os.cpu_count() or 1

NOTE = (
    "Absolute CPU numbers here only show that the machinery works and how memory scales with the layout: "
    f"{CORES} CPU cores are shared by up to 8 processes, so more processes never means more speed on this "
    "machine."
)


def throughput_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        if "median_tokens_per_s" not in r:
            body.append([r["layout"], str(r["nproc"]), str(r["threads_per_process"]), str(r["accumulation_steps"]),
                         "failed", "-", "-", "-", "-", fmt(r["wall_s"]), fmt(r["load_avg_before"], ".1f")])
            continue
        body.append([
            r["layout"], str(r["nproc"]), str(r["threads_per_process"]), str(r["accumulation_steps"]),
            fmt(r["median_tokens_per_s"]), fmt(r.get("speedup_vs_1proc"), ".2f") + "x",
            fmt(r["median_step_ms"]), f"{r['losses'][-1]:.4f}", fmt(r.get("max_abs_loss_diff_vs_1proc"), ".1e"),
            fmt(r["wall_s"]), fmt(r["load_avg_before"], ".1f"),
        ])
    return table(["layout", "procs", "threads/proc", "micro-batches/rank", "tokens/s (median)", "vs 1 process",
                  "ms/step", "last loss", "max abs loss diff vs 1 process", "wall s", "load avg at start"], body)


def _diff(r: dict, phase: str) -> str:
    d = r.get(f"{phase}_minus_baseline_mib")
    if d is None:
        return "-"
    return f"{d['max']:,.0f}" if abs(d["max"] - d["min"]) < 5 else f"{d['max']:,.0f} ({d['min']:,.0f})"


def _layout_name(r: dict) -> str:
    if r["dp"] == 1:
        return "1 process" + (", untied head" if r.get("variant") == "untied" else "")
    return f"dp{r['dp']} " + (f"ZeRO-{r['zero_stage']}" if r["zero_stage"] else "ZeRO off (DDP)")


def _model_rows(mem: dict, allocator: str) -> list[dict]:
    return [r for r in mem["rows"] if r["kind"] == "model" and r["allocator"] == allocator]


def _train_excess(r: dict) -> float | None:
    d = r.get("train_minus_baseline_mib")
    return None if d is None else d["max"] - r["dufu_estimate_mib"]


def _before_train(r: dict, before: dict | None) -> float | None:
    """The train-phase MiB above baseline of the same layout in an earlier results file (``--before``)."""
    if not before:
        return None
    for b in before.get("memory", {}).get("rows", []):
        if (b["kind"], b["dp"], b["zero_stage"], b.get("variant", ""), b["allocator"]) == (
                "model", r["dp"], r["zero_stage"], r.get("variant", ""), r["allocator"]):
            d = b.get("train_minus_baseline_mib")
            return None if d is None else d["max"]
    return None


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def memory_table(mem: dict, allocator: str, before: dict | None = None) -> list[str]:
    body = []
    for r in _model_rows(mem, allocator):
        if r.get("returncode") != 0:
            body.append([_layout_name(r), "failed"] + ["-"] * (14 if before else 13))
            continue
        train = r.get("train_minus_baseline_mib", {}).get("max")
        row = [_layout_name(r), f"{r['parameters'] / 1e6:.1f}M", fmt(r["theory_mib"]),
               fmt(r.get("zero_figure_mib")), fmt(r["dufu_estimate_mib"]), fmt(r["peak_mib_max_rank"]),
               fmt(r.get("baseline_peak_mib_max_rank")), _diff(r, "peak"), _diff(r, "build")]
        if before:
            row.append(fmt(_before_train(r, before)))
        row += [_diff(r, "train"), _ratio(train, r["theory_mib"]), _ratio(train, r.get("zero_figure_mib")),
                _ratio(train, r.get("zero_figure_activations_mib")), fmt(_train_excess(r), "+,.0f"),
                _diff(r, "checkpoint")]
        body.append(row)
    head = ["layout", "params", "ZeRO: model states", "ZeRO: + one unit's working set", "dufu mechanism estimate",
            "peak RSS", "baseline peak RSS", "peak - baseline", "build - baseline"]
    if before:
        head.append(f"train - baseline, before ({before['machine']['dufu_commit']})")
    head += ["train - baseline", "train / model states", "train / (model states + unit)",
             "train / (model states + unit + activations)", "train - baseline - estimate", "checkpoint - baseline"]
    return table(head, body)


def _span(d: dict | None, spec: str = ",.0f") -> str:
    """max over ranks, the min in parentheses where ranks differ by 5 MiB or more."""
    if d is None:
        return "-"
    return format(d["max"], spec) if abs(d["max"] - d["min"]) < 5 else f"{d['max']:{spec}} ({d['min']:{spec}})"


def init_pairs(init: dict) -> list[tuple[dict | None, dict | None]]:
    """(meta_init=True row, meta_init=False row) per layout, in run order."""
    keys = list(dict.fromkeys(r["key"] for r in init["rows"] if r["kind"] == "model"))
    pick = lambda k, m: next((r for r in init["rows"] if r["kind"] == "model" and r["key"] == k  # noqa: E731
                              and r["meta_init"] is m), None)
    return [(pick(k, True), pick(k, False)) for k in keys]


def _ok(r: dict | None) -> bool:
    return r is not None and "build_minus_baseline_mib" in r


def init_table(init: dict) -> list[str]:
    P = init["parameters"]["total"]
    body = []
    for meta, full in init_pairs(init):
        any_row = meta or full
        held = [h for h in (meta or {}).get("held_parameters", []) if h is not None]
        saved = None
        if _ok(meta) and _ok(full):
            saved = {k: full["build_minus_baseline_mib"][k] - meta["build_minus_baseline_mib"][k]
                     for k in ("max", "min")}
        body.append([
            any_row["layout"], str(any_row["nproc"]),
            (f"{max(held) / 1e6:.2f}M" + (f" ({min(held) / 1e6:.2f}M)" if max(held) - min(held) > 1e4 else "")
             if held else "-"),
            f"{P / any_row['shard_divisor'] / 1e6:.2f}M",
            _span(meta.get("theory_build_mib") if meta else None),
            _span(meta.get("build_minus_baseline_mib") if meta else None) if _ok(meta) else "failed",
            _span(full.get("theory_build_mib") if full else None),
            _span(full.get("build_minus_baseline_mib") if full else None) if _ok(full) else "failed",
            signed(saved["max"]) if saved else "-",
            _span(meta.get("peak_minus_baseline_mib") if meta else None),
            _span(full.get("peak_minus_baseline_mib") if full else None),
            _span(meta.get("train_minus_baseline_mib") if meta else None),
        ])
    return table(["layout", "procs", "parameters held per rank", "P / n", "theory, meta: 4 B x held + largest module",
                  "build - baseline, meta_init=True", "theory, full: 4 B x P + largest module", "build - baseline, meta_init=False",
                  "full - meta (build)", "peak - baseline, meta", "peak - baseline, full",
                  "train - baseline, meta"], body)


def allocator_table(mem: dict) -> list[str]:
    fixed = {(r["dp"], r["zero_stage"]): r for r in _model_rows(mem, "mmap64k") if r.get("returncode") == 0
             and not r.get("variant")}
    body = []
    for r in _model_rows(mem, "default"):
        if r.get("returncode") != 0:
            continue
        other = fixed.get((r["dp"], r["zero_stage"]), {})
        body.append([_layout_name(r), fmt(r["theory_mib"]), _diff(r, "train"), _diff(other, "train"),
                     fmt(r["peak_mib_max_rank"]), fmt(other.get("peak_mib_max_rank"))])
    return table(["layout", "theory", "train - baseline, default malloc", "train - baseline, mmap >= 64 KiB",
                  "peak RSS, default malloc", "peak RSS, mmap >= 64 KiB"], body)



def report(results: dict) -> str:
    info, lines = results["machine"], []
    lines += [f"# Parallel layouts - {results['date']}", "", f"> {NOTE}", ""]
    lines.append(f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB RAM; torch {info['torch']}, "
                 f"Python {info['python']}, {info['libc']}; {info['platform']}; dufu {info['dufu_commit']}"
                 + (f"; {peaks_text(info)}" if peaks_text(info) else "") + ". "
                 f"Load average {results['load_avg_start']} at the start, {results['load_avg_end']} at the end"
                 + (f" (above {info['cores']}: other work shared the cores)"
                    if max(results['load_avg_start'], results['load_avg_end']) > info['cores'] else "")
                 + f". Total time {results['total_s']:.0f} s, "
                 f"{results['cpu_s']:.0f} CPU seconds in all benchmark processes."
                 + (" Quick run." if results["quick"] else ""))
    if "throughput" in results:
        t = results["throughput_setup"]
        lines += ["", "## Throughput", "",
                  f"`gpt_debug` with {t['model']}, sequence {t['seq_length']}; global batch {t['global_batch_size']} "
                  f"sequences ({t['global_batch_size'] * t['seq_length']:,} tokens) = micro {t['micro_batch_size']} "
                  f"x dp x accumulation; fp32; {t['steps']} steps, median `tokens_per_s` of the steps after "
                  f"{t['warmup']} (from `metrics.jsonl`, `log_period=1`). "
                  "Pipeline layouts run the accumulation steps as 1F1B micro-batches.", ""]
        lines += throughput_table(results["throughput"])
    if "memory" in results:
        mem = results["memory"]
        c = mem["parameters"]
        lines += ["", "## Memory per rank, ZeRO stages", "",
                  f"`gpt_debug` with {mem['model']}: {c['total']:,} parameters ({c['per_block']:,} per block; "
                  f"FSDP units besides the blocks: embedding tables {c.get('embedding_unit', c['root']):,}, final "
                  f"norm + head {c.get('head_unit', c['root']):,}, the head tied to the embedding); {mem['steps']} steps, "
                  f"micro-batch {mem['micro_batch_size']} x sequence {mem['seq_length']}, fp32, AdamW. All values "
                  "MiB per rank, the largest rank; where ranks differ by 5 MiB or more, the smallest follows in "
                  "parentheses. Peak RSS is measured per worker process (a hook of the trainer, "
                  "`benchmarks/harness/memory.py`); baseline = the same layout with a 1-layer, hidden-64 model "
                  "(Python, torch, gloo, data). Phases: build = the process up to the training loop (data, "
                  f"{_build_how(mem)}, process group, sharding), train = the steps, checkpoint = the final save.",
                  "",
                  "*ZeRO: model states* = the ZeRO paper's model states (Rajbhandari et al. 2020): 4 B parameters "
                  "+ 4 B gradients + 8 B AdamW moments per parameter; ZeRO-1 shards the moments over dp, ZeRO-2 "
                  "also the gradients, ZeRO-3 also the parameters. *+ one unit's working set* = that + what a "
                  "rank holds beyond its shards while one FSDP unit is in backward (the paper's temporary "
                  "buffers): a block's gathered parameters, its full-size gradient and the next block gathered "
                  f"ahead (12 B x {c['per_block']:,} parameters), or at the end the embedding's full-size "
                  "gradient and its reduce-scatter buffer (8 B per parameter), whichever is larger: "
                  f"{working_set_bytes(c) / MiB:,.0f} MiB. *dufu mechanism estimate* = ZeRO off (`replicate`): "
                  "16 B/param; ZeRO-3: the ZeRO figure + the tied head's sharded copy of the embedding "
                  f"({c.get('tied_copy', 0):,} parameters, 4/dp B each); ZeRO-1 and ZeRO-2 (one mechanism, "
                  "stage 1 with stage-2 sharding; blocks and root units): the larger of the ZeRO figure and the "
                  "start of backward, 12/dp B/param of shards + every block and the root (embeddings, head, "
                  "final norm) gathered + the head's full gradient (4 B each). Activations (micro-batch 1 x 64 tokens: about 3 MiB per block) are not in these figures "
                  "and appear in the last column. *+ activations* = the model states + one unit's working set + "
                  "the activations as the 1-process run measures them (its training peak above baseline minus "
                  "its model states" + (f": {mem['activations_mib']:,.0f} MiB" if mem.get("activations_mib")
                                         is not None else "") + ").", "",
                  "### glibc malloc with `MALLOC_MMAP_THRESHOLD_=65536` (RSS follows live tensors)", ""]
        lines += memory_table(mem, "mmap64k", results.get("before"))
        if _model_rows(mem, "default"):
            lines += ["", "### The same layouts with glibc's default malloc", ""]
            lines += allocator_table(mem)
    if "init" in results:
        init = results["init"]
        c = init["parameters"]
        lines += ["", "## Build memory per rank: meta-device initialisation vs the full model first", "",
                  f"The memory model again (`gpt_debug` with {init['model']}: P = {c['total']:,} parameters, "
                  f"4 B x P = {4 * c['total'] / MiB:,.0f} MiB in fp32), {init['steps']} steps, micro-batch "
                  f"{init['micro_batch_size']} (pp micro-batches per step under pipeline parallelism), glibc malloc "
                  "with `MALLOC_MMAP_THRESHOLD_=65536`, each layout run twice: `train.meta_init=True` (the default: "
                  "build on the meta device, split, shard, then allocate and initialise only the rank's shards, "
                  "`dufu/parallel/materialize.py`) and `train.meta_init=False` (the full fp32 model built and "
                  "initialised on every rank, then split and sharded). Baseline = the same layout with a tiny "
                  "model (1 layer, or as many as pipeline stages; hidden 64). MiB per rank, the largest rank; "
                  "where ranks differ by 5 MiB or more, the smallest follows in parentheses.", "",
                  "*parameters held per rank* = counted in each worker after the build (local shards of DTensors, "
                  "a tied tensor once; a last pipeline stage holds its own copy of a tied embedding); *P / n* = "
                  "the simple share, n = dp under ZeRO, x tp, x pp. *theory, meta* = 4 B x the parameters the rank "
                  f"holds + the largest single module filled in full before its shard is cut (`{c['largest_module']}`"
                  f", {c['largest_module_bytes'] / MiB:,.0f} MiB); *theory, full* = 4 B x P, the whole model on "
                  "every rank, + the same largest module (`meta_init=False` fills the full model through the "
                  "same per-module initialiser, so both give the same weights). *full - meta* = what building on the meta device saves in the build phase. "
                  "*peak* = the whole run's peak (build, train, checkpoint).", ""]
        lines += init_table(init)
    if results.get("observations"):
        lines += ["", "## Observations", ""] + [f"* {o}" for o in results["observations"]]
    return "\n".join(lines) + "\n"


def _build_how(mem: dict) -> str:
    flags = {r.get("meta_init") for r in mem["rows"] if r["kind"] == "model" and r.get("returncode") == 0}
    if flags == {True}:
        return "the model built on the meta device, each rank allocating its own shards (`train.meta_init=True`)"
    if flags == {False}:
        return "the full model on every rank (`train.meta_init=False`)"
    return "the full model on every rank"  # results from before the meta-device build recorded the flag


def observations(results: dict) -> list[str]:
    """Statements computed from this run's numbers (nothing here is a fixed claim)."""
    return run_observations(results) + init_observations(results.get("init"))


def run_observations(results: dict) -> list[str]:
    """Throughput and ZeRO memory."""
    obs = []
    rows = results.get("throughput", [])
    ok = [r for r in rows if "median_tokens_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["median_tokens_per_s"])
        worst = min(ok, key=lambda r: r["median_tokens_per_s"])
        loads = [r["load_avg_before"] for r in rows]
        cores = results["machine"]["cores"]
        obs.append(f"Throughput: fastest {best['layout']} ({best['median_tokens_per_s']:,.0f} tokens/s), slowest "
                   f"{worst['layout']} ({worst['median_tokens_per_s']:,.0f}). {cores} cores, 1 thread per process: "
                   f"up to {cores} processes add cores, more only add communication and time-slicing."
                   + (f" Other jobs kept the load average at {min(loads):.1f}-{max(loads):.1f} during these runs "
                      f"(on {cores} cores), so the rates carry their noise: only large gaps between layouts mean "
                      "anything." if max(loads) > cores else ""))
        tp = [r for r in ok if r["tp"] > 1]
        rest = [r for r in ok if r["tp"] == 1]
        if tp and rest:
            obs.append(
                f"Tensor-parallel layouts take {min(r['median_step_ms'] for r in tp):,.0f}-"
                f"{max(r['median_step_ms'] for r in tp):,.0f} ms per step, the others "
                f"{min(r['median_step_ms'] for r in rest):,.0f}-{max(r['median_step_ms'] for r in rest):,.0f}: "
                "TP exchanges activations inside every layer (forward and backward, every micro-batch), and on a "
                "model 128 wide those small collectives cost more than the matmuls they split. DP and PP "
                "communicate once per step or once per micro-batch and stage.")
        diffs = [r["max_abs_loss_diff_vs_1proc"] for r in ok if r.get("max_abs_loss_diff_vs_1proc") is not None]
        if diffs:
            obs.append(f"Every layout's logged losses match the 1-process run to {max(diffs):.1e} or better (fp32), "
                       "so all layouts train the same model on the same samples.")
    failed = [r["layout"] for r in rows if "median_tokens_per_s" not in r]
    if failed:
        obs.append(f"Failed layouts: {', '.join(failed)} (the JSON file holds the log tail).")
    mem = results.get("memory")
    if not mem:
        return obs
    fixed = {(r["dp"], r["zero_stage"], r.get("variant", "")): r for r in _model_rows(mem, "mmap64k")
             if "train_minus_baseline_mib" in r}
    train = {k: r["train_minus_baseline_mib"]["max"] for k, r in fixed.items()}
    full_mib = 4.0 * mem["parameters"]["total"] / MiB
    pairs = [f"dp{dp} {train[(dp, 1, '')]:,.0f} and {train[(dp, 2, '')]:,.0f}" for dp in sorted({k[0] for k in train})
             if (dp, 1, "") in train and (dp, 2, "") in train]
    if pairs:
        obs.append(f"ZeRO-1 and ZeRO-2 measure the same ({'; '.join(pairs)} MiB in training): one mechanism "
                   "(FSDP2 always reduce-scatters gradients; stage 1 runs with stage-2 sharding, as "
                   "`dufu/parallel/data_parallel.py` says), below the paper's ZeRO-1 figure, above its ZeRO-2 "
                   "figure: the blocks' gathered parameters stay from forward until their backward.")
    z3 = [(dp, fixed[(dp, 3, "")]) for dp in sorted({k[0] for k in fixed}) if (dp, 3, "") in fixed]
    if z3:
        obs.append("ZeRO-3 training peak above baseline: " + "; ".join(
            f"dp{dp} {train[(dp, 3, '')]:,.0f} MiB = {train[(dp, 3, '')] / r['theory_mib']:.2f}x the model states "
            f"({r['theory_mib']:,.0f}), {train[(dp, 3, '')] / r['zero_figure_mib']:.2f}x the model states + one "
            f"unit's working set ({r['zero_figure_mib']:,.0f})"
            + (f", {train[(dp, 3, '')] / r['zero_figure_activations_mib']:.2f}x that + the activations "
               f"({r['zero_figure_activations_mib']:,.0f})" if r.get("zero_figure_activations_mib") else "")
            + f", {train[(dp, 3, '')] - r['dufu_estimate_mib']:+,.0f} "
            f"MiB from the mechanism estimate ({r['dufu_estimate_mib']:,.0f})" for dp, r in z3) + ".")
        if mem.get("activations_mib") is not None:
            obs.append(f"Activations: the 1-process run holds {mem['activations_mib']:,.0f} MiB above its model "
                       "states at its training peak (saved activations of micro-batch 1, the fp32 logits); every "
                       "dp rank holds as much, whatever the ZeRO stage, so a figure of model states alone cannot "
                       "be met as dp grows (at dp 8 they would be half of a rank's model states here). The "
                       "ratio to model states + unit + activations is the one that stays meaningful.")
    before = results.get("before")
    if before:
        changes = []
        for k, r in fixed.items():
            b = _before_train(r, before)
            if b is not None and k[1]:
                changes.append(f"{_layout_name(r)} {b:,.0f} -> {train[k]:,.0f}")
        if changes:
            obs.append(f"Train phase above baseline, before ({before['machine']['dufu_commit']}, run "
                       f"{before.get('date', '?')} on {before['machine']['cpu']}) -> now: " + "; ".join(changes)
                       + " MiB.")
    drops = []
    for stage in (0, 1, 2, 3):
        if (2, stage, "") in train and (4, stage, "") in train:
            got = train[(2, stage, "")] - train[(4, stage, "")]
            want = fixed[(2, stage, "")]["dufu_estimate_mib"] - fixed[(4, stage, "")]["dufu_estimate_mib"]
            got = 0.0 if abs(got) < 0.5 else got
            drops.append(f"{'ZeRO-' + str(stage) if stage else 'ZeRO off'} {got:,.0f} (estimate {want:,.0f})")
    if drops:
        obs.append("The part that depends on dp follows the estimate: train-phase memory falls from dp2 to dp4 by "
                   + ", ".join(drops) + " MiB.")
    for r in _model_rows(mem, "mmap64k"):
        if r.get("rerun"):
            obs.append(f"{_layout_name(r)}: {r['rerun']}.")
    excess = {k: _train_excess(r) for k, r in fixed.items()}
    zero_excess = [v for k, v in excess.items() if k[0] > 1 and k[1] and v is not None]
    if (1, 0, "") in excess and (1, 0, "untied") in excess:
        obs.append(
            f"Above the estimate: one process holds {excess[(1, 0, '')]:+,.0f} MiB with the tied embedding/head "
            f"and {excess[(1, 0, 'untied')]:+,.0f} MiB untied. The tied weight's two gradients (embedding and "
            f"head, {4 * mem['parameters'].get('tied_copy', 0) / MiB:,.0f} MiB each) are alive together while "
            "autograd sums them: transient gradient memory, not a leak.")
    if zero_excess:
        obs.append(f"The ZeRO layouts measure {min(zero_excess):+,.0f} to {max(zero_excess):+,.0f} MiB from their "
                   "mechanism estimates (gloo's staging buffers, autograd's saved activations and allocator "
                   "rounding are not in the estimate).")
    builds = {k: r["build_minus_baseline_mib"]["max"] for k, r in fixed.items() if r["dp"] > 1}
    if builds:
        name = lambda k: f"dp{k[0]} " + (f"ZeRO-{k[1]}" if k[1] else "ZeRO off")  # noqa: E731
        share = max(((builds[k] / train[k], k) for k in builds if train.get(k, 0) > 0), default=None)
        obs.append("Build phase above baseline: " + ", ".join(f"{name(k)} {v:,.0f}" for k, v in builds.items())
                   + f" MiB, with {_build_how(mem)}; every parameter in fp32 is {full_mib:,.0f} MiB."
                   + (f" The largest share of the training phase is {100 * share[0]:.0f}% ({name(share[1])})."
                      if share else ""))
    ck = [r["checkpoint_minus_baseline_mib"]["max"] - train[k] for k, r in fixed.items()]
    if ck:
        obs.append(f"The final checkpoint save stays {-max(ck):,.0f} MiB or more below the training peak in "
                   "every layout (no gathering of full tensors).")
    for r in _model_rows(mem, "default"):
        other = fixed.get((r["dp"], r["zero_stage"], ""))
        if "train_minus_baseline_mib" in r and other:
            a, b = r["train_minus_baseline_mib"]["max"], train[(r["dp"], r["zero_stage"], "")]
            obs.append(f"Default malloc, {_layout_name(r)}: {a:,.0f} MiB above baseline in training vs {b:,.0f} "
                       f"with the fixed mmap threshold ({a / b:.1f}x): freed tensor memory stays in the process's "
                       "heap (the amount varies from run to run).")
    return obs


def init_observations(init: dict | None) -> list[str]:
    """The meta-device build against the full model first, from this run's numbers."""
    if not init:
        return []
    obs = []
    c = init["parameters"]
    full_mib, largest_mib = 4.0 * c["total"] / MiB, c["largest_module_bytes"] / MiB
    failed = [r.get("layout") or r["key"] for r in init["rows"] if r.get("returncode") != 0]
    if failed:
        obs.append(f"Build comparison, failed runs: {', '.join(failed)} (the JSON file holds the log tail).")
    pairs = [(m, f) for m, f in init_pairs(init) if _ok(m) and _ok(f)]
    if not pairs:
        return obs
    b = lambda r, ph="build": r[f"{ph}_minus_baseline_mib"]["max"]  # noqa: E731
    obs.append("Build phase above baseline (largest rank), meta_init=True vs False: "
               + "; ".join(f"{m['layout']} {b(m):,.0f} vs {b(f):,.0f}" for m, f in pairs) + " MiB.")
    noise = 4.0  # MiB: repeated runs of one layout differ by about 1-2 MiB here
    saving = lambda m, f: b(f) - b(m)  # noqa: E731
    predicted = lambda m, f: f["theory_build_mib"]["max"] - m["theory_build_mib"]["max"]  # noqa: E731
    as_predicted = [(m, f) for m, f in pairs if predicted(m, f) > noise and saving(m, f) >= 0.5 * predicted(m, f)]
    short = [(m, f) for m, f in pairs if predicted(m, f) > noise and saving(m, f) < 0.5 * predicted(m, f)]
    controls = [(m, f) for m, f in pairs if predicted(m, f) <= noise]
    if as_predicted:
        obs.append("The meta-device build lowers the build phase where a rank holds part of the parameters: "
                   + "; ".join(f"{m['layout']} by {saving(m, f):,.0f} MiB (theory {predicted(m, f):,.0f}; "
                               f"{100 * saving(m, f) / b(f):.0f}% of the full build)" for m, f in as_predicted)
                   + ".")
    if short:
        obs.append("The meta-device build saves less than half of what the theory says in "
                   + "; ".join(f"{m['layout']} ({saving(m, f):+,.0f} MiB, theory {predicted(m, f):,.0f})"
                               for m, f in short)
                   + ": something there allocates more than the rank's shards during the build.")
    if controls:
        obs.append(f"Where a rank holds every parameter ({', '.join(m['layout'] for m, f in controls)}) the theory "
                   "predicts no saving; full - meta measures "
                   + ", ".join(f"{signed(saving(m, f))}" for m, f in controls) + " MiB"
                   + (f": within {noise:,.0f} MiB, the same." if all(abs(saving(m, f)) <= noise for m, f in controls)
                      else "."))
    for meta_init, label, what in ((True, "meta_init=True", "4 B x held + largest module"),
                                   (False, "meta_init=False", "4 B x P + largest module")):
        rows = [m if meta_init else f for m, f in pairs]
        ex = [(r["build_minus_theory_mib"]["max"], r["build_minus_theory_mib"]["min"], r) for r in rows]
        lo, hi = min(e[1] for e in ex), max(e[0] for e in ex)
        span = signed(hi) if round(lo) == round(hi) else f"{signed(lo)} to {signed(hi)}"
        text = f"{label}: the build phase is {span} MiB from the theory ({what}) on every rank"
        over = [(e[0], e[2]) for e in ex if e[0] > largest_mib]
        if over:
            details = []
            for extra, r in over:
                ratio = r["build_minus_baseline_mib"]["max"] / full_mib
                why = ""
                if not meta_init and r["pp"] > 1:
                    why = (": the trainer cuts each stage from a deep copy of the full model "
                           "(`build_stage_module`) while the full model is still alive, so for a moment a rank "
                           "holds two full copies")
                elif not meta_init and r["tp"] > 1:
                    why = (f": the TP shards are cut while the full tensors are still alive (up to 4 B x P x "
                           f"(1 + 1/tp) = {full_mib * (1 + 1 / r['tp']):,.0f} MiB)")
                details.append(f"{r['layout']} {signed(extra)} MiB ({ratio:.2f} x 4 B x P){why}")
            text += f"; more than one largest module ({largest_mib:,.0f} MiB) above it in " + "; ".join(details)
        if meta_init:
            # distribute_tensor cuts the rank's piece of each full tensor as a new tensor before copying it in.
            cut = [(e[0], largest_mib / e[2]["shard_divisor"], e[2]) for e in ex
                   if e[2]["shard_divisor"] > 1 and e[0] > noise]
            if cut and all(abs(x - want) <= noise / 2 for x, want, _ in cut):
                text += ("; the excess in " + ", ".join(f"{r['layout']} ({signed(x)})" for x, _, r in cut)
                         + " matches one shard of the largest module ("
                         + ", ".join(f"{want:,.0f}" for _, want, _ in cut) + " MiB), the piece `distribute_tensor` "
                         "cuts from the full value before it is copied into the parameter")
        obs.append(text + ".")
    sets = {flag: [] for flag in (True, False)}
    for m, f in pairs:
        for r in (m, f):
            if b(r) >= max(b(r, "train"), b(r, "checkpoint")) - 1.0:
                sets[r["meta_init"]].append(r["layout"])
    obs.append("Whole-run peak above baseline, meta_init=True vs False: "
               + "; ".join(f"{m['layout']} {b(m, 'peak'):,.0f} vs {b(f, 'peak'):,.0f}" for m, f in pairs)
               + " MiB. The build phase sets the run's peak "
               + (f"with meta_init=False in {', '.join(sets[False])}" if sets[False] else
                  "in no layout with meta_init=False")
               + (f", with meta_init=True in {', '.join(sets[True])}." if sets[True] else
                  ", and in none with meta_init=True."))
    return obs

