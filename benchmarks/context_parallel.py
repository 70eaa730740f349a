"""Context parallelism on the CPU: per-rank peak activation memory and tokens/s of one decoder at sequence lengths up
to 16K, with every sample's tokens split over context-parallel size (cp) 1, 2 and 4 ranks, side by side in one run.

    python benchmarks/context_parallel.py           # 2K .. 16K tokens x cp 1, 2, 4 (~15 minutes on 2 busy cores)
    python benchmarks/context_parallel.py --quick   # a smoke run (tiny model, 128 tokens, cp 1 and 2; ~3 min),
                                                    # writes nothing unless --results-dir
    python benchmarks/context_parallel.py --seq-lengths 4096 8192 --cp 1 2

**The runs.** Each point (sequence length T, cp) is one ``dufu train llama_debug --nproc CP
train.dist.context_parallel_size=CP`` job: ``llama_debug`` resized (hidden 64, 2 layers, 4 query / 2 key-value
heads of 16, SwiGLU 176, byte vocabulary of 384), ``model.max_position_embeddings`` = ``seq_length`` = T, fp32, one
sample of T tokens per step (micro-batch 1, dp 1: every cp size trains the same global batch), AdamW,
``--steps`` steps (default 2), evaluation and compile off, ``train.peak_tflops`` given (no start-up matmul
measurement). The model is small so that activations, not weights, gradients and optimizer state (0.14M
parameters, 2.2 MiB with AdamW), decide a rank's memory. Points run length by length, the cp sizes of one length one
after another with their order alternating, so a busy machine's drift hits every cp alike. A point whose predicted
time (the previous length's at that cp, times the growth of the step's cost) would overrun ``--budget-minutes``,
or whose predicted memory would not fit in the machine's available memory, is not run, and the results say so.

**Peak activation memory of a rank** = the kernel's high-water mark of the process's resident memory (``VmHWM`` in
``/proc/self/status``) during the last training step, minus its resident memory (``VmRSS``) just before that step, the
high-water mark having been reset there (``5`` written to ``/proc/self/clear_refs``). The trainer records no memory
itself (``dufu.engine.reporting.report`` logs loss, tokens/s and MFU), so a hook of the trainer
(``benchmarks/context_parallel_probe.py``, given to every worker through ``train.hooks``) takes the readings from the
start of each step to its end (``on_step_start``, ``after_optimizer``). Weights, optimizer state and the data are
resident before the step, so the difference is what the step allocates on top: activations saved for the backward, the
backward's temporaries and the gradients (the trainer frees them after every update: ``zero_grad(set_to_none=True)``,
0.5 MiB here). Every worker runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every allocation of 64 KiB
or more with its own mapping and returns it to the system when freed, so resident memory follows the live tensors
instead of keeping freed heap (without it glibc raises its mapping threshold after the first frees, up to 32 MiB, and
a step's activations would reuse memory already resident before the step, which the difference would miss). The figure
reported for a cp size is the largest over its ranks (their chunks are load balanced: they agree).

**What the memory is made of.** The first step (a warm-up for the timing) runs under
``torch.autograd.graph.saved_tensors_hooks`` that record every tensor autograd saves for the backward, each storage
once, parameters left out: the activation memory proper, held from the forward to the backward. Tensors saved while
``ContextParallel.attention`` runs are sorted into the whole sequence's keys and values (``ContextParallel.gather``'s
outputs and the copies attention makes of them), the causal masks each chunk builds (and what
``scaled_dot_product_attention`` makes of a boolean mask), and the rank's own queries, outputs and log-sum-exps;
every other saved tensor is "the rest" (norms, projections, rotary, SwiGLU, logits). Neither reading changes
anything the trainer computes.

**Tokens/s** = T / the slowest rank's wall time of the last step (the step waits for every rank at each
all-gather). Each process runs one torch thread, so cp ranks are cp cores' worth of work: **cp 4 runs 4 processes
on 2 cores, oversubscribed**, and on a machine shared with other work the throughput is noisy (the share of the
machine other processes used during each point is recorded); memory is the measurement that matters here.

Results: ``benchmarks/results/context-parallel-<date>.md``, ``.json`` and ``.png`` (per-rank activation memory vs
sequence length, one line per cp), with the CPU model, torch version and the dufu commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, proc, results as results_files

MIB = 2**20

SHAPES = {
    "full": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=176),
    "quick": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=64),
}
RUNS = {
    "full": dict(seq_lengths=(2048, 4096, 8192, 16384), cp_sizes=(1, 2, 4), steps=2, budget_minutes=22.0),
    "quick": dict(seq_lengths=(128,), cp_sizes=(1, 2), steps=2, budget_minutes=8.0),
}
RECIPE = "llama_debug"
RUN_SETTINGS = ["train.amp.enabled=False", "train.compile.enabled=False", "train.evaluation.enabled=False",
                "train.generation.enabled=False", "train.tensorboard=False", "train.checkpointer.period=0",
                "train.log_period=1", "train.peak_tflops=1.0", "train.train_micro_batch_size=1",
                "train.global_batch_size=1",
                # no validation set: evaluation is off, and the corpus's last 5% of documents hold fewer than 8K bytes
                "dataloader.train.valid_fraction=0"]
WORKER_ENV = {"OMP_NUM_THREADS": "1",  # one thread per process: cp ranks stand for cp devices
              "MALLOC_MMAP_THRESHOLD_": "65536"}  # resident memory follows the live tensors (module docstring)


def log(msg: str) -> None:
    print(f"[context_parallel] {msg}", flush=True)


# ============================================================================ the runs
def train_argv(T: int, cp: int, shape: dict, steps: int, output_dir: Path | None) -> list[str]:
    argv = [RECIPE, *(f"model.{k}={v}" for k, v in shape.items()), f"model.max_position_embeddings={T}",
            f"dataloader.train.seq_length={T}", *RUN_SETTINGS, f"train.train_iter={steps}",
            f"train.dist.context_parallel_size={cp}"]
    return argv + ([f"train.output_dir={output_dir}"] if output_dir is not None else [])


def worker_command(T: int, cp: int, shape: dict, steps: int, output_dir: Path, records: Path) -> list[str]:
    """The torchrun command of ``dufu train --nproc CP`` (``cp`` workers), with the readings' hook."""
    return launch.torchrun_train(cp, [*train_argv(T, cp, shape, steps, output_dir), launch.hooks_override(
        ("context_parallel_probe.ActivationProbe", {"out_dir": records}))])


