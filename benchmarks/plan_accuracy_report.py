"""The verdicts and the report of ``benchmarks/plan_accuracy.py``: each layout's prediction against its measurement
(predicted / measured, within 10% for memory and 25% for step time), the summary, the table, the observations and
the plot (predicted vs measured per layout).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from harness.results import fmt, table
from parallel_memory import MiB

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.25


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured or measured <= 0:
        return None
    return predicted / measured


def compare(rows: list[dict], predictions: dict | None, cores: int) -> list[dict]:
    """Per layout: measured and predicted memory (MiB) and step time (s), predicted / measured, within tolerance;
    ``cores``: the CPU cores of the machine that measured (processes per core)."""
    out = []
    for r in rows:
        p = (predictions or {}).get(r["key"], {})
        mem = (r.get("peak_minus_baseline_mib") or {}).get("max")
        t = r["run"].get("median_step_time_s") if "peak_minus_baseline_mib" in r else None
        pmem = p["memory_per_gpu_bytes"] / MiB if "memory_per_gpu_bytes" in p else None
        pt = p.get("step_time_s")
        mr, tr = _ratio(pmem, mem), _ratio(pt, t)
        out.append({
            "key": r["key"], "layout": r["layout"], "nproc": r["nproc"], "processes_per_core": r["nproc"] / cores,
            "measured_memory_mib": mem, "predicted_memory_mib": pmem, "memory_ratio": mr,
            "memory_within": None if mr is None else abs(mr - 1) <= MEMORY_TOLERANCE,
            "measured_step_time_s": t, "predicted_step_time_s": pt, "time_ratio": tr,
            "time_within": None if tr is None else abs(tr - 1) <= TIME_TOLERANCE,
            "prediction_error": p.get("error"),
        })
    return out


def summary(comparison: list[dict]) -> dict:
    """How many layouts are within tolerance, of those with both a measurement and a prediction."""
    def count(what: str, tol: float, label: str) -> dict:
        judged = [c for c in comparison if c[f"{what}_within"] is not None]
        n = sum(c[f"{what}_within"] for c in judged)
        return {"within": n, "compared": len(judged), "tolerance": tol,
                "line": f"{label}: {n} of {len(judged)} within {100 * tol:.0f}%"}
    return {"memory": count("memory", MEMORY_TOLERANCE, "Peak memory per rank"),
            "time": count("time", TIME_TOLERANCE, "Step time")}


# ----------------------------------------------------------------------------- reporting
def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f} ({100 * (ratio - 1):+.0f}%)"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def _span(d: dict | None) -> str:
    """max over ranks, the min in parentheses where ranks differ by 5 MiB or more."""
    if d is None:
        return "-"
    return f"{d['max']:,.0f}" if d["max"] - d["min"] < 5 else f"{d['max']:,.0f} ({d['min']:,.0f})"


def comparison_table(results: dict) -> list[str]:
    rows = {r["key"]: r for r in results["measured"]["rows"]}
    body = []
    for c in results["comparison"]:
        r = rows[c["key"]]
        failed = "peak_minus_baseline_mib" not in r
        ms = lambda s: fmt(s and 1000 * s)  # noqa: E731
        body.append([
            c["layout"], str(c["nproc"]), f"{c['processes_per_core']:g}",
            "failed" if failed else _span(r["peak_minus_baseline_mib"]), fmt(c["predicted_memory_mib"]),
            _pct(c["memory_ratio"]), _verdict(c["memory_within"]),
            "failed" if failed else ms(c["measured_step_time_s"]), ms(c["predicted_step_time_s"]),
            _pct(c["time_ratio"]), _verdict(c["time_within"]),
            _span(r.get("train_minus_baseline_mib")), fmt(r["baseline"].get("peak_mib") and max(r["baseline"]["peak_mib"])),
            fmt(r["run"]["load_avg_before"], ".1f"),
        ])
    return table(["layout", "procs", "procs / core", "measured MiB (peak - baseline)", "predicted MiB",
                  "predicted / measured", "within 10%", "measured ms/step", "predicted ms/step",
                  "predicted / measured", "within 25%", "train phase - baseline MiB", "baseline peak RSS MiB",
                  "load avg at start"], body)


def observations(results: dict) -> list[str]:
    obs = list(results.get("notes", []))
    m = results["measured"]
    failed = [r["layout"] for r in m["rows"] if "peak_minus_baseline_mib" not in r]
    if failed:
        obs.append(f"Failed runs: {', '.join(failed)} (the JSON file holds the log tail).")
    diffs = [r["max_abs_loss_diff_vs_1proc"] for r in m["rows"] if "max_abs_loss_diff_vs_1proc" in r]
    if diffs:
        obs.append(f"The fp32 layouts log the same losses as the 1-process run to within {max(diffs):.1e} (largest "
                   "absolute difference): every layout trains the same model on the same samples.")
    by_nproc: dict[int, list[float]] = {}
    for r in m["rows"]:
        t = r["run"].get("median_step_time_s")
        if t and r["dtype"] == "fp32" and not r["activation_checkpoint"]:
            by_nproc.setdefault(r["nproc"], []).append(t)
    if by_nproc:
        obs.append("Measured fp32 step time by process count (median over layouts): "
                   + ", ".join(f"{n} proc {1000 * statistics.median(v):,.0f} ms" for n, v in sorted(by_nproc.items()))
                   + f"; {results['machine']['logical_cpus']} cores: more processes than cores share them.")
    planner = results.get("planner") or {}
    if planner.get("available"):
        errors = [c for c in results["comparison"] if c["prediction_error"]]
        if errors:
            obs.append("The planner raised for " + "; ".join(f"{c['layout']}: {c['prediction_error'][:200]}"
                                                              for c in errors) + ".")
        for what, label in (("memory", "memory"), ("time", "step time")):
            ratios = [c[f"{what}_ratio"] for c in results["comparison"] if c[f"{what}_ratio"] is not None]
            if ratios:
                worst = max(results["comparison"], key=lambda c: abs((c[f"{what}_ratio"] or 1) - 1))
                obs.append(f"Predicted / measured {label}: {min(ratios):.2f} to {max(ratios):.2f} "
                           f"(median {statistics.median(ratios):.2f}); furthest off: {worst['layout']} "
                           f"({worst[f'{what}_ratio']:.2f}).")
    return obs


def model_title(m: dict) -> str:
    """"gpt-16x256 (held out)", "gpt-8x512 (calibration model)"; "" for a measurement that names no model."""
    if not m.get("name"):
        return ""
    return f"{m['name']} ({'held out' if m.get('held_out') else 'calibration model'})"


def sample_text(m: dict) -> str:
    """Whether the measured model was used to set the CPU cost model's constants ("" when the results do not
    say: they predate held-out models)."""
    if "held_out" not in m:
        return ""
    if m["held_out"]:
        return (f"**Held out**: {m['about']}. This model was **not** used to set any constant of the CPU cost model "
                "(`dufu/plan/cpu.py`: `_DTENSOR_OP_FACTOR`, the calibration step's model, a 2-layer GPT 512 wide); "
                "those were set on the calibration model, `gpt_debug` 8 layers deep and 512 wide "
                "(`python benchmarks/plan_accuracy.py`), so this table tests the model out of sample.")
    return (f"**Calibration model**: {m['about']}. The CPU cost model's constants were set on it, so this table "
            "is in sample; `--model held-out` measures models that were not used to set them.")


def report(results: dict) -> str:
    info, m = results["machine"], results["measured"]
    title = model_title(m)
    lines = [f"# Planner accuracy - {title + ' - ' if title else ''}{results['date']}", ""]
    if sample_text(m):
        lines += [sample_text(m), ""]
    # The load average counts the measured runs' own processes (up to 4 here), so it cannot say whether other
    # work ran; the CPU time of everything else on the machine can.
    load = (f"Load average {results['load_avg_start']:.2f} at the start, {results['load_avg_end']:.2f} at the end "
            "(the runs' own processes included).")
    others = results.get("other_cpu_s")
    if others is not None:
        share = others / (results["measure_s"] * info["logical_cpus"])
        load += (f" Other processes used {others:,.0f} CPU seconds meanwhile, {100 * share:.0f}% of the cores"
                 + (": the step times are slower than on an idle machine." if share > 0.05 else "."))
    lines.append(f"Machine: {info['cpu']}, {info['logical_cpus']} cores, {info.get('memory_gib')} GiB RAM; torch "
                 f"{info['torch']}, Python {info['python']}, {info.get('libc', '')}; dufu {info.get('dufu_commit')}. "
                 f"Measuring took {results['measure_s']:.0f} s, {results['cpu_s']:.0f} CPU seconds in the runs. {load}")
    lines.append("")
    lines.append(
        f"`{m['config']}` with {m['model']}: {m['parameters']:,} parameters; AdamW, no compile; global batch "
        f"{m['global_batch_size']} sequences x {m['seq_length']} tokens, micro-batch {m['micro_batch_size']}; "
        f"{m['steps']} steps, the first {m['warmup']} left out of the step time; one thread per process, "
        f"`MALLOC_MMAP_THRESHOLD_=65536`. Measured memory: per rank, the whole run's peak RSS minus the same rank's "
        f"peak in a baseline run (the same command with a {m['baseline_model']['num_layers']}-layer, hidden-"
        f"{m['baseline_model']['hidden_size']} model, one layer per pipeline stage), the largest rank (the "
        "smallest in parentheses where ranks differ by 5 MiB or more). Measured step time: median `step_time_s` of "
        "the logged steps after warm-up. Predicted: `dufu.plan.estimate(cfg, world_size=N, hardware=\"cpu\")` on "
        f"the run's config: `memory_per_gpu_bytes`, `step_time_s`. {info['logical_cpus']} cores are shared by the "
        "processes of a layout (procs / core).")
    lines.append("")
    planner = results.get("planner") or {}
    if planner.get("available"):
        probe = planner.get("cpu_probe")
        probe_text = (f" CPU figures: {probe['source']}; one-thread calibration step {probe['calibration_1_thread_s']:.4f} s, "
                      f"{probe['op_overhead_us']} us per op, gloo {probe['gloo_bandwidth_gbs']} GB/s and "
                      f"{probe['gloo_latency_us']} us, new memory {probe['page_fault_gbs']} GB/s." if probe else "")
        lines += [f"Predictions made {planner.get('predicted_at', '?')} with dufu {planner.get('dufu_commit', '?')}."
                  + probe_text,
                  ""]
    else:
        lines += [f"**No predictions**: `dufu.plan` could not be imported ({planner.get('error', 'not run')}); "
                  "measured columns only (`python benchmarks/plan_accuracy.py --only compare` adds them).", ""]
    lines += comparison_table(results)
    lines.append("")
    if planner.get("available"):
        s = results["summary"]
        lines += [f"**{s['memory']['line']}**; **{s['time']['line']}**.", ""]
    obs = observations(results)
    if obs:
        lines += ["## Observations", ""] + [f"* {o}" for o in obs] + [""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Predicted vs measured per layout (memory, step time), the tolerance band shaded; measured bars alone when
    there are no predictions. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    comp = results["comparison"]
    panels = [("memory", "peak memory per rank above baseline (MiB)", 1.0, MEMORY_TOLERANCE),
              ("step_time", "step time (ms)", 1000.0, TIME_TOLERANCE)]
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    for ax, (what, label, scale, tol) in zip(axes, panels):
        ratio_key = "memory" if what == "memory" else "time"
        pts = [(c["key"], c[f"measured_{what}" + ("_mib" if what == "memory" else "_s")],
                c[f"predicted_{what}" + ("_mib" if what == "memory" else "_s")], c[f"{ratio_key}_within"])
               for c in comp]
        have = [(k, m * scale, p * scale, ok) for k, m, p, ok in pts if m is not None and p is not None]
        if have:
            lo = min(min(m, p) for _, m, p, _ in have) * 0.8
            hi = max(max(m, p) for _, m, p, _ in have) * 1.2
            xs = [lo, hi]
            ax.plot(xs, xs, color="black", lw=1)
            ax.fill_between(xs, [x * (1 - tol) for x in xs], [x * (1 + tol) for x in xs], color="tab:green",
                            alpha=0.15, label=f"within {100 * tol:.0f}%")
            spots: dict[tuple, list] = {}  # layouts within ~2% of each other in both axes share one label
            for k, m, p, ok in have:
                spots.setdefault((round(50 * math.log(m)), round(50 * math.log(p)), ok), []).append((k, m, p))
            for i, ((_, _, ok), group) in enumerate(sorted(spots.items(), key=lambda s: s[1][0][1])):
                m, p = group[0][1], group[0][2]
                ax.scatter([m], [p], color="tab:green" if ok else "tab:red", zorder=3)
                # neighbours along x alternate above and below their point, so labels overlap less
                ax.annotate(", ".join(k for k, _, _ in group), (m, p), textcoords="offset points",
                            xytext=(5, 4 if i % 2 == 0 else -11), fontsize=7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, minor ticks at 2, 3, 5 x 10^k
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
                axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if f"{v:.0e}"[0] in "1235" else ""))
            ax.tick_params(axis="both", which="minor", labelsize=7)
            ax.set_xlabel(f"measured {label}")
            ax.set_ylabel(f"predicted {label}")
            ax.legend(loc="upper left")
            missing = [k for k, m, p, _ in pts if m is not None and p is None]
            if missing:
                ax.set_title("no prediction: " + ", ".join(missing), fontsize=8)
        else:
            meas = [(k, m * scale) for k, m, _, _ in pts if m is not None]
            ax.barh([k for k, _ in meas], [m for _, m in meas], color="tab:blue")
            ax.invert_yaxis()
            ax.set_xlabel(f"measured {label}")
            ax.set_title("no predictions", fontsize=9)
    info = results["machine"]
    m = results["measured"]
    fig.suptitle(f"dufu plan vs measured, {model_title(m) or 'GPT'}, {m['parameters'] / 1e6:.1f}M parameters, "
                 f"{info['logical_cpus']} CPU cores, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- several models
def model_summary(results: dict, file: str) -> dict:
    """One model's line of :func:`models_report`: its verdict counts, ratio ranges and furthest-off layouts."""
    m, comp = results["measured"], results["comparison"]
    out = {"name": m.get("name"), "held_out": m.get("held_out"), "about": m.get("about"), "config": m["config"],
           "model": m["model"], "parameters": m["parameters"], "layouts": len(comp), "file": file,
           "date": results["date"], "other_cpu_s": results.get("other_cpu_s"), "summary": results["summary"]}
    for what in ("memory", "time"):
        judged = [c for c in comp if c[f"{what}_ratio"] is not None]
        ratios = [c[f"{what}_ratio"] for c in judged]
        worst = max(judged, key=lambda c: abs(c[f"{what}_ratio"] - 1)) if judged else None
        out[what] = {"min": min(ratios, default=None), "max": max(ratios, default=None),
                     "median": statistics.median(ratios) if ratios else None,
                     "furthest": worst and {"layout": worst["layout"], "ratio": worst[f"{what}_ratio"]}}
    return out


