"""Pipeline bubbles of 1F1B, interleaved 1F1B, ZB-V and DualPipeV side by side, at pp 2 and pp 4, on this CPU.

    python benchmarks/pipeline_bubble.py            # full run: 8 jobs of 5 steps, ~4 minutes on 2 idle cores
    python benchmarks/pipeline_bubble.py --quick    # smoke run: pp 2 only, a tiny model; writes nothing

Every job trains the same model (``gpt_debug`` scaled to 8 layers, hidden 192, 6 heads, sequence 128; fp32, one
thread per process) on the same global batch of 32 sequences in 8 micro-batches of 4, the schedule's micro-batches
(``train.dist.pipeline_schedule``; interleaved 1F1B, ZB-V and DualPipeV with ``virtual_pipeline_size=2``: 2 pp
stages of 8 / (2 pp) layers, rank r holding stages r, r + pp (looped) or r, 2 pp - 1 - r (V); 1F1B: pp stages).
8 layers split into 2 pp stages evenly at pp 2 and 4, and 8 micro-batches is what DualPipeV needs at pp 4 (2 pp).

**Measured** (hook :class:`StageBusy` in every rank's main thread, which runs the schedule): for every step after
the warm-up, the wall time of the pipeline schedule's ``step`` (the trainer's ``forward_backward``) split by the
kernel's per-thread accounting (``/proc/thread-self/schedstat``) into

* busy: the thread ran on a core (the stage's forward, backward and weight-gradient work, and the schedule's own
  bookkeeping);
* no core: it was runnable but waited for a core (CPU oversubscription: at pp 4, four single-thread ranks share 2
  cores, so at least half of every rank's runnable time waits here; other processes on the machine add to it);
* idle: the rest of the wall time, when the thread was blocked waiting for another stage's activations or
  gradients: the bubble.

The table gives the mean over ranks of each share of the schedule's wall time, and the step's wall time. Only the
pp 2 rows measure the schedules as they would run on a machine with a core per rank: at pp 4 a rank that waits
for a core delays the ranks that wait for its output, so idle time and no-core time trade places and the pp 4
idle shares are distorted (upward for the schedules that keep more ranks busy at once, where the cores are
shared by more ready ranks; the no-core share says how much).

**Simulated**: the same action lists torch runs (``torch.distributed.pipelining``'s own ``pipeline_order`` of each
schedule for that pp and 8 micro-batches) replayed with a core per rank, no communication time and unit costs
(forward 1, input gradient 1, weight gradient 1, full backward 2; DualPipeV's overlapped forward + backward pair
runs its two halves one after the other, as torch runs it without a registered overlap function): the bubble the
schedule itself leaves, 1 - busy / (ranks x makespan).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when run as a script from anywhere

from dufu.engine.hooks import Hook  # noqa: E402
from harness import launch, machine, results as results_files  # noqa: E402

CORES = os.cpu_count() or 1
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2))
LABELS = {"1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B", "zbv": "ZB-V", "dualpipev": "DualPipeV"}
MODEL = {"num_layers": 8, "hidden_size": 192, "num_attention_heads": 6, "max_position_embeddings": 128}
SEQ, MICRO, MICRO_BATCHES = 128, 4, 8
QUICK_MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 32}
QUICK_SEQ = 32
RUN_SETTINGS = ("train.evaluation.enabled=False", "train.checkpointer.period=0", "train.tensorboard=False",
                "train.generation.enabled=False", "train.plan_memory=False", "train.log_period=1",
                "train.compile.enabled=False", "train.amp.enabled=False")


# ------------------------------------------------------------------------------------------ in the workers
def _schedstat() -> tuple[int, int]:
    """(ns on a core, ns runnable but waiting for one) of the calling thread."""
    fields = Path("/proc/thread-self/schedstat").read_text().split()
    return int(fields[0]), int(fields[1])


class StageBusy(Hook):
    """Per step: the wall seconds of ``forward_backward`` (the pipeline schedule's step) and this thread's seconds
    on a core and waiting for one in it; written to ``folder/rank{R}.json`` at the end."""

    def __init__(self, folder: str):
        self.folder, self.steps = Path(folder), []
        self._t0, self._s0 = 0.0, (0, 0)

    def before_forward_backward(self, trainer, micro_batches) -> None:
        self._t0, self._s0 = time.perf_counter(), _schedstat()

    def after_backward(self, trainer, local_loss):
        wall, (on_core, waiting) = time.perf_counter() - self._t0, _schedstat()
        self.steps.append({"step": trainer.step + 1, "wall_s": wall, "busy_s": (on_core - self._s0[0]) / 1e9,
                           "no_core_s": (waiting - self._s0[1]) / 1e9})
        return None

    def on_end(self, trainer, summary) -> None:
        rt = trainer.runtime
        launch.write_rank_file(self.folder, rt.rank, {"pp_rank": rt.pp_rank, "steps": self.steps})


# ------------------------------------------------------------------------------------------ simulation
UNIT_COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def one_f_one_b(pp: int, rank: int, n: int) -> list[tuple[str, int, int]]:
    """The actions ``Schedule1F1B._step_microbatches`` runs on ``rank``: its warm-up forwards, then backward and
    forward in turn, then the remaining backwards."""
    warmup = min(n, pp - rank)
    out = [("F", rank, mb) for mb in range(warmup)]
    for b in range(n):
        out.append(("B", rank, b))
        if warmup + b < n:
            out.append(("F", rank, warmup + b))
    return out


def simulated_bubble(schedule: str, pp: int, n: int, stages_per_rank: int, costs=UNIT_COSTS) -> float:
    """1 - busy / (ranks x makespan) of torch's own action lists for ``schedule``, replayed with a core per rank,
    free communication and ``costs`` per action kind (see the module docstring)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # torch-private: its lists

    from dufu.parallel.pipeline import SCHEDULES

    num_stages = pp * stages_per_rank
    if SCHEDULES[schedule][1]:
        ops = get_schedule_ops(getattr(pipelining, SCHEDULES[schedule][0]), pp, n, stages_per_rank)
        lists = [[a for a in rank if a is not None and a.computation_type.value != "REDUCE_GRAD"] for rank in ops]
    else:  # Schedule1F1B runs its own loop (its pipeline_order is a drawing): min(n, pp - r) forwards, then B F ...
        lists = [one_f_one_b(pp, r, n) for r in range(pp)]

    def atoms(action):  # (kind, stage, micro-batch) of an action; an overlapped pair is its two halves
        if type(action) is tuple:  # one of one_f_one_b's (torch's _Action is a NamedTuple)
            return [action]
        subs = getattr(action, "sub_actions", None)
        return [x for s in subs for x in atoms(s)] if subs else \
            [(action.computation_type.value, action.stage_index, action.microbatch_index)]

    def deps(kind, stage, mb):
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("I", "B"):
            return [("F", stage, mb)] + ([("I", stage + 1, mb)] if stage < num_stages - 1 else [])
        return [("I", stage, mb)]  # W

    def ready(parts, done) -> bool:  # every atom's inputs computed (by another action, or earlier in this one)
        made = set()
        for kind, s, mb in parts:
            if any(d not in done and d not in made for d in deps(kind, s, mb)):
                return False
            made |= {(kind, s, mb), ("I", s, mb)} if kind == "B" else {(kind, s, mb)}
        return True

    done: dict = {}
    free, busy, pos = [0.0] * pp, [0.0] * pp, [0] * pp
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                parts = atoms(lists[r][pos[r]])
                if not ready(parts, done):
                    break
                for kind, s, mb in parts:
                    start = max([free[r]] + [done[d] for d in deps(kind, s, mb)])
                    free[r] = start + costs[kind]
                    busy[r] += costs[kind]
                    done[(kind, s, mb)] = free[r]
                    if kind == "B":
                        done[("I", s, mb)] = done[("W", s, mb)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} pp{pp}: the replay of torch's action lists made no progress")
    return 1.0 - sum(busy) / (pp * max(free))


# ------------------------------------------------------------------------------------------ the jobs
def job_argv(schedule: str, virtual: int, pp: int, steps: int, quick: bool, out: Path) -> list[str]:
    model, seq = (QUICK_MODEL, QUICK_SEQ) if quick else (MODEL, SEQ)
    return ["gpt_debug", *(f"model.{k}={v}" for k, v in model.items()), f"dataloader.train.seq_length={seq}",
            f"train.train_micro_batch_size={MICRO}", f"train.global_batch_size={MICRO * MICRO_BATCHES}",
            f"train.train_iter={steps}", *RUN_SETTINGS, f"train.dist.pipeline_parallel_size={pp}",
            f"train.dist.pipeline_schedule={schedule}", f"train.dist.virtual_pipeline_size={virtual}",
            f"train.output_dir={out / 'run'}",
            launch.hooks_override(("pipeline_bubble.StageBusy", {"folder": out / "busy"}))]


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Mean over ranks of the busy / no-core / idle shares of the schedule's wall time, steps after the warm-up."""
    shares = []
    for rank in ranks:
        steps = [s for s in rank["steps"] if s["step"] > warmup]
        wall = sum(s["wall_s"] for s in steps)
        busy, no_core = sum(s["busy_s"] for s in steps), sum(s["no_core_s"] for s in steps)
        shares.append({"pp_rank": rank["pp_rank"], "wall_s": wall / len(steps), "busy": busy / wall,
                       "no_core": no_core / wall, "idle": max(0.0, 1.0 - (busy + no_core) / wall)})
    walls = [statistics.median(s["wall_s"] for s in r["steps"] if s["step"] > warmup) for r in ranks]
    return {"ranks": shares, "step_wall_s": max(walls),
            **{k: statistics.fmean(s[k] for s in shares) for k in ("busy", "no_core", "idle")}}


def run_all(pps, steps: int, warmup: int, quick: bool, work: Path, cache: Path, timeout: float) -> list[dict]:
    rows = []
    for pp in pps:
        for schedule, virtual in SCHEDULES:
            out = work / f"pp{pp}-{schedule}"
            run = launch.Run(f"pp{pp} {schedule}", launch.dufu_train(job_argv(schedule, virtual, pp, steps, quick,
                                                                                out), pp),
                             launch.job_env(cache, threads=1), out)
            launch.execute(run, timeout)
            row = {"pp": pp, "schedule": schedule, "virtual_pipeline_size": virtual, "rc": run.rc,
                   "job_s": round(run.seconds, 1), "load_before": round(run.load_before, 2),
                   "simulated_bubble": simulated_bubble(schedule, pp, MICRO_BATCHES, virtual)}
            ranks = launch.read_rank_files(out / "busy", pp)
            if run.rc != 0 or ranks is None:
                row["error"] = run.log_tail[-1500:] or "no rank files"
                print(f"{run.label}: failed\n{row['error']}", flush=True)
            else:
                row.update(summarize(ranks, warmup))
                row["losses"] = [r["loss"] for r in launch.read_metrics(out / "run")]
                print(f"{run.label}: step {row['step_wall_s']:.3f} s, busy {row['busy']:.1%}, no core "
                      f"{row['no_core']:.1%}, idle {row['idle']:.1%}, simulated bubble "
                      f"{row['simulated_bubble']:.1%} ({run.seconds:.0f} s, load {run.load_before:.1f})", flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ the report
def shared_or_quiet(res: dict) -> str:
    if res["load_avg_start"] > CORES / 2:
        return "a machine shared with other work: wall times and no-core shares are noisy"
    return "a quiet machine"


def report(res: dict) -> str:
    m = res["machine"]
    setup = res["setup"]
    lines = [f"# Pipeline bubbles: 1F1B, interleaved 1F1B, ZB-V, DualPipeV ({res['date']})", "",
             f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']}, gloo; one thread per "
             f"process. Load average {res['load_avg_start']} at the start, {res['load_avg_end']} at the end: "
             f"**{shared_or_quiet(res)}**.",
             "", f"Model: gpt_debug scaled to {setup['model']}, sequence {setup['seq_length']}, fp32; global batch "
             f"{setup['global_batch_size']} = {setup['micro_batches']} micro-batches of {setup['micro_batch_size']}; "
             f"{setup['steps']} steps, the first {setup['warmup']} left out. Produced by `python "
             "benchmarks/pipeline_bubble.py` (see its docstring for what each column measures).", "",
             "Shares of the pipeline schedule's wall time per step, mean over ranks. *Idle* is the measured bubble "
             "(blocked waiting for another stage); *no core* is time runnable without a core (oversubscription: "
             "at pp 4 four ranks share 2 cores, which distorts the pp 4 rows); *simulated* is the bubble of "
             "torch's own action lists for the schedule with a core per rank and unit costs.", ""]
    rows = []
    for r in res["rows"]:
        if "error" in r:
            rows.append([f"pp {r['pp']}", LABELS[r["schedule"]], "failed", "", "", "", "", "",
                         f"{r['simulated_bubble']:.1%}"])
            continue
        base = next(b for b in res["rows"] if b["pp"] == r["pp"] and b["schedule"] == "1f1b")
        rel = f"{r['step_wall_s'] / base['step_wall_s']:.2f}x" if "step_wall_s" in base else "-"
        rows.append([f"pp {r['pp']}", LABELS[r["schedule"]], f"{r['step_wall_s']:.3f} s", rel, f"{r['busy']:.1%}",
                     f"{r['no_core']:.1%}", f"**{r['idle']:.1%}**", f"{r['simulated_bubble']:.1%}",
                     f"{r['load_before']:.1f}"])
    lines += results_files.table(["pp", "schedule", "step (wall)", "vs 1F1B", "busy", "no core", "idle (bubble)",
                                  "simulated bubble", "load average before the job"], rows)
    lines += ["", "Per rank (busy / no core / idle):", ""]
    for r in res["rows"]:
        if "ranks" in r:
            per = ", ".join(f"rank {x['pp_rank']} {x['busy']:.0%} / {x['no_core']:.0%} / {x['idle']:.0%}"
                            for x in sorted(r["ranks"], key=lambda x: x["pp_rank"]))
            lines.append(f"- pp {r['pp']} {LABELS[r['schedule']]}: {per}")
    losses = {(r["pp"], r["schedule"]): r.get("losses") for r in res["rows"]}
    spread = [abs(a - b) for (pp, _), ls in losses.items() if ls
              for a, b in zip(ls, losses.get((pp, "1f1b")) or [])]
    if spread:
        lines += ["", f"Every schedule trains the same numbers: the largest difference of a logged loss from 1F1B's at "
                      f"the same pp is {max(spread):.1e}."]
    lines += ["", "## Observations", ""] + [f"- {o}" for o in res["observations"]]
    lines += ["", f"Total {res['total_s'] / 60:.1f} min."]
    return "\n".join(lines)


def observations(res: dict) -> list[str]:
    out = []
    ok = [r for r in res["rows"] if "idle" in r]
    for pp in sorted({r["pp"] for r in ok}):
        at = {r["schedule"]: r for r in ok if r["pp"] == pp}
        if not at:
            continue
        best = min(at.values(), key=lambda r: r["idle"])
        out.append(f"pp {pp}: the smallest measured bubble is {LABELS[best['schedule']]}'s ({best['idle']:.1%} idle); "
                   + ", ".join(f"{LABELS[s]} {r['idle']:.1%} (simulated {r['simulated_bubble']:.1%})"
                               for s, r in at.items()) + ".")
        no_core = statistics.fmean(r["no_core"] for r in at.values())
        if pp > CORES:
            out.append(f"pp {pp} runs {pp} single-thread ranks on {CORES} cores: the no-core share ({no_core:.0%} "
                       "on average) is time the schedule would have spent computing on a machine with a core per "
                       "rank, so its idle shares are not the schedules' own bubbles; the simulated column is.")
        elif no_core > 0.2:
            out.append(f"pp {pp} has a core per rank, but other processes took them {no_core:.0%} of the time on "
                       "average, so the idle shares mix the schedules' own bubbles with that contention (a stage "
                       "waiting for a core delays the next one; a rank waiting for a core may find its input arrived "
                       "meanwhile).")
    out.append("On this runtime DualPipeV's paired forward and backward of two micro-batches run one after the other "
               "(torch overlaps them only through a registered OVERLAP_F_B function, which hides one micro-batch's "
               "communication, e.g. expert-parallel all-to-all, behind the other's compute): its gain here is "
               "the V placement and the order of its actions, not overlap.")
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in res["rows"] if "idle" in r]
    pps = sorted({r["pp"] for r in ok})
    fig, axes = plt.subplots(1, len(pps), figsize=(5 * len(pps), 3.6), squeeze=False)
    for ax, pp in zip(axes[0], pps):
        at = [r for r in ok if r["pp"] == pp]
        x = range(len(at))
        ax.bar([i - 0.2 for i in x], [100 * r["idle"] for r in at], 0.4, label="measured idle")
        ax.bar([i + 0.2 for i in x], [100 * r["simulated_bubble"] for r in at], 0.4, label="simulated")
        ax.set_xticks(list(x), [LABELS[r["schedule"]] for r in at], fontsize=8)
        ax.set_title(f"pp {pp}" + (f" ({pp} ranks on {CORES} cores)" if pp > CORES else ""))
        ax.set_ylabel("bubble, % of step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="pp 2 only, a tiny model, 4 steps; writes nothing")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default 5; quick 4)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out (shape inference, allocation)")
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="write the .md and .png of an earlier results file again (no measurement)")
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        res = json.loads(path.read_text())
        res["observations"] = observations(res)
        path.write_text(json.dumps(res, indent=1) + "\n")
        path.with_suffix(".md").write_text(report(res) + "\n")
        plot(res, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.md')} and .png")
        return
    steps = args.steps or (4 if args.quick else 5)
    pps = [2] if args.quick else [2, 4]
    load0 = os.getloadavg()[0]
    if load0 > CORES / 2:
        print(f"warning: load average {load0:.1f} on {CORES} cores: other work is running, wall times are noisy.")
    t0, date = time.perf_counter(), results_files.today()
    res = {"date": date, "quick": args.quick, "machine": machine.describe(), "load_avg_start": round(load0, 2),
           "setup": {"model": ", ".join(f"{k} {v}" for k, v in (QUICK_MODEL if args.quick else MODEL).items()),
                     "seq_length": QUICK_SEQ if args.quick else SEQ, "micro_batch_size": MICRO,
                     "micro_batches": MICRO_BATCHES, "global_batch_size": MICRO * MICRO_BATCHES, "steps": steps,
                     "warmup": args.warmup, "threads_per_process": 1, "unit_costs": UNIT_COSTS}}
    with tempfile.TemporaryDirectory(prefix="pipeline_bubble-") as tmp:
        work = Path(tmp)
        res["rows"] = run_all(pps, steps, args.warmup, args.quick, work, work / "cache", args.timeout)
    res["total_s"] = time.perf_counter() - t0
    res["load_avg_end"] = round(os.getloadavg()[0], 2)
    res["observations"] = observations(res)
    text = report(res)
    print()
    print(text)
    out_dir = results_files.results_dir(args.results_dir, args.quick)
    if out_dir is not None:
        stem = results_files.write(results_files.stem(out_dir, "pipeline_bubble", date), res, text)
        if any("idle" in r for r in res["rows"]):
            plot(res, stem.with_suffix(".png"))
        print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
