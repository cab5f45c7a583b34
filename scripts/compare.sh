#!/usr/bin/env bash
# Same-run comparison of builds on one GPU: flashmsa_bench from each BIN_DIR in turn, ROUNDS times
# (A B A B ...), so that clock and power drift fall on every build alike; then one table of every
# row's times per build and each build's median against the first's (bench/compare.py).
#
#   scripts/compare.sh BIN_DIR_A BIN_DIR_B [BIN_DIR ...] [-- BENCH_ARGS ...]
#
# Each BIN_DIR holds a flashmsa_bench (built with scripts/build.sh, or copied with its COMMIT file
# as docs/gpu_check.md shows); its label is the directory's name. BENCH_ARGS default to the paper
# configuration's 128K forward on the random pattern. Environment: ROUNDS (default 2), OUT_DIR
# (default compare-out/: each run's rows as LABEL.ROUND.json and its output as LABEL.ROUND.log).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dirs=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
  dirs+=("$1")
  shift
done
[[ "${1:-}" == "--" ]] && shift
bench_args=("$@")
if [[ ${#bench_args[@]} -eq 0 ]]; then
  bench_args=(--stages forward --configs paper --seqlens 131072 --patterns random)
fi
if [[ ${#dirs[@]} -lt 2 ]]; then
  echo "usage: scripts/compare.sh BIN_DIR_A BIN_DIR_B [BIN_DIR ...] [-- BENCH_ARGS ...]" >&2
  exit 2
fi
rounds="${ROUNDS:-2}"
if ! [[ "$rounds" =~ ^[1-9][0-9]?$ ]]; then
  echo "compare: ROUNDS must be an integer in [1, 99], got '$rounds'" >&2
  exit 2
fi
labels=()
for dir in "${dirs[@]}"; do
  if [[ ! -x "$dir/flashmsa_bench" ]]; then
    echo "compare: $dir has no flashmsa_bench" >&2
    exit 2
  fi
  label="$(basename "$(cd "$dir" && pwd)")"
  for seen in "${labels[@]}"; do
    if [[ "$seen" == "$label" ]]; then
      echo "compare: two builds named $label; give them directories of different names" >&2
      exit 2
    fi
  done
  labels+=("$label")
done
out="${OUT_DIR:-$root/compare-out}"
mkdir -p "$out"

specs=()
for ((i = 0; i < ${#dirs[@]}; ++i)); do specs+=("${labels[$i]}="); done
for ((round = 1; round <= rounds; ++round)); do
  for ((i = 0; i < ${#dirs[@]}; ++i)); do
    label="${labels[$i]}"
    rows="$out/$label.$round.json"
    log="$out/$label.$round.log"
    commit=""
    [[ -f "${dirs[$i]}/COMMIT" ]] && commit=" ($(cat "${dirs[$i]}/COMMIT"))"
    echo "== round $round: $label$commit"
    if ! "${dirs[$i]}/flashmsa_bench" "${bench_args[@]}" --out "$rows" >"$log" 2>&1; then
      echo "compare: $label failed in round $round (see $log)" >&2
      tail -n 5 "$log" >&2
      exit 1
    fi
    specs[$i]+="$([[ $round -gt 1 ]] && echo ,)$rows"
  done
done
python3 "$root/bench/compare.py" "${specs[@]}"