def available_memory_bytes() -> int | None:
    free = proc.meminfo_kib("MemAvailable")
    return None if free is None else free * 1024


def run_point(T: int, cp: int, shape: dict, steps: int, workdir: Path, timeout: float) -> dict:
    run, records = workdir / f"T{T}-cp{cp}", workdir / f"T{T}-cp{cp}-readings"
    cmd = worker_command(T, cp, shape, steps, run, records)
    env = launch.job_env(threads=None, extra=WORKER_ENV)
    busy0, cpu0, t0 = proc.system_busy_seconds(), proc.children_cpu_seconds(), time.perf_counter()
    job = subprocess.Popen(cmd, cwd=launch.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.terminate()  # torchrun passes SIGTERM on to its workers (each in a session of its own) and stops them
        try:
            job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
        return {"seq_length": T, "cp": cp, "status": "timed out", "wall_s": time.perf_counter() - t0,
                "reason": f"not finished within {timeout:.0f} s (stopped)"}
    wall, cpu = time.perf_counter() - t0, proc.children_cpu_seconds() - cpu0
    busy1 = proc.system_busy_seconds()
    if job.returncode != 0:
        return {"seq_length": T, "cp": cp, "status": "failed", "wall_s": wall, "returncode": job.returncode,
                "reason": f"exit {job.returncode}", "stderr_tail": stderr[-3000:],
                "errors": [line for line in stderr.splitlines() if "rror" in line][:10]}
    ranks = launch.read_rank_files(records, cp)
    last = [rk["steps"][-1] for rk in ranks]
    peaks = [s["peak_delta_kib"] * 1024 for s in last]
    step_s = max(s["wall_s"] for s in last)  # the slowest rank: the others wait for it at every all-gather
    saved = [rk["saved"] for rk in ranks]
    worst = max(range(cp), key=lambda r: saved[r]["total_bytes"])
    other = proc.other_load(busy0, busy1, cpu, wall)  # the share of the machine's CPU time other processes used
    other = None if other is None else min(1.0, other)
    return {"seq_length": T, "cp": cp, "status": "ok", "wall_s": wall,
            "peak_activation_bytes": max(peaks), "peak_activation_bytes_per_rank": peaks,
            "first_step_peak_bytes_per_rank": [rk["steps"][0]["peak_delta_kib"] * 1024 for rk in ranks],
            "rss_before_step_bytes": max(s["rss_before_kib"] * 1024 for s in last),
            "hwm_reset": all(s["hwm_reset"] for s in last),
            "step_s": step_s, "step_s_all": [max(rk["steps"][i]["wall_s"] for rk in ranks)
                                             for i in range(len(ranks[0]["steps"]))],
            "step_s_per_rank": [s["wall_s"] for s in last],
            "cpu_s_per_rank": [s["cpu_s"] for s in last], "tokens_per_s": T / step_s,
            "losses": [s["loss"] for s in ranks[0]["steps"]],
            "saved": saved[worst], "saved_total_bytes_per_rank": [s["total_bytes"] for s in saved],
            "parameters": ranks[0]["parameters"], "threads": ranks[0]["threads"], "other_load": other,
            "command": "dufu train " + " ".join(
                [RECIPE, f"--nproc {cp}", *train_argv(T, cp, shape, steps, None)[1:]])}


def predicted_cost(done: list[dict], T: int, cp: int) -> tuple[float | None, float | None]:
    """(seconds, per-rank peak bytes) predicted for (T, cp) from the longest finished length at that cp: the
    step's time and the masks grow with T^2 (an upper bound: the rest grows with T)."""
    prev = [d for d in done if d["cp"] == cp and d["status"] == "ok" and d["seq_length"] < T]
    if not prev:
        return None, None
    p = max(prev, key=lambda d: d["seq_length"])
    g = (T / p["seq_length"]) ** 2
    steps = sum(p["step_s_all"])  # the rest of the job's time (start-up, the final checkpoint) does not grow
    return p["wall_s"] - steps + steps * g, p["peak_activation_bytes"] * g


def measure(runs: dict, shape: dict, workdir: Path, t_start: float) -> list[dict]:
    budget = 60 * runs["budget_minutes"]
    done: list[dict] = []
    for i, T in enumerate(runs["seq_lengths"]):
        order = list(runs["cp_sizes"]) if i % 2 == 0 else list(runs["cp_sizes"])[::-1]
        for cp in order:
            if T % (2 * cp):
                done.append({"seq_length": T, "cp": cp, "status": "not run",
                             "reason": f"T is not divisible by 2 x cp = {2 * cp}"})
                continue
            seconds, peak = predicted_cost(done, T, cp)
            left = budget - (time.perf_counter() - t_start)
            free = available_memory_bytes()
            if seconds is not None and seconds > left:
                done.append({"seq_length": T, "cp": cp, "status": "not run", "reason":
                             f"predicted {seconds / 60:.1f} min (T^2 from the shorter length), "
                             f"{max(left, 0) / 60:.1f} min of the {runs['budget_minutes']:g}-minute budget left"})
                log(f"T {T} cp {cp}: not run ({done[-1]['reason']})")
                continue
            if peak is not None and free is not None and cp * peak > 0.7 * free:
                done.append({"seq_length": T, "cp": cp, "status": "not run", "reason":
                             f"predicted {cp} x {peak / MIB:,.0f} MiB, {free / MIB:,.0f} MiB available"})
                log(f"T {T} cp {cp}: not run ({done[-1]['reason']})")
                continue
            timeout = max(300.0, 3 * (seconds or 0) + 120)
            log(f"T {T} cp {cp} ...")
            d = run_point(T, cp, shape, runs["steps"], workdir, timeout)
            done.append(d)
            if d["status"] == "ok":
                log(f"  per-rank activation {d['peak_activation_bytes'] / MIB:,.1f} MiB, "
                    f"{d['tokens_per_s']:,.0f} tokens/s ({d['wall_s']:.0f} s)")
            else:
                log(f"  {d['status']}: {d['reason']}\n" + "\n".join(d.get("errors", [])))
    return done


def ratios(points: list[dict]) -> list[dict]:
    """Per length and cp > 1: the per-rank peak and its parts against cp 1's at that length, beside 1 / cp."""
    ok = {(d["seq_length"], d["cp"]): d for d in points if d["status"] == "ok"}
    out = []
    for (T, cp), d in sorted(ok.items()):
        base = ok.get((T, 1))
        if cp == 1 or base is None:
            continue
        b = d["saved"]["bytes"]
        without = b["rest"] + b["attention, local"]  # what splits the tokens: everything but K/V and masks
        out.append({"seq_length": T, "cp": cp, "ideal": 1 / cp,
                    "peak_ratio": d["peak_activation_bytes"] / base["peak_activation_bytes"],
                    "saved_ratio": d["saved"]["total_bytes"] / base["saved"]["total_bytes"],
                    "saved_ratio_without_kv_masks": without / base["saved"]["total_bytes"],
                    "saved_ratio_with_kv_without_masks": (without + b["gathered K/V"])
                    / base["saved"]["total_bytes"],
                    "mask_bytes": b["masks"], "gathered_kv_bytes": b["gathered K/V"],
                    "tokens_per_s_ratio": d["tokens_per_s"] / base["tokens_per_s"]})
    return out


def expected_mask_elements(T: int, cp: int, layers: int) -> int:
    """Causal-mask elements one rank builds per step: chunks r and 2cp-1-r of c = T / 2cp queries see (r + 1) c and
    (2 cp - r) c keys, (2 cp + 1) c^2 in all per layer (the same for every rank)."""
    c = T // (2 * cp)
    return layers * (2 * cp + 1) * c * c


def expected_kv_bytes(T: int, cp: int, shape: dict) -> int:
    """The gathered keys and values one rank holds for the backward: (1, kv heads, T, head dim) each, per layer."""
    hs = shape["hidden_size"] // shape["num_attention_heads"]
    return shape["num_layers"] * 2 * shape["num_key_value_heads"] * T * hs * 4 if cp > 1 else 0


# ============================================================================ report
def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


def observations(result: dict) -> list[str]:
    out = []
    shape, rs = result["shape"], result["ratios"]
    if not rs:
        return out
    longest = max(r["seq_length"] for r in rs)
    at = {(r["seq_length"], r["cp"]): r for r in rs}
    out.append("Per-rank peak activation memory against cp 1's at the same length (1 / cp is the ideal): " + "; ".join(
        f"T {T:,}: " + ", ".join(f"cp {cp} {at[T, cp]['peak_ratio']:.2f} (1/cp {1 / cp:.2f})"
                                 for cp in result["cp_sizes"] if (T, cp) in at)
        for T in sorted({r["seq_length"] for r in rs})) + ".")
    ex = [r for r in rs if r["seq_length"] == longest]
    dtypes = {}
    for d in result["points"]:
        if d["status"] == "ok":
            for k, v in d["saved"]["mask_bytes_by_dtype"].items():
                dtypes[k] = dtypes.get(k, 0) + v
    if any(r["mask_bytes"] for r in ex):
        out.append(
            "The remainder is the causal masks: every chunk of a rank builds its own (chunk x keys) boolean mask in "
            "every layer (`ContextParallel.attention`'s masked path), (2 cp + 1) (T / 2cp)^2 elements per layer and "
            "rank, and `scaled_dot_product_attention` on the CPU turns a boolean mask into an additive one and saves "
            "that for the backward (saved masks by dtype: " + ", ".join(
                f"{k} {_mib(v)} MiB" for k, v in sorted(dtypes.items())) + " over all points). At T "
            f"{longest:,} the masks are " + ", ".join(
                f"{_mib(r['mask_bytes'])} MiB per rank at cp {r['cp']}" for r in ex) + ".")
    else:
        out.append(
            "No causal mask is built: on the CPU each local chunk attends to the keys before it and to itself in two "
            "fused-kernel calls merged by their log-sum-exps (`ContextParallel.attention`), so nothing of size T^2 "
            "is kept.")
    out.append(
        "What stays above 1 / cp is the whole sequence's keys and values that each layer gathers and keeps for the "
        "backward, the same at every cp (" + ", ".join(
            f"{_mib(r['gathered_kv_bytes'])} MiB at cp {r['cp']}" for r in ex) + f" at T {longest:,}: "
        f"{shape['num_key_value_heads']} kv heads of {shape['hidden_size'] // shape['num_attention_heads']}, "
        "repeated to the query heads for the CPU kernel), and the rank's attention outputs and log-sum-exps. "
        "Without the gathered K/V the saved activations are " + ", ".join(
            f"{r['saved_ratio_without_kv_masks']:.2f}x (cp {r['cp']})" for r in ex) + " of cp 1's: the rest splits "
        "as 1 / cp. The gathered K/V is a fixed 2 (K, V) x 4 bytes (fp32) x layers x T x heads x head dim whatever cp is; in "
        "a model of realistic width it is a small share of the activations (grouped-query heads make it smaller).")
    tp = [f"cp {r['cp']} {r['tokens_per_s_ratio']:.2f}x" for r in ex]
    out.append(f"Tokens/s against cp 1 at T {longest:,}: " + ", ".join(tp) + ". Each process runs one thread; cp 2 "
               "has the machine's 2 cores, cp 4 runs 4 processes on them (oversubscribed), and the machine was "
               "shared with other work, so these throughputs are rough.")
    return out


def report(result: dict) -> str:
    m, s = result["machine"], result["shape"]
    hs = s["hidden_size"] // s["num_attention_heads"]
    code = result["code"]
    code_text = f"dufu {code['commit']}" + (f" + uncommitted changes in {len(code['changed'])} files of dufu/"
                                            if code["changed"] else "")
    lines = [f"# Context parallelism on the CPU - {result['date']}", "", f"`{result['command']}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; {m['platform']}"
             + (f"; {machine.peaks_text(m)}" if machine.peaks_text(m) else "") + f". Code: {code_text}. The run took "
             f"{result['wall_s'] / 60:.1f} min; load average {result['load_avg_start']} at the start, "
             f"{result['load_avg_end']} at the end: **a machine shared with other work, so tokens/s are noisy**; "
             "memory is not affected by it.", "",
             *([f"**dufu/ changed while this ran ({', '.join(result['code_changed_during_run'])}): points started "
                "before and after the change ran different code.**"
                + (f" {result['code_note']}" if result.get("code_note") else ""), ""]
               if result.get("code_changed_during_run") else []),
             f"Model: `{RECIPE}` resized, hidden {s['hidden_size']}, {s['num_layers']} layers, "
             f"{s['num_attention_heads']} query / {s['num_key_value_heads']} key-value heads of {hs}, SwiGLU "
             f"{s['ffn_hidden_size']}, byte vocabulary (384), {result['parameters']:,} parameters, fp32; one sample "
             f"of T tokens per step (dp 1), AdamW; {result['steps']} steps per point, the last one measured. Each "
             "point is `dufu train --nproc CP train.dist.context_parallel_size=CP`; one torch thread per process. "
             f"**cp 4 runs 4 processes on {m['logical_cpus']} cores: oversubscribed, its tokens/s is not what 4 "
             "devices would give.**", "",
             "Per-rank activation memory = peak resident memory during the step minus resident memory before it "
             "(`VmHWM` reset before the step, glibc's mapping threshold fixed at 64 KiB so that freed memory goes "
             "back to the system), the largest over the ranks. Saved = what autograd holds for the backward after "
             "the forward (each storage once, weights excluded), on the rank holding the most.", "",
             "| T | cp | per-rank activation (MiB) | vs cp 1 | 1 / cp | saved for backward (MiB) | of it: masks "
             "| gathered K/V | local attention | rest | step (s) | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rat = {(r["seq_length"], r["cp"]): r for r in result["ratios"]}
    for d in result["points"]:
        T, cp = d["seq_length"], d["cp"]
        if d["status"] != "ok":
            lines.append(f"| {T:,} | {cp} | {d['status']}: {d['reason']} | | | | | | | | | |")
            continue
        b = d["saved"]["bytes"]
        r = rat.get((T, cp))
        lines.append(
            f"| {T:,} | {cp} | {_mib(d['peak_activation_bytes'])} | "
            f"{r['peak_ratio']:.2f} | {1 / cp:.2f} | " if r else
            f"| {T:,} | {cp} | {_mib(d['peak_activation_bytes'])} | {'1.00' if cp == 1 else '-'} | {1 / cp:.2f} | ")
        lines[-1] += (f"{_mib(d['saved']['total_bytes'])} | {_mib(b['masks'])} | {_mib(b['gathered K/V'])} | "
                      f"{_mib(b['attention, local'])} | {_mib(b['rest'])} | {d['step_s']:.2f} | "
                      f"{d['tokens_per_s']:,.0f} |")
    masked = any(d["status"] == "ok" and d["saved"]["bytes"]["masks"] for d in result["points"])
    lines += [] if not masked else ["", "Expected sizes, for comparison with the saved columns: the masks a rank builds are (2 cp + 1) "
              "(T / 2cp)^2 elements per layer, saved as the float32 additive mask SDPA makes of the boolean one (4 "
              "bytes each; the boolean itself, 1 byte each, lives only while its chunk's forward runs); the gathered "
              "keys and values 2 x kv heads x T x head dim x 4 bytes per layer:", "",
              "| T | cp | mask elements per rank | as float32 (MiB) | gathered K/V (MiB) |",
              "|---:|---:|---:|---:|---:|"]
    for d in result["points"] if masked else ():
        if d["status"] == "ok" and d["cp"] > 1:
            n = expected_mask_elements(d["seq_length"], d["cp"], s["num_layers"])
            lines.append(f"| {d['seq_length']:,} | {d['cp']} | {n:,} | {_mib(4 * n)} | "
                         f"{_mib(expected_kv_bytes(d['seq_length'], d['cp'], s))} |")
    lines += ["", f"![per-rank activation memory vs sequence length]({result['plot']})" if result.get("plot")
              else "", ""]
    if result.get("observations"):
        lines += ["## Observations", "", *[f"* {o}" for o in result["observations"]], ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ok = [d for d in result["points"] if d["status"] == "ok"]
    base = {d["seq_length"]: d["peak_activation_bytes"] for d in ok if d["cp"] == 1}
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red"}
    for cp in result["cp_sizes"]:
        pts = sorted((d["seq_length"], d["peak_activation_bytes"] / MIB) for d in ok if d["cp"] == cp)
        if not pts:
            continue
        ax.plot(*zip(*pts), "o-", color=colors.get(cp), label=f"cp {cp} (measured)")
        if cp > 1 and base:
            ideal = sorted((T, b / cp / MIB) for T, b in base.items())
            ax.plot(*zip(*ideal), "x:", color=colors.get(cp), label=f"cp 1 / {cp} (ideal)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("per-rank peak activation memory (MiB)")
    ax.set_title("Context parallelism: per-rank activation memory\n"
                 f"({result['parameters']:,}-parameter LLaMA-style decoder, fp32, 1 sample per step)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(result: dict, stem: Path | None) -> str:
    """Ratios, observations and the report of ``result``; with ``stem``, the .json, .md and .png written."""
    ok = [d for d in result["points"] if d["status"] == "ok"]
    result["ratios"] = ratios(result["points"])
    result["by"] = {(d["seq_length"], d["cp"]): d for d in ok}
    result["observations"] = observations(result)
    del result["by"]
    if stem is not None and ok:
        result["plot"] = stem.with_suffix(".png").name
    text = report(result)
    if stem is not None:
        results_files.write(stem, result, text)
        if ok:
            plot(result, stem.with_suffix(".png"))
        log(f"wrote {stem}.md, .json{', .png' if ok else ''}")
    return text


def write_again(path: Path) -> int:
    """The report and plot of an earlier run's JSON, from its measurements (after a change to the report)."""
    result = json.loads(path.read_text())
    print(finish(result, path.with_suffix("")))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 128 tokens, cp 1 and 2 (a smoke run)")
    ap.add_argument("--seq-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--cp", type=int, nargs="+", default=None, help="context-parallel sizes (default 1 2 4)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per point, the last one measured")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help="points predicted to end past this are not run (default 22)")
    ap.add_argument("--results-dir", default=None,
                    help="where results go (default benchmarks/results; --quick: nowhere)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="measure nothing: write the .md and .png of an earlier results JSON of this script again")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.report:
        return write_again(Path(args.report))
    mode = "quick" if args.quick else "full"
    shape, runs = SHAPES[mode], dict(RUNS[mode])
    for key, value in (("seq_lengths", args.seq_lengths), ("cp_sizes", args.cp), ("steps", args.steps),
                       ("budget_minutes", args.budget_minutes)):
        if value is not None:
            runs[key] = tuple(value) if isinstance(value, list) else value
    if runs["steps"] < 2:
        ap.error("--steps: at least 2 (the first sorts the saved tensors, the last is measured)")
    results_dir = results_files.results_dir(args.results_dir, args.quick)
    t0 = time.perf_counter()
    date = results_files.today()
    result = {"date": date, "command": shlex.join(["python", "benchmarks/context_parallel.py", *argv]),
              "quick": args.quick, "shape": shape, "steps": runs["steps"], "seq_lengths": list(runs["seq_lengths"]),
              "cp_sizes": list(runs["cp_sizes"]), "budget_minutes": runs["budget_minutes"],
              "worker_env": WORKER_ENV, "load_avg_start": [round(x, 2) for x in os.getloadavg()],
              "code": machine.code_state(), "machine": machine.describe()}
    digests = machine.dufu_digests()
    with tempfile.TemporaryDirectory(prefix="dufu-cp-") as tmp:
        result["points"] = measure(runs, shape, Path(tmp), t0)
    # every point starts new processes: a file changed meanwhile splits the run's code
    result["code_changed_during_run"] = machine.changed_since(digests)
    ok = [d for d in result["points"] if d["status"] == "ok"]
    result["parameters"] = ok[0]["parameters"] if ok else None
    result["machine"]["torch_threads"] = ok[0]["threads"] if ok else None  # the workers'; the peaks say their own
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(finish(result, results_dir / f"context-parallel-{date}" if results_dir is not None else None))
    failed = [d for d in result["points"] if d["status"] in ("failed", "timed out")]
    return 1 if failed or not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
