"""Generation within a memory budget: a decoder about 3x the budget, streamed from its memory-mapped safetensors,
against the same model loaded whole, side by side in one run.

    python benchmarks/streaming.py            # GPT and LLaMA of ~1.2 GB fp32, 32 new tokens: a few minutes
    python benchmarks/streaming.py --quick    # ~100 MB models, 8 tokens: a smoke run of the script

**Models.** One GPT-2 (vocabulary 8,192, hidden 1,536, 10 blocks, 12 heads, tied head) and one LLaMA (vocabulary
8,192, hidden 1,536, SwiGLU 4,096, 12 heads with 4 key-value heads, 12 blocks, untied head), each about 1.2 GB in
fp32, built by dufu with its family's initialisation (GPT-2: N(0, 0.02), residual projections scaled by
1/sqrt(2 x layers); LLaMA: N(0, 0.02)) under a fixed seed and written with ``dufu.save_pretrained`` to a temporary
Hugging Face directory (one ``model.safetensors``, just written, so in the page cache: the runs read it from
memory, not from the disk). GPT-2's file is converted once into dufu's layout (``plan_streaming`` does it, timed
as "prepared"; see dufu/engine/inference/streaming_source.py); LLaMA's is read in place.

**Settings**, each in a fresh subprocess (``--worker``) with ``--threads`` threads (default 1):

* ``unbounded`` -- ``dufu.from_pretrained(dir)``, the usual load of the whole model;
* ``1/3`` and ``1/2`` -- ``load_streaming(dir, budget)`` with a budget of a third and a half of the model's
  parameter bytes, reserving the KV cache and activations of one sequence of prompt + new tokens
  (``max_tokens``);
* a *runtime* run per family: ``unbounded`` on the same family with one block of hidden size 64, whose memory is
  what any run holds besides the model (interpreter, torch, kernels' scratch, allocator).

Each worker generates ``--tokens`` tokens greedily from the same random ``--prompt-len``-token prompt
(``dufu.engine.inference.generate.generate``, KV cache), after one untimed 2-token warm-up generation.

**Columns.** tokens/s: new tokens over the wall time of the timed ``generate`` call (prompt pass included).
Memory, from the kernel's counters of the worker process: *anon* is ``RssAnon`` of ``/proc/self/status``
(process-private memory: the tensors the process allocated), *file* is ``RssFile`` (pages of mapped files: the
safetensors map, clean page-cache pages the kernel can drop and read again, and the shared libraries); both are
sampled after loading and after every block's forward (a hook that runs before a streamed block's weights are
dropped), and the largest samples are reported, minus the runtime run's. The budget covers the model's tensors, so
"anon - runtime" plus "file - runtime" is the number to hold against it. *VmHWM* is the kernel's own high-water
mark of the total RSS (anon + file + shmem) over the whole process, loading included. ``/proc/self/smaps_rollup``
at the end is in the JSON (Rss, Pss, Private_Clean/Dirty, Shared_Clean, Anonymous). Tokens equal: the generated
tokens equal the unbounded run's.

Results go to ``benchmarks/results/streaming-<YYYY-MM-DD>.json`` and ``.md`` with the CPU model (not for
``--quick`` unless ``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, proc, results as results_files

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's dufu, whatever else is installed
MiB = 1024 * 1024

MODELS = {
    "gpt": ("GPTModel", dict(vocab_size=8192, hidden_size=1536, num_layers=10, num_attention_heads=12,
                             max_position_embeddings=1024)),
    "llama": ("LlamaModel", dict(vocab_size=8192, hidden_size=1536, num_layers=12, num_attention_heads=12,
                                 num_key_value_heads=4, ffn_hidden_size=4096, max_position_embeddings=1024)),
}
QUICK_MODELS = {
    "gpt": ("GPTModel", dict(vocab_size=4096, hidden_size=512, num_layers=8, num_attention_heads=8,
                             max_position_embeddings=256)),
    "llama": ("LlamaModel", dict(vocab_size=4096, hidden_size=512, num_layers=8, num_attention_heads=8,
                                 num_key_value_heads=4, ffn_hidden_size=1408, max_position_embeddings=256)),
}
SETTINGS = {"unbounded": None, "1/3": 1 / 3, "1/2": 1 / 2}


# ============================================================================= worker
def status() -> dict:
    """The RSS counters of this process in KiB (``/proc/self/status``)."""
    counters = proc.status()
    return {k: counters[k] for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem") if k in counters}


def worker(directory: str, budget: int, prompt_len: int, tokens: int, out_path: str) -> int:
    import torch

    from dufu.engine.inference.generate import generate
    from dufu.engine.weights.pretrained import from_pretrained
    from dufu.engine.inference.streaming import load_streaming

    baseline = status()
    start = time.perf_counter()
    if budget:
        model = load_streaming(directory, budget, max_tokens=prompt_len + tokens)
    else:
        model = from_pretrained(directory).eval()
    load_s = time.perf_counter() - start
    after_load = status()
    peaks = {"RssAnon": after_load["RssAnon"], "RssFile": after_load["RssFile"], "VmRSS": after_load["VmRSS"]}

    def sample(*_):  # after a block's forward, before a streamed block's weights are dropped (prepended hook)
        s = status()
        for k in peaks:
            peaks[k] = max(peaks[k], s[k])

    for block in model.blocks.values():
        block.register_forward_hook(sample, prepend=True)
    prompt = torch.randint(0, model.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    generate(model, prompt, 2, temperature=0)  # warm-up: kernels, allocator
    start = time.perf_counter()
    out = generate(model, prompt, tokens, temperature=0)
    gen_s = time.perf_counter() - start
    plan = getattr(model, "streaming_plan", None)
    record = {
        "budget": budget, "load_s": load_s, "generate_s": gen_s, "tokens_per_s": tokens / gen_s,
        "tokens": out[0, prompt_len:].tolist(), "baseline_kib": baseline, "after_load_kib": after_load,
        "peak_generation_kib": peaks, "end_kib": status(), "smaps_rollup_end_kib": proc.smaps_rollup(),
        "threads": torch.get_num_threads(),
        "plan": None if plan is None else {
            "resident_blocks": list(plan.resident_blocks), "streamed_blocks": list(plan.streamed_blocks),
            "resident_bytes": plan.resident_bytes, "streaming_bytes": plan.streaming_bytes,
            "kv_cache_bytes": plan.kv_cache_bytes, "activation_bytes": plan.activation_bytes,
            "minimum_bytes": plan.minimum_bytes, "describe": plan.describe()},
    }
    Path(out_path).write_text(json.dumps(record, indent=1))
    return 0


# ============================================================================= parent
def build(spec: tuple, directory: Path) -> int:
    """The model with its family's initialisation, saved as a Hugging Face directory; its parameter bytes."""
    import torch

    import dufu.models.gpt as gpt
    import dufu.models.llama as llama
    from dufu.models.hub import save_pretrained

    cls = {"GPTModel": gpt.GPTModel, "LlamaModel": llama.LlamaModel}[spec[0]]
    torch.manual_seed(0)
    model = cls(**spec[1])
    save_pretrained(model, directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def runtime_spec(spec: tuple) -> tuple:
    """The runtime baseline: the same family, vocabulary and context with one block of hidden size 64."""
    kw = {**spec[1], "hidden_size": 64, "num_layers": 1, "num_attention_heads": 4}
    if "ffn_hidden_size" in kw:
        kw.update(ffn_hidden_size=172, num_key_value_heads=2)
    return spec[0], kw


def run_worker(directory: Path, budget: int, args, out: Path) -> dict:
    env = launch.job_env(threads=args.threads)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(directory), str(budget),
           str(args.prompt_len), str(args.tokens), str(out)]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if job.returncode != 0:
        return {"budget": budget, "error": (job.stderr or job.stdout)[-2000:]}
    return json.loads(out.read_text())


