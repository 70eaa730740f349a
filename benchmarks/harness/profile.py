"""Where a step's time goes: a profiled training step split into matmul, attention, loss, norms/elementwise,
optimizer, casts, communication and other, by rules on the names of each op and the ops and autograd nodes it
runs inside (:data:`PROFILE_RULES`). Shared by ``benchmarks/train_step.py --profile`` and
``benchmarks/finetune.py --profile``: each profiled step runs inside ``record_function(STEP_REGION)``.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

# Each profiled step runs inside record_function(STEP_REGION); a hand-written loop's clip + optimizer.step +
# zero_grad inside record_function(OPTIMIZER_REGION) (dufu's update is found through torch's own
# "Optimizer.step#..." regions and the names of the gradient-clipping ops: the benchmarks change no dufu code).
STEP_REGION = "benchmark.step"
OPTIMIZER_REGION = "benchmark.optimizer"
PROFILE_CATEGORIES = ("matmul", "attention", "loss", "norms/elementwise", "optimizer", "casts", "communication",
                      "other")
PROFILE_RULES = """\
Every profiled event's *self* CPU time (its time minus that of the ops it called; the step region's own self
time is the Python and framework time between ops) goes to exactly one category, so the categories add up to
the profiled step. An event is judged by its own name and the names of the events it runs inside (its
ancestors, which include the autograd nodes of backward, e.g. `MmBackward0`), by the first rule that holds:

1. optimizer: inside the benchmark's optimizer region, or torch's `Optimizer.step#...` / `Optimizer.zero_grad#...`
   regions, or a gradient-clipping op (`_foreach_*`, `linalg_vector_norm`), which dufu runs outside them;
2. communication: inside a `c10d::` / `gloo:` / `nccl:` / `record_param_comms` op (zero on one process);
3. casts: inside `aten::to` / `_to_copy` / `_autocast_to_*` / `type_as` or a `ToCopyBackward0` node: autocast's
   casts of weights and activations, and the fp32 cast of the logits for the loss (its copy_ is counted here);
4. attention: inside `scaled_dot_product_attention` or its backward node (every kernel SDPA dispatches to, math
   fallback included); without SDPA, `bmm`/`baddbmm`, `softmax`/`_softmax` and their backward nodes
   (`BmmBackward0`, `SoftmaxBackward0`): in these models a batched matmul only occurs in attention (a linear
   layer on (B, T, C) runs as one `mm`) and the only plain softmax is attention's (the loss takes `log_softmax`);
   the masking and scaling around an eager attention are elementwise and fall under norms/elementwise;
5. loss: inside `cross_entropy`, `log_softmax`, `nll_loss`, `logsumexp` or their backward nodes (the softmax
   over the vocabulary), or a custom autograd function whose name says cross entropy, except the matmuls such a
   fused loss runs itself, which stay matmul;
6. matmul / norms/elementwise: the nearest of the event and its ancestors named as a matmul (`mm`, `addmm`,
   `bmm`, `linear`, `matmul`, ... and `MmBackward0`-style nodes: a bias gradient's `sum` under
   `AddmmBackward0` is matmul) or as a norm / activation / dropout / arithmetic op (`layer_norm`, `gelu`,
   `dropout`, `add`, `mul`, `div`, `tanh`, `where`, ... and their backward nodes);
7. other: the rest: embedding lookups and their backward, views, copies for `contiguous`, gradient
   accumulation, `.item()` syncs, the Python between ops.

Self CPU time is measured on the thread that runs the op: on a CPU this is the step's wall time (intra-op
threads work inside an op's time); on CUDA it is host time, not kernel time."""

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "addmv", "mv", "dot", "_addmm_activation",
           "mmbackward0", "addmmbackward0", "linearbackward0", "matmulbackward0", "addmvbackward0", "mvbackward0"}
_ELEMENTWISE = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "pow", "rsqrt", "sqrt", "exp",
                "where", "masked_fill", "masked_fill_", "addcmul", "addcdiv", "clamp", "clamp_min", "threshold_backward",
                "rsub", "reciprocal", "abs", "fill_", "zero_", "mean", "var_mean", "erf"}
_ELEMENTWISE_NODES = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "where", "maskedfill",
                      "rsub", "mean", "clamp", "erf"}
_NORM_WORDS = ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gelu", "dropout", "tanh", "silu", "relu",
               "sigmoid")
_CASTS = {"to", "_to_copy", "_autocast_to_reduced_precision", "_autocast_to_full_precision", "type_as",
          "tocopybackward0"}
_ATTENTION_OPS = {"bmm", "baddbmm", "softmax", "_softmax", "_softmax_backward_data", "bmmbackward0",
                  "baddbmmbackward0", "softmaxbackward0"}
_LOSS_PREFIXES = ("cross_entropy", "log_softmax", "_log_softmax", "nll_loss", "logsumexp", "logsoftmaxbackward",
                  "nlllossbackward", "logsumexpbackward")


def _base(name: str) -> str:
    """``aten::native_layer_norm`` -> ``native_layer_norm``; ``autograd::engine::evaluate_function: MmBackward0``
    -> ``mmbackward0``."""
    name = name.split("evaluate_function: ", 1)[-1]
    for prefix in ("aten::", "torch::autograd::"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.strip().lower()


def _is_optimizer(name: str, base: str) -> bool:
    return (name == OPTIMIZER_REGION or name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))
            or base.startswith("_foreach_") or base == "linalg_vector_norm")


