#!/usr/bin/env bash
# The test suite's time as CI sees it: a fresh clone of this checkout's HEAD, `bash .ci/run` (the README's test
# command) under /usr/bin/time, its whole output kept with the CPU model, the load before and after and the
# commit, in benchmarks/results/suite-DATE[-LABEL].txt (the README's suite time names that file).
#
#   bash benchmarks/suite_time.sh              # this CPU as it is
#   bash benchmarks/suite_time.sh avx2         # this CPU limited to AVX2 (no AVX-512, AMX or AVX512-BF16): the
#                                              # slowest CPU CI meets (an AVX2-only EPYC) as closely as a faster one
#                                              # can; bf16 matmuls drop to ~1 GFLOP/s as there
# Run it on an otherwise idle machine: a figure measured under load is not the suite's time.
set -euo pipefail
label="${1:-}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
git clone -q "$repo" "$work/clone"
# A fresh machine has no compiled kernels: torch.compile's caches (Inductor's, Triton's) start empty in the run's
# own directory instead of reusing /tmp/torchinductor_$USER from earlier runs.
export TORCHINDUCTOR_CACHE_DIR="$work/inductor" TRITON_CACHE_DIR="$work/triton"
if [ "$label" = "avx2" ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
out="$repo/benchmarks/results/suite-$(date -u +%F)${label:+-$label}.txt"
{
  echo "# dufu test suite: bash .ci/run on a fresh clone"
  echo "commit:    $(git -C "$repo" rev-parse HEAD)"
  echo "cpu:       $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) ($(nproc) cores)"
  echo "isa limit: $([ "$label" = avx2 ] && echo avx2 || echo none)${label:+ (label: $label)}"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "started:   $(date -u +%FT%TZ)"
} > "$out.head"
# CPU time of the whole machine (all cores, /proc/stat): how busy the suite kept the cores, from the busy and total
# jiffies before and after (idle + iowait count as idle).
cpu_jiffies() { awk '/^cpu /{idle=$5+$6; t=0; for(i=2;i<=NF;i++) t+=$i; print t-idle, t}' /proc/stat; }
read -r busy0 total0 < <(cpu_jiffies)
start=$(date +%s)
set +e
(cd "$work/clone" && bash .ci/run) > "$out.body" 2>&1
rc=$?
set -e
end=$(date +%s)
read -r busy1 total1 < <(cpu_jiffies)
{
  cat "$out.head"
  echo "ended:     $(date -u +%FT%TZ)"
  echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "exit code: $rc"
  echo "wall time: $((end - start)) s (install and tests)"
  echo "cpu busy:  $(( 100 * (busy1 - busy0) / (total1 - total0) ))% of $(nproc) cores over the run"
  echo
  cat "$out.body"
} > "$out"
rm -f "$out.head" "$out.body"
rm -rf "$work"
# The clone's editable install pointed `dufu` at the clone: point it back here.
pip install -q --no-deps -e "$repo"
echo "$out: exit $rc, $((end - start)) s"
exit $rc