def mib(kib: float) -> str:
    return f"{round(kib / 1024):,}"


def table(rows: list[dict]) -> list[str]:
    out = ["| model | setting | budget MiB | blocks resident / streamed | anon MiB | file MiB | RSS MiB | "
           "RSS <= budget | VmHWM MiB | load s | tokens/s | tokens equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['family']} {r['model_mib']:,.0f} MiB | {r['setting']} | "
        if "error" in r:
            out.append(head + f"- | error: {r['error'].strip().splitlines()[-1][:150]} | | | | | | | | |")
            continue
        peak, base = r["peak_generation_kib"], r["runtime_peak_kib"]
        plan = r["plan"]
        blocks = (f"{len(plan['resident_blocks'])} / {len(plan['streamed_blocks'])}" if plan
                  else f"{r['num_layers']} / 0")
        budget = f"{r['budget'] / MiB:,.0f}" if r["budget"] else "-"
        rss = peak["VmRSS"] - base["VmRSS"]
        within = ("yes" if rss * 1024 <= r["budget"] else "NO") if r["budget"] else "-"
        out.append(head + f"{budget} | {blocks} | {mib(peak['RssAnon'] - base['RssAnon'])} | "
                   f"{mib(peak['RssFile'] - base['RssFile'])} | {mib(rss)} | {within} | {mib(r['end_kib']['VmHWM'])} | "
                   f"{r['load_s']:.1f} | {r['tokens_per_s']:.2f} | {'yes' if r['equal'] else 'NO'} |")
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        d, budget, prompt_len, tokens, out = argv[1:6]
        return worker(d, int(budget), int(prompt_len), int(tokens), out)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~100 MB models, 8 tokens: a smoke run")
    p.add_argument("--families", default="gpt,llama", help="comma-separated: gpt, llama")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per run (default 32; --quick: 8)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (default 1: on a shared 2-core machine OpenMP's barriers make "
                        "the many small ops of one-token steps erratic)")
    p.add_argument("--results-dir", default=None,
                   help="where the dated .json/.md go (default benchmarks/results; --quick: none unless given)")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (8 if args.quick else 32)
    models = QUICK_MODELS if args.quick else MODELS
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in families if f not in models]
    if bad:
        p.error(f"--families {bad}: use gpt, llama")
    results_dir = results_files.results_dir(args.results_dir, args.quick)

    started = _dt.datetime.now()
    info = machine.describe(threads_per_worker=args.threads, memory_total_kib=proc.meminfo_kib("MemTotal"))
    load_start = os.getloadavg()
    print(f"streaming benchmark: {info['cpu']}, {args.threads} thread(s) per worker; load average "
          f"{load_start[0]:.1f}", flush=True)
    from dufu.engine.inference.streaming import plan_streaming

    rows = []
    with tempfile.TemporaryDirectory(prefix="dufu-streaming-") as tmp:
        os.environ["DUFU_CACHE_DIR"] = str(Path(tmp) / "cache")  # conversions land here (and are removed)
        for family in families:
            spec = models[family]
            build(runtime_spec(spec), Path(tmp) / f"{family}-runtime")
            runtime = run_worker(Path(tmp) / f"{family}-runtime", 0, args, Path(tmp) / f"{family}-runtime.json")
            if "error" in runtime:
                raise SystemExit(f"the runtime baseline of {family} failed:\n{runtime['error']}")
            directory = Path(tmp) / family
            model_bytes = build(spec, directory)
            start = time.perf_counter()
            plan = plan_streaming(directory, model_bytes)  # converts GPT-2's layout once, into DUFU_CACHE_DIR
            prepare_s = time.perf_counter() - start
            print(f"{family}: {model_bytes / MiB:,.0f} MiB of fp32 parameters; streamed from {plan.directory} "
                  f"(prepared in {prepare_s:.1f} s); runtime baseline peak anon "
                  f"{mib(runtime['peak_generation_kib']['RssAnon'])} MiB", flush=True)
            reference = None
            for setting, fraction in SETTINGS.items():
                budget = 0 if fraction is None else int(model_bytes * fraction)
                r = run_worker(directory, budget, args, Path(tmp) / f"{family}-{setting.replace('/', '_')}.json")
                r.update(family=family, setting=setting, model_mib=model_bytes / MiB, model_bytes=model_bytes,
                         num_layers=spec[1]["num_layers"], model_kwargs=spec[1], prepare_s=prepare_s,
                         converted=plan.directory != str(directory),
                         runtime_peak_kib=runtime["peak_generation_kib"], runtime_kwargs=runtime_spec(spec)[1])
                if "error" in r:
                    print(f"  {setting:>9}: failed\n{r['error']}", flush=True)
                else:
                    reference = r["tokens"] if fraction is None else reference
                    r["equal"] = r["tokens"] == reference
                    print(f"  {setting:>9}: {r['tokens_per_s']:.2f} tokens/s, peak anon "
                          f"{mib(r['peak_generation_kib']['RssAnon'])} MiB, file "
                          f"{mib(r['peak_generation_kib']['RssFile'])} MiB, VmHWM {mib(r['end_kib']['VmHWM'])} MiB, "
                          f"equal {r['equal']}", flush=True)
                rows.append(r)
    wall = (_dt.datetime.now() - started).total_seconds()
    info["load_average_at_start"] = [round(x, 2) for x in load_start]
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    md = report_md(args, argv, rows, info, started, wall)
    print("\n" + md)
    if results_dir is not None:
        stem = results_files.stem(results_dir, "streaming", f"{started:%Y-%m-%d}")
        payload = {"benchmark": "streaming", "date": started.isoformat(timespec="seconds"),
                   "command": "python benchmarks/streaming.py " + " ".join(argv), "machine": info,
                   "prompt_len": args.prompt_len, "tokens": args.tokens, "runs": rows, "wall_seconds": wall}
        results_files.write(stem, payload, md)
        print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 0


