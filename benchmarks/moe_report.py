"""The report of ``benchmarks/moe.py``: the kinds of op its profiled steps are split into (and why each costs the
MoE model more, :data:`WHY`), the observations built from a run's numbers, the Markdown and the plot.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.machine import peaks_text

# Ops by kind, for the profiled step (aten names; everything else is "other ops").
OP_KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::dot",
               "aten::_grouped_mm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "routing": ("aten::topk", "aten::sort", "aten::argsort", "aten::bincount", "aten::_softmax",
                "aten::_softmax_backward_data", "aten::one_hot", "aten::cumsum", "aten::logsumexp",
                "aten::_local_scalar_dense"),
    "token permutation": ("aten::index", "aten::index_select", "aten::index_add_", "aten::index_put_",
                          "aten::_index_put_impl_", "aten::index_select_backward", "aten::cat",
                          "aten::split_with_sizes", "aten::repeat_interleave", "aten::gather", "aten::scatter_add_",
                          "aten::index_add", "aten::scatter", "aten::scatter_"),
    # zeros for gradients: a select's backward (GroupedExperts' ``gate_up[e]``) fills a zero tensor of the whole
    # weight and writes its slice into it; those are then added up (add_)
    "zero-fill, in-place add": ("aten::fill_", "aten::zero_", "aten::add_"),
    "optimizer": ("aten::_fused_adamw_", "aten::_foreach_norm", "aten::_foreach_mul_", "aten::_foreach_add_",
                  "aten::_foreach_div_", "aten::_foreach_lerp_", "aten::_foreach_sqrt", "aten::_foreach_addcdiv_",
                  "aten::_foreach_addcmul_", "aten::_foreach_mul"),
}
PROFILE_KINDS = (*OP_KINDS, "other ops", "between ops (Python, dispatch)")
PROFILE_ROUNDS = 6


def op_kind(name: str) -> str:
    for kind, names in OP_KINDS.items():
        if name in names:
            return kind
    return "other ops"



def describe_code(code: dict) -> str:
    moe_files = [f for f in code["changed"] if "moe" in f or "expert" in f]
    if code["commit"] is None and code.get("note"):
        return code["note"]  # a copy of the tree (``--before``): the note says what it holds
    text = f"dufu {code['commit'] or '(not a git checkout)'}"
    if code["changed"]:
        text += (f" + uncommitted changes in {len(code['changed'])} files of dufu/"
                 + (f", among them {', '.join(moe_files)}" if moe_files else ", none of them MoE code"))
    return text + (f" ({code['note']})" if code.get("note") else "")


def before_summary(before: dict, path: str) -> dict:
    """Part 1 of an earlier results file of this script, for ``--before``."""
    d = before["dense"]
    mo, de = d["rows"]["moe"], d["rows"]["dense"]
    return {"path": path, "date": before["date"], "code": before.get("code"),
            "ratio": d["step_time_ratio_moe_over_dense"], "cpu_ratio": mo["median_cpu_s"] / de["median_cpu_s"],
            "profile_moe_ms": mo["profile"]["wall_ms"], "profile_dense_ms": de["profile"]["wall_ms"],
            "zero_fill_ms": mo["profile"]["ms"]["zero-fill, in-place add"]
            - de["profile"]["ms"]["zero-fill, in-place add"],
            "fill_calls": mo["profile"]["fill_calls"], "selects": mo["profile"].get("select_backward_calls")}


# ============================================================================ report
def _f(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


# Why a kind of op costs the MoE model more than the dense one (part 1's profile), shown beside its difference.
WHY = {
    "zero-fill, in-place add": "zero-filled buffers and in-place additions ({fill} fill_ calls vs {dense_fill}: "
    "the output `index_add_` fills, gradients accumulated over the k copies of a token)",
    # when the profile shows a select's backward per expert and grouped weight
    "zero-fill, in-place add (selects)": "zero-filling and adding up gradients ({fill} fill_ calls vs {dense_fill}; "
    "{selects} SelectBackward0 nodes): GroupedExperts takes each expert's weights as a slice of the grouped tensor "
    "(`gate_up[e]`, `down[e]`), and the backward of every such select allocates a zero tensor of the whole (E, 2F, "
    "H) or (E, H, F) weight to write its slice into, after which autograd adds the E of them up: per layer and step, "
    "E full-size zero-fills and additions for each grouped weight, E^2 times the expert slices' size (`unbind(0)` "
    "gives each expert's gradient its own slice of one tensor)",
    "matmul": "matmuls ({mm} calls vs {dense_mm}): the same FLOPs per token cut into two products per expert in "
    "forward and four in backward, each on about N x k / E = {rows:,} token rows instead of N = {tokens:,}, which "
    "run less efficiently, plus the routers",
    "routing": "routing: the router's softmax and top-k, the argsort that groups the assignments by expert, "
    "bincount, the `.tolist()` of the counts that the per-expert split needs, the load-balancing loss's one-hot",
    "token permutation": "moving token copies: gathering them in expert order (`x[token]`), splitting and "
    "concatenating per expert, `index_add_` back into token order, and the backward of each (the gather's is an "
    "accumulating index_put)",
    "optimizer": "the optimizer: AdamW and the gradient norm touch every expert's weights, {total:,} parameters "
    "against the dense model's {dense_total:,}",
    "other ops": "other ops (the SwiGLU and the router weighting on k copies of every token, views, copies)",
    "between ops (Python, dispatch)": "time between ops: Python and autograd for {aten:,} aten calls vs "
    "{dense_aten:,}, most of them from the loop over experts",
    "attention": "attention (the same work in both models: a measure of the profiles' noise)",
}


def observations(result: dict) -> list[str]:
    """What the numbers say, in sentences built from them."""
    out, selects_seen = [], False
    dense = result.get("dense")
    if dense:
        s, mo, de = dense["shape"], dense["rows"]["moe"], dense["rows"]["dense"]
        pm, pd = mo["profile"], de["profile"]
        tokens = s["batch"] * s["seq"]
        selects = pm.get("select_backward_calls", 0) - pd.get("select_backward_calls", 0)
        per_expert_selects = selects >= 2 * s["num_layers"] * s["num_experts"]  # one per expert and grouped weight
        selects_seen = per_expert_selects
        fill = dict(fill=pm["fill_calls"], dense_fill=pd["fill_calls"], selects=selects, mm=pm["matmul_calls"],
                    dense_mm=pd["matmul_calls"], rows=tokens * s["top_k"] // s["num_experts"], tokens=tokens,
                    total=mo["parameters"], dense_total=de["parameters"], aten=pm["aten_calls"],
                    dense_aten=pd["aten_calls"])
        diff = sorted(((pm["ms"][k] - pd["ms"][k], k) for k in PROFILE_KINDS), reverse=True)
        ratio = dense["step_time_ratio_moe_over_dense"]
        gap = 1e3 * (mo["median_step_s"] - de["median_step_s"])
        out.append(
            f"Equal active parameters do not make an equal step on a CPU: the MoE step takes {ratio:.2f}x the dense "
            f"one ({gap:+,.0f} ms at the medians; CPU time per step {mo['median_cpu_s'] / de['median_cpu_s']:.2f}x), "
            f"although a token goes through as many weights in both (the MFU basis, "
            f"{mo['flops_per_token'] / 1e6:.1f} vs {de['flops_per_token'] / 1e6:.1f} MFLOP/token, is the same up to "
            f"the routers, so MFU falls by the same ratio: {100 * mo['mfu']:.2f}% vs {100 * de['mfu']:.2f}%).")
        why = {**WHY, **({"zero-fill, in-place add": WHY["zero-fill, in-place add (selects)"]}
                         if per_expert_selects else {})}
        parts = [f"{d:+,.1f} ms {why[k].format(**fill)}" for d, k in diff if d >= 0.5]
        out.append(f"Where the difference goes, by the profiled steps (MoE {pm['wall_ms']:,.0f} ms, dense "
                   f"{pd['wall_ms']:,.0f} ms; the profiler adds a little to every op, and the MoE step has more ops): "
                   + "; ".join(parts) + ".")
        less = [f"{d:+,.1f} ms {k}" for d, k in diff if d <= -0.5]
        if less:
            out.append("Kinds where the MoE step spent less (compare the profiles' noise, attention): "
                       + ", ".join(less) + ".")
    ep = result.get("ep")
    if ep and len(ep["rows"]) > 1:
        rows, base = ep["rows"], ep["rows"][0]
        split = [r for r in rows if r["ep"] > 1]
        out.append(
            f"EP 1 exchanges no tokens: every rank holds all {result['shape']['num_experts']} experts and their "
            "gradients are averaged with the rest of the model. With expert parallelism the ranks stand in the "
            "all-to-alls for " + ", ".join(f"{100 * r['a2a_share']:.0f}% (EP {r['ep']})" for r in split)
            + " of their step, forward and backward together (busiest rank "
            + ", ".join(f"{100 * r['a2a_share_max_rank']:.0f}%" for r in split) + "; least busy "
            + ", ".join(f"{100 * r['a2a_share_min_rank']:.0f}%" for r in split) + ").")
        out.append(
            "Most of that time is waiting for peers, not moving data: the process CPU time spent inside the "
            "all-to-alls (gloo's threads included) is " + ", ".join(f"{100 * r['a2a_cpu_share']:.0f}%"
                                                                    for r in split)
            + " of the step's CPU time, and the exchange of the token counts, "
            f"{result['shape']['num_experts']} integers before each dispatch, takes "
            + ", ".join(f"{1e3 * r['a2a_counts_s']:.0f} ms" for r in split)
            + " per step: the first collective of each MoE layer absorbs how far the ranks have drifted apart."
            + (f" With {ep['nproc']} single-thread processes on {result['machine']['logical_cpus']} cores every rank "
               "is off the CPU part of the time, so at each all-to-all some rank waits for a peer that is not "
               "running; on dedicated cores the share would come closer to the CPU-time share."
               if ep["nproc"] > (result["machine"]["logical_cpus"] or 1) else ""))
        sh = result["shape"]
        experts = sh["num_layers"] * sh["num_experts"] * 3 * sh["expert_ffn"] * sh["hidden_size"]
        out.append(
            "Step time relative to EP 1 (range over repeats): " + ", ".join(
                f"EP {r['ep']} {r['step_ratio_to_ep1']:.2f}x ({r['step_min_s'] / base['median_step_s']:.2f}-"
                f"{r['step_max_s'] / base['median_step_s']:.2f}x)" for r in split)
            + f"; CPU time per rank and step {1e3 * base['median_rank_step_cpu_s']:,.0f} ms at EP 1, "
            + ", ".join(f"{1e3 * r['median_rank_step_cpu_s']:,.0f} ms at EP {r['ep']}" for r in split)
            + ". A rank computes the same number of token copies on average at every EP (its E / EP experts "
            "serve the tokens of all EP ranks of its group); against the exchange, EP saves the work that grows "
            "with the experts a rank holds: the loop over experts (E / EP iterations of larger matmuls), "
            + ("the zero-filled full-size gradients of the grouped weights (part 1), " if selects_seen else "")
            + "AdamW and the gradient norm over E / EP experts instead of E, and the data-parallel average of the "
            f"experts' gradients: at EP 1 all {experts:,} expert parameters ({4 * experts / 2**20:,.0f} MiB in fp32) "
            f"are all-reduced over the {ep['nproc']} ranks every step, at EP e a rank's 1 / e of them over "
            f"{ep['nproc']} / e ranks: time in all_reduce per step " + ", ".join(
                f"{1e3 * r['all_reduce_s']:,.0f} ms at EP {r['ep']}" for r in rows) + ".")
        same = "identical" if ep["losses_identical"] else f"within {ep['max_loss_difference']:.1e}"
        out.append(f"The losses of every run agree ({same}): the layouts train the same model on the same samples.")
    return out


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Mixture of experts on the CPU - {result['date']}", "",
             f"`{result['command']}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; {m['platform']}"
             + (f"; {peaks_text(m)}" if peaks_text(m) else "") + f". Code: {describe_code(result['code'])}. The run "
             f"took {result['wall_s']:.0f} s; load average {result['load_avg_start']} at the start, "
             f"{result['load_avg_end']} at the end.", ""]
    if result.get("code_changed_during_run"):
        lines += [f"**dufu/ changed while this ran ({', '.join(result['code_changed_during_run'])}): processes "
                  "started before and after the change ran different code.**", ""]
    dense = result.get("dense")
    if dense:
        s, r = dense["shape"], dense["rows"]
        mo, de = r["moe"], r["dense"]
        lines += [
            "## MoE vs dense at equal active parameters (one process, fp32)", "",
            f"Shape: hidden {s['hidden_size']}, {s['num_layers']} layers, {s['num_attention_heads']} query / "
            f"{s['num_key_value_heads']} key-value heads, sequence {s['seq']}, byte vocabulary (384), batch "
            f"{s['batch']} x {s['seq']} = {s['batch'] * s['seq']:,} tokens per step, AdamW, gradient clipping 1.0. "
            f"MoE (`{mo['recipe']}` resized): {s['num_experts']} SwiGLU experts of {s['expert_ffn']} in every block, "
            f"top-{s['top_k']}. Dense (`{de['recipe']}` resized): SwiGLU of {s['top_k']} x {s['expert_ffn']} = "
            f"{s['top_k'] * s['expert_ffn']}. Torch threads: {dense['threads']}; {dense['warmup']} warm-up steps "
            f"each, then {dense['steps']} timed `Trainer.train_step` calls each, interleaved. The same samples in "
            f"the same order: {'yes' if dense['same_samples'] else '**no**'}.", "",
            "| model | parameters | active per token | matmul parameters per token (N) | MFLOP/token (6N + 12LHT) "
            "| median step (ms) | min-max (ms) | CPU ms/step | other load | tokens/s | MFU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for kind, label in (("moe", "MoE"), ("dense", "dense")):
            x = r[kind]
            lines.append(
                f"| {label} | {x['parameters']:,} | {x['active_parameters']:,} | {x['matmul_parameters_active']:,} "
                f"| {x['flops_per_token'] / 1e6:.1f} | {_f(1e3 * x['median_step_s'], 1)} | "
                f"{_f(1e3 * x['min_step_s'], 1)}-{_f(1e3 * x['max_step_s'], 1)} | {_f(1e3 * x['median_cpu_s'], 1)} | "
                f"{_f(100 * x['median_other_load']) + '%' if x['median_other_load'] is not None else '-'} | "
                f"{_f(x['tokens_per_s'])} | {100 * x['mfu']:.2f}% |")
        lines += ["", f"**MoE / dense step time: {dense['step_time_ratio_moe_over_dense']:.2f}x** "
                  f"(CPU time per step {mo['median_cpu_s'] / de['median_cpu_s']:.2f}x, fastest steps "
                  f"{mo['min_step_s'] / de['min_step_s']:.2f}x; tokens/s {mo['tokens_per_s'] / de['tokens_per_s']:.2f}x"
                  f"). MFU basis: {dense['peak_source']}. The MoE model holds "
                  f"{mo['parameters'] / de['parameters']:.2f}x the dense model's parameters "
                  f"({mo['matmul_parameters_total']:,} in matmuls vs {de['matmul_parameters_total']:,}) and uses "
                  f"{mo['active_parameters'] / de['active_parameters']:.4f}x its parameters per token (the routers).",
                  "", f"The shortest of {PROFILE_ROUNDS - 1} steps of each under `torch.profiler` (after one to "
                  "start it), ms by kind of op (self CPU time; between ops = the profiled step's wall time minus its "
                  "ops' time: Python, autograd and dispatch):", "",
                  "| kind | MoE (ms) | dense (ms) | MoE - dense (ms) |", "|---|---:|---:|---:|"]
        pm, pd = mo["profile"], de["profile"]
        for kind in PROFILE_KINDS:
            lines.append(f"| {kind} | {pm['ms'][kind]:,.1f} | {pd['ms'][kind]:,.1f} | "
                         f"{pm['ms'][kind] - pd['ms'][kind]:+,.1f} |")
        lines += [f"| **profiled step (wall)** | {pm['wall_ms']:,.1f} | {pd['wall_ms']:,.1f} | "
                  f"{pm['wall_ms'] - pd['wall_ms']:+,.1f} |",
                  f"| matmul calls per step | {pm['matmul_calls']} | {pd['matmul_calls']} | "
                  f"{pm['matmul_calls'] - pd['matmul_calls']:+} |",
                  f"| fill_ calls per step | {pm['fill_calls']} | {pd['fill_calls']} | "
                  f"{pm['fill_calls'] - pd['fill_calls']:+} |",
                  f"| aten calls per step | {pm['aten_calls']:,} | {pd['aten_calls']:,} | "
                  f"{pm['aten_calls'] - pd['aten_calls']:+,} |", ""]
        b = result.get("before")
        if b:
            now = before_summary(result, "")
            lines += [f"Against `{Path(b['path']).name}` (run {b['date']}, code: "
                      f"{describe_code(b['code']) if b.get('code') else 'not recorded'}), part 1 only; each run "
                      "interleaves its two models, so their ratios compare across runs:", "",
                      "| | before | this run |", "|---|---:|---:|",
                      f"| MoE / dense step time (medians) | {b['ratio']:.2f}x | {now['ratio']:.2f}x |",
                      f"| MoE / dense CPU time per step | {b['cpu_ratio']:.2f}x | {now['cpu_ratio']:.2f}x |",
                      f"| profiled step MoE - dense (ms) | {b['profile_moe_ms'] - b['profile_dense_ms']:+,.1f} | "
                      f"{now['profile_moe_ms'] - now['profile_dense_ms']:+,.1f} |",
                      f"| zero-fill, in-place add: MoE - dense (ms) | {b['zero_fill_ms']:+,.1f} | "
                      f"{now['zero_fill_ms']:+,.1f} |",
                      f"| MoE fill_ calls per step | {b['fill_calls']} | {now['fill_calls']} |",
                      f"| MoE SelectBackward0 nodes per step | {_f(b['selects'])} | {_f(now['selects'])} |", ""]
    ep = result.get("ep")
    if ep:
        lines += [
            f"## All-to-all share vs expert-parallel size ({ep['nproc']} processes, gloo)", "",
            f"`{ep['command']}` for EP = {', '.join(str(r['ep']) for r in ep['rows'])}; micro-batch "
            f"{ep['micro_batch']} per rank ({ep['nproc'] * ep['micro_batch']} x {result['shape']['seq']} tokens per "
            f"step), {ep['steps']} steps, the first {ep['warmup']} not counted, runs interleaved, {ep['repeats']} "
            f"repeat(s) each; every process runs one thread. **{ep['nproc']} processes on "
            f"{result['machine']['logical_cpus']} cores: the machine is oversubscribed, so read the ratios, not "
            "the absolute times.**", "",
            "| EP | step (ms) | vs EP 1 | all-to-all share of the step | busiest / least busy rank | all-to-all (ms) "
            "| token a2a fwd / bwd (ms) | count exchange (ms) | dispatch + combine fwd (ms) | CPU ms per rank-step | "
            "all-to-all CPU share | all_reduce (ms) | other load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in ep["rows"]:
            lines.append(
                f"| {row['ep']} | {_f(1e3 * row['median_step_s'])} ({_f(1e3 * row['step_min_s'])}-"
                f"{_f(1e3 * row['step_max_s'])}) | {row['step_ratio_to_ep1']:.2f}x | {100 * row['a2a_share']:.1f}% | "
                f"{100 * row['a2a_share_max_rank']:.1f}% / {100 * row['a2a_share_min_rank']:.1f}% | "
                f"{_f(row['a2a_ms'])} | "
                f"{_f(1e3 * row['a2a_forward_s'], 1)} / {_f(1e3 * row['a2a_backward_s'], 1)} | "
                f"{_f(1e3 * row['a2a_counts_s'], 1)} | {_f(1e3 * (row['dispatch_s'] + row['combine_s']), 1)} | "
                f"{_f(1e3 * row['median_rank_step_cpu_s'])} | "
                f"{100 * row['a2a_cpu_share']:.1f}% | {_f(1e3 * row['all_reduce_s'])} | "
                f"{_f(100 * row['other_load']) + '%' if row['other_load'] is not None else '-'} |")
        losses = ("identical" if ep["losses_identical"]
                  else f"not identical, largest difference {ep['max_loss_difference']:.2e}")
        lines += ["", "step = median `step_time_s` of `metrics.jsonl` (the slowest rank's step; in parentheses the "
                  "range over repeats); all-to-all share = (token all-to-alls in forward and backward + the "
                  "token-count exchanges) / the rank's own step (the trainer's hook points `on_step_start` to "
                  "`after_optimizer`), mean over ranks (busiest / least busy rank: the largest / smallest), median "
                  "over steps and repeats; all-to-all (ms) = share x step; the a2a, dispatch and CPU columns are the "
                  "mean rank's per step (dispatch + combine = the experts modules' forward pre-hooks and hooks: "
                  "`ExpertDispatch` with its bookkeeping, and the experts' data-parallel unit); CPU share = process CPU time inside the all-to-alls over "
                  "the step's; all_reduce = time in `torch.distributed.all_reduce` (the data-parallel gradient "
                  "average, blocking under `replicate`, and the loss, norm and target-count reductions; mean rank); "
                  "other load = the share of the machine's CPU time other processes used during the run. Losses of "
                  f"all runs: {losses}.", ""]
    if result.get("observations"):
        lines += ["## Observations", "", *[f"* {o}" for o in result["observations"]], ""]
    return "\n".join(lines)


def plot(ep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ep["rows"]
    labels = [f"ep {r['ep']}" for r in rows]
    a2a = [r["a2a_ms"] for r in rows]
    rest = [1e3 * r["median_step_s"] - a for r, a in zip(rows, a2a)]
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ax.bar(labels, rest, color="tab:blue", label="rest of the step")
    ax.bar(labels, a2a, bottom=rest, color="tab:orange", label="all-to-all (forward + backward + counts)")
    for i, r in enumerate(rows):
        ax.text(i, 1e3 * r["median_step_s"], f"{100 * r['a2a_share']:.0f}%", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("median step time (ms)")
    ax.set_ylim(0, 1.35e3 * max(r["median_step_s"] for r in rows))
    ax.set_title(f"MoE step time vs expert-parallel size\n(dp {ep['nproc']}, gloo, {ep['nproc']} processes on "
                 f"{os.cpu_count()} cores: ratios only)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