def models_report(entries: list[tuple[dict, str]]) -> tuple[dict, str]:
    """(JSON, Markdown) of several models' results, one line each; ``entries``: (results, file stem). Titled out
    of sample when a held-out model is among them."""
    lines_ = [model_summary(r, name) for r, name in entries]
    held_out = any(x["held_out"] for x in lines_)
    first = entries[0][0]
    info = first["machine"]
    date = max(x["date"] for x in lines_)
    title = "Planner accuracy out of sample" if held_out else "Planner accuracy by model"
    text = [f"# {title} - {date}", "",
            f"Machine: {info['cpu']}, {info['logical_cpus']} cores; torch {info['torch']}; dufu "
            f"{info.get('dufu_commit')}. Each model's file holds its table, method and machine; the held-out models "
            "were **not** used to set the CPU cost model's constants (`dufu/plan/cpu.py`), which were set on the "
            "calibration model (gpt-8x512). Tolerance: 10% for peak memory per rank, 25% for step time.", ""]

    def rng(d: dict) -> str:
        if d["median"] is None:
            return "-"
        far = d["furthest"]
        return f"{d['min']:.2f} to {d['max']:.2f} (median {d['median']:.2f}); {far['layout']} {far['ratio']:.2f}"

    rows = [[f"{x['name']}{'' if x['held_out'] else ' (calibration model: in sample)'}", f"`{x['config']}`",
             f"{x['parameters'] / 1e6:.1f}M",
             f"{x['summary']['memory']['within']} of {x['summary']['memory']['compared']}", rng(x["memory"]),
             f"{x['summary']['time']['within']} of {x['summary']['time']['compared']}", rng(x["time"]),
             fmt(x["other_cpu_s"]), f"`{x['file']}.md`"] for x in lines_]
    text += table(["model", "recipe", "parameters", "memory within 10%", "memory predicted / measured; furthest off",
                   "time within 25%", "time predicted / measured; furthest off", "other processes' CPU s",
                   "results"], rows)
    text += ["", *[f"* {x['name']}: {x['about']}." for x in lines_], ""]
    def total(what: str, key: str) -> int:
        return sum(x["summary"][what][key] for x in lines_)

    mem, tim = (total("memory", "within"), total("memory", "compared")), (total("time", "within"),
                                                                           total("time", "compared"))
    text += [f"**All {len(lines_)} models: peak memory per rank {mem[0]} of {mem[1]} within 10%; step time "
             f"{tim[0]} of {tim[1]} within 25%.**"]
    data = {"date": date, "machine": info, "held_out": held_out, "models": lines_,
            "memory_within": mem[0], "memory_compared": mem[1], "time_within": tim[0], "time_compared": tim[1]}
    return data, "\n".join(text)