def _is_communication(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms", "ProcessGroup"))


def _is_matmul(base: str) -> bool:
    return base in _MATMUL


def _is_norm_or_elementwise(base: str) -> bool:
    if any(w in base for w in _NORM_WORDS) or base in _ELEMENTWISE:
        return True
    return base.endswith("backward0") and base[: -len("backward0")] in _ELEMENTWISE_NODES


def categorize(names: list[str]) -> str:
    """The category of an event from its own name followed by its ancestors' (innermost first); see
    PROFILE_RULES."""
    bases = [_base(n) for n in names]
    if any(_is_optimizer(n, b) for n, b in zip(names, bases)):
        return "optimizer"
    if any(_is_communication(n) for n in names):
        return "communication"
    if any(b in _CASTS for b in bases):
        return "casts"
    if any("scaled_dot_product" in b or "scaleddotproduct" in b or b in _ATTENTION_OPS for b in bases):
        return "attention"
    if any(b.startswith(_LOSS_PREFIXES) or "crossentropy" in b.replace("_", "") for b in bases):
        return "matmul" if _is_matmul(bases[0]) else "loss"
    for b in bases:
        if _is_matmul(b):
            return "matmul"
        if _is_norm_or_elementwise(b):
            return "norms/elementwise"
    return "other"


def step_breakdown(events, num_steps: int) -> dict:
    """Milliseconds per step by category, from profiler ``events`` (``prof.events()``) of ``num_steps`` steps each
    run inside ``record_function(STEP_REGION)``. Events on other threads (CUDA's autograd thread) count when they
    start inside a step. Returns ``{"ms": {category: ms}, "total_ms", "step_wall_ms", "top_other": [(op, ms)],
    "top_ops": [[op, category, ms]]}``: ``total_ms`` is the sum of the categories, ``step_wall_ms`` the mean
    duration of the step regions, ``top_ops`` the 15 ops with the most self time."""
    steps = [e for e in events if e.name == STEP_REGION]
    if len(steps) != num_steps:
        raise ValueError(f"found {len(steps)} '{STEP_REGION}' regions in the profile, expected {num_steps}: run "
                         f"each profiled step inside record_function('{STEP_REGION}')")
    windows = [(e.time_range.start, e.time_range.end) for e in steps]
    step_ids = {id(e) for e in steps}
    ms = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    other: dict[str, float] = {}
    ops: dict[tuple[str, str], float] = {}
    for e in events:
        chain, node = [], e
        while node is not None:
            chain.append(node)
            node = node.cpu_parent
        root = chain[-1]
        inside = id(root) in step_ids or (
            root.thread != steps[0].thread and any(a <= e.time_range.start < b for a, b in windows))
        if not inside:
            continue
        names = [n.name for n in chain if id(n) not in step_ids]
        cat = categorize(names) if names else "other"
        t = e.self_cpu_time_total / 1e3 / num_steps  # us -> ms per step
        ms[cat] += t
        op = e.name if names else "(Python and framework between ops)"
        ops[(op, cat)] = ops.get((op, cat), 0.0) + t
        if cat == "other":
            key = "(Python and framework between ops)" if not names else e.name
            other[key] = other.get(key, 0.0) + t
    top = sorted(other.items(), key=lambda kv: -kv[1])[:5]
    top_ops = [[op, cat, t] for (op, cat), t in sorted(ops.items(), key=lambda kv: -kv[1])[:15]]
    return {"ms": ms, "total_ms": sum(ms.values()),
            "step_wall_ms": sum(b - a for a, b in windows) / 1e3 / num_steps, "top_other": top, "top_ops": top_ops}


def profile_steps(runner, num_steps: int, device: torch.device) -> dict:
    """``num_steps`` steps of ``runner`` under torch.profiler (CPU activities, no shapes), broken down."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(num_steps):
            with record_function(STEP_REGION):
                runner.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    return step_breakdown(prof.events(), num_steps)


def profile_table(impls: list[str], breakdowns: dict) -> str:
    """One table for one dtype: categories down, implementations across (ms/step and share)."""
    head = "| category | " + " | ".join(f"{n} ms/step | {n} share" for n in impls) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(impls)]
    for cat in PROFILE_CATEGORIES:
        cells = []
        for n in impls:
            b = breakdowns[n]
            cells.append(f"{b['ms'][cat]:,.1f} | {b['ms'][cat] / b['total_ms']:.1%}")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| **total (sum)** | " + " | ".join(f"**{breakdowns[n]['total_ms']:,.1f}** | 100%" for n in impls)
                 + " |")
    lines.append("| profiled step, wall | " + " | ".join(f"{breakdowns[n]['step_wall_ms']:,.1f} | " for n in impls)
                 + " |")
    return "\n".join(lines)


def top_other_lines(impls: list[str], breakdowns: dict) -> list[str]:
    return [f"{n}: largest in other: " + ", ".join(f"{op} {t:,.1f} ms" for op, t in breakdowns[n]["top_other"])
            for n in impls]
