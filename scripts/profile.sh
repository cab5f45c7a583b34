#!/usr/bin/env bash
# Nsight Compute profile of the main kernels, run on an H100/H200: one launch of each kernel of the
# forward and backward on one problem, with the figures docs/design.md reasons from (duration,
# DRAM bytes and rate, L2 hit rate, issue slots, the largest warp stall reasons).
#
#   scripts/profile.sh [BIN_DIR]
#
# BIN_DIR holds a prebuilt flashmsa_bench (default: build/, built here if missing). Environment:
# CONFIG (default paper), SEQLEN (default 32768: two query chunks, the first one profiled), PATTERN
# (default random), KERNELS (default "forward_tile combine backward_tile proxy_grads": names from
# the table below), NCU (default ncu). Reports go to $RESULTS_DIR/profile (default
# bench/results/raw/profile) as one CSV per kernel; a table of all of them is printed last
# (bench/profile_table.py). Kernel replay restores memory and flushes the caches between passes,
# so each kernel is measured cold, alone, at the profiler's clocks (durations read ≈ 5–10% longer
# than in the benchmarks).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/prebuilt.sh"
bin_dir="$(prebuilt_dir "${1:-$root/build}" flashmsa_bench)" || exit 1
out="${RESULTS_DIR:-$root/bench/results/raw}/profile"
mkdir -p "$out"
ncu="${NCU:-ncu}"
if ! command -v "$ncu" >/dev/null; then
  echo "profile: $ncu not found (Nsight Compute's CLI; NCU names another path)" >&2
  exit 1
fi

# name | bench stage that launches it | kernel-name regex
kernel_table=(
  "forward_tile|forward|sparse_forward_pipelined"
  "combine|forward|sparse_forward_combine"
  "backward_tile|backward|backward_pipelined"
  "proxy_grads|backward|proxy_grads_kernel"
)
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
          --section Occupancy --section LaunchStats)
metrics="dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct"

status=0
reports=()
for wanted in ${KERNELS:-forward_tile combine backward_tile proxy_grads}; do
  entry=""
  for row in "${kernel_table[@]}"; do
    [[ "${row%%|*}" == "$wanted" ]] && entry="$row"
  done
  if [[ -z "$entry" ]]; then
    echo "profile: unknown kernel name $wanted" >&2
    status=1
    continue
  fi
  IFS='|' read -r name stage regex <<<"$entry"
  report="$out/$name.csv"
  "$ncu" --kernel-name "regex:$regex" --launch-count 1 "${sections[@]}" --metrics "$metrics" \
    --csv --page raw --print-units base \
    "$bin_dir/flashmsa_bench" --stages "$stage" --configs "${CONFIG:-paper}" \
    --patterns "${PATTERN:-random}" --seqlens "${SEQLEN:-32768}" --repeats 1 \
    --out "$out/$name.rows.json" >"$report" 2>"$out/$name.log"
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "profile: $name: ncu exited with $rc (see $out/$name.log)" >&2
    status=1
  fi
  reports+=("$name=$report")
done
python3 "$root/bench/profile_table.py" "${reports[@]}" || status=1
exit $status
