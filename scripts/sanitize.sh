#!/usr/bin/env bash
# compute-sanitizer over a reduced GPU suite, run on an H100/H200: memcheck (out-of-bounds and
# misaligned accesses, leaks) and racecheck (shared-memory hazards) on one or two cases of every
# kernel: select, schedule, the pipelined forward (M = 16, 4 and the first kernel's M = 1), the
# pipelined backward (M = 16, 4; four segments of tiles in seed_like_bhsd) and the general
# backward (H = 12, Hp = 12), warmup forward and backward, the wgmma tile check.
#
#   scripts/sanitize.sh [BIN_DIR]
#
# BIN_DIR holds a prebuilt flashmsa_gpu_tests (default: build/, built here if missing). Logs go to
# $RESULTS_DIR/sanitize (default bench/results/raw/sanitize); TOOLS (default "memcheck racecheck")
# and TOOL_TIMEOUT (seconds per tool, default 900) narrow a run. Exit status 0 only when every tool
# finished and reported 0 errors with every test passing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/prebuilt.sh"
bin_dir="$(prebuilt_dir "${1:-$root/build}" flashmsa_gpu_tests)" || exit 1
out="${RESULTS_DIR:-$root/bench/results/raw}/sanitize"
mkdir -p "$out"

filter="$(printf '%s:' \
  'Select/SelectTest.MatchesReference/paper_hp4_hpk1_b1_s8192_k2_bf16_bshd' \
  'Shapes/ScheduleTest.MatchesHostInversion/odd_h48_hkv4_hp12_s777_k2' \
  'Configs/ForwardTest.MatchesReference/paper_s2125_k16_bf16_bshd' \
  'Configs/ForwardTest.MatchesReference/specialized_s3000_k2_fp16_bhsd' \
  'Configs/ForwardTest.MatchesReference/m1_h8_hkv2_hp8_s700_k16' \
  'Cases/BackwardMatchesReference.AllGradientsAndKl/paper_like_bf16' \
  'Cases/BackwardMatchesReference.AllGradientsAndKl/specialized_like' \
  'Cases/BackwardMatchesReference.AllGradientsAndKl/seed_like_bhsd' \
  'Cases/BackwardMatchesReference.AllGradientsAndKl/odd_h12_hkv4_hp12' \
  'Named/WarmupMatchesReference.ForwardBackwardAndKl/paper_s200_bf16' \
  'GmmaTile.*')"
filter="${filter%:}"

status=0
for tool in ${TOOLS:-memcheck racecheck}; do
  extra=()
  [[ "$tool" == "memcheck" ]] && extra=(--leak-check full)
  log="$out/$tool.log"
  timeout "${TOOL_TIMEOUT:-900}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 \
    "$bin_dir/flashmsa_gpu_tests" --gtest_filter="$filter" > "$log" 2>&1
  rc=$?
  summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
  tests="$(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
  echo "sanitize: $tool rc=$rc ${summary:-no summary} ${tests}"
  [[ $rc -ne 0 ]] && status=1
done
exit $status