def report_md(args, argv, rows, info, started, wall) -> str:
    out = [f"# streaming benchmark, {started:%Y-%m-%d}", "",
           "`python benchmarks/streaming.py" + (" " + " ".join(argv) if argv else "") + "`", "",
           f"{info['cpu']}; {info['logical_cpus']} logical CPUs, {args.threads} thread(s) per worker; torch "
           f"{info['torch']}; {info['memory_total_kib'] / 1024 ** 2:.1f} GiB RAM; {machine.peaks_text(info)}; load "
           f"average {info['load_average_at_start'][0]:.1f} at start, {info['load_average_at_end'][0]:.1f} at end; "
           f"{wall:.0f} s in all.", "",
           f"Greedy generation of {args.tokens} tokens from a {args.prompt_len}-token prompt, batch 1, fp32; one "
           "fresh process per row. Budgets: a third and a half of the model's parameter bytes (1 MiB = 2^20 bytes). "
           "anon = RssAnon (process-private memory), file = RssFile (mapped file pages: the safetensors map, which "
           "is page cache), RSS = VmRSS (their sum): the peaks of samples taken after loading and after every "
           "block's forward, each minus the same peak of a run of the family with one block of hidden size 64 (the "
           "runtime: interpreter, torch, kernels' scratch, allocator); VmHWM = the kernel's peak total RSS over the "
           "whole process, loading included, runtime not subtracted. See the docstring of "
           "benchmarks/streaming.py.", ""]
    out += table(rows)
    for family in dict.fromkeys(r["family"] for r in rows):
        r = next(r for r in rows if r["family"] == family)
        how = ("converted once into dufu's layout, block by block (GPT-2 stores its Conv1D weights transposed "
               "and Q, K, V fused)" if r["converted"] else "read in place (stored as dufu holds them)")
        out += ["", f"{family}: streamed from safetensors {how}, in {r['prepare_s']:.1f} s; runtime baseline peak "
                f"anon {mib(r['runtime_peak_kib']['RssAnon'])} MiB, file {mib(r['runtime_peak_kib']['RssFile'])} MiB."]
    plans = [r for r in rows if "error" not in r and r.get("plan")]
    if plans:
        out += ["", "What each budget reserved (`model.streaming_plan.describe()`):", ""]
        out += [f"* {r['family']} {r['setting']}: {r['plan']['describe']}" for r in plans]
    if args.quick:
        out += ["", "**`--quick`: small models and few tokens, a smoke run of the script.**"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
