#!/usr/bin/env bash
# The GPU check, run on an H100/H200: correctness tests, benchmarks and the dense/peer anchors, then
# bench/results/h200.json (SPEC.md "Results file") and a short table printed last.
#
#   scripts/gpu_check.sh [BIN_DIR]
#
# BIN_DIR holds prebuilt flashmsa_gpu_tests and flashmsa_bench (default: build/, built here if
# missing). The commit measured is read from BIN_DIR/COMMIT when present (binaries built elsewhere),
# else from git. Results go to $RESULTS_DIR (default bench/results) as h200.json plus raw logs.
# Environment: SEQLENS (default 8192,32768,131072,524288), CONFIGS (default paper,specialized),
# ANCHORS=0 to skip the torch anchors.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${1:-$root/build}"
results_dir="${RESULTS_DIR:-$root/bench/results}"
seqlens="${SEQLENS:-8192,32768,131072,524288}"
configs="${CONFIGS:-paper,specialized}"
mkdir -p "$results_dir"
raw="$results_dir/raw"
mkdir -p "$raw"

if [[ ! -x "$bin_dir/flashmsa_gpu_tests" ]]; then
  bash "$root/scripts/build.sh" --target flashmsa_gpu_tests flashmsa_bench || exit 1
  bin_dir="$root/build"
fi
if [[ -f "$bin_dir/COMMIT" ]]; then
  commit="$(cat "$bin_dir/COMMIT")"
else
  commit="$(git -C "$root" rev-parse HEAD)"
fi
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "gpu_check: $gpu, commit $commit"

echo "== GPU tests"
"$bin_dir/flashmsa_gpu_tests" --gtest_output="json:$raw/gpu_tests.json" >"$raw/gpu_tests.log" 2>&1
tests_rc=$?
tail -n 5 "$raw/gpu_tests.log"

echo "== flashmsa benchmarks"
"$bin_dir/flashmsa_bench" --configs "$configs" --seqlens "$seqlens" \
  --out "$raw/flashmsa_rows.json" 2>&1 | tee "$raw/bench.log"

anchor_rows=()
if [[ "${ANCHORS:-1}" != "0" ]]; then
  echo "== anchors (torch)"
  PYTHONUNBUFFERED=1 python3 "$root/bench/anchors.py" --seqlens "$seqlens" \
    --out "$raw/anchor_rows.json" 2>&1 | tee "$raw/anchors.log"
  [[ -f "$raw/anchor_rows.json" ]] && anchor_rows=("$raw/anchor_rows.json")
fi

python3 "$root/bench/results.py" --commit "$commit" --gpu "$gpu" \
  --tests "$raw/gpu_tests.json" --rows "$raw/flashmsa_rows.json" "${anchor_rows[@]}" \
  --out "$results_dir/h200.json"
exit $tests_rc
