#!/usr/bin/env bash
# The GPU check, run on an H100/H200: correctness tests, benchmarks and the dense/peer anchors, then
# bench/results/h200.json (SPEC.md "Results file") and a short table printed last.
#
#   scripts/gpu_check.sh [BIN_DIR]
#
# BIN_DIR holds prebuilt flashmsa_gpu_tests and flashmsa_bench, optionally flashmsa_traffic (the
# access-mix ceiling, kept as the results' "traffic" entry) (default: build/, built here if
# missing). The commit measured is read from BIN_DIR/COMMIT when present (binaries built elsewhere),
# else from git. Results go to $RESULTS_DIR (default bench/results) as h200.json plus raw logs; in
# the default place they also regenerate the README results table and docs/plots (bench/report.py).
# Environment: SEQLENS (default 8192,32768,131072), CONFIGS (default paper,specialized,seed),
# ANCHORS=0 to skip the torch anchors, FLEX=0 to skip FlexAttention among them (tile-shared at
# 8K/32K/128K, per-query at 8K, within FLEX_BUDGET_S, default 60 s, compile included),
# ANCHOR_SEQLENS (default 4096 plus SEQLENS) for the dense and eager anchors (eager up to 8K), LONG_SEQLENS (default 524288,1048576; 0 to skip): select and forward of the paper
# config with the random pattern at those lengths, WARMUP_SEQLENS (default 8192,32768,131072; 0 to
# skip): warmup-mode forward and forward + backward of the paper config, LONG_STEP_SEQLENS (default
# 524288; 0 to skip): backward, step and fwd_bwd of the paper and specialized configs with the three
# patterns at those lengths (3 timed runs each), CARRY (an earlier results
# file whose rows are kept, with their commit, for what this run does not measure).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/prebuilt.sh"
bin_dir="$(prebuilt_dir "${1:-$root/build}" flashmsa_gpu_tests flashmsa_bench flashmsa_traffic)" || exit 1
results_dir="${RESULTS_DIR:-$root/bench/results}"
seqlens="${SEQLENS:-8192,32768,131072}"
configs="${CONFIGS:-paper,specialized,seed}"
mkdir -p "$results_dir"
raw="$results_dir/raw"
mkdir -p "$raw"

if [[ -f "$bin_dir/COMMIT" ]]; then
  commit="$(cat "$bin_dir/COMMIT")"
else
  commit="$(git -C "$root" rev-parse HEAD)"
fi
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "gpu_check: $gpu, commit $commit"

# ---- PyTorch tests (tests/python) on the GPU, with a carried or locally built library -------------
# libflashmsa_torch.so comes from scripts/setup_torch.sh (build-torch/, or FLASHMSA_TORCH_LIBRARY);
# it links only libtorch, so a copy built elsewhere against torch 2.11 loads into this python3.
# PYTORCH_TESTS=0 skips them. A python3 without pytest gets it from carried wheels in .whl/. They
# run beside the GoogleTest shards (both are correctness tests whose time is the host reference's;
# no timing depends on them), which fills the host cores the unequal shards leave idle at the end.
torch_library=""
python_pid=""
rm -f "$raw/python_tests.xml"
if [[ "${PYTORCH_TESTS:-1}" != "0" ]]; then
  torch_library="${FLASHMSA_TORCH_LIBRARY:-$root/build-torch/libflashmsa_torch.so}"
  if [[ ! -f "$torch_library" ]]; then
    echo "PyTorch tests skipped: $torch_library not found (scripts/setup_torch.sh builds it)"
    torch_library=""
  else
    if ! python3 -c "import pytest" 2>/dev/null && compgen -G "$root/.whl/pytest-*.whl" >/dev/null; then
      python3 -m pip install --quiet --no-index --find-links "$root/.whl" pytest
    fi
    FLASHMSA_TORCH_LIBRARY="$torch_library" timeout "${TEST_TIMEOUT:-600}" \
      python3 -m pytest -q -rs "$root/tests/python" \
      --junitxml="$raw/python_tests.xml" >"$raw/python_tests.log" 2>&1 &
    python_pid=$!
  fi
fi

# The fp64 reference runs on the host and dominates the suite's time, so the suite runs as
# TEST_SHARDS (default 4) GoogleTest shards in parallel on the one GPU.
shards="${TEST_SHARDS:-4}"
echo "== GPU tests ($shards shards)"
rm -f "$raw"/gpu_tests_*.json
pids=()
for ((shard = 0; shard < shards; ++shard)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard timeout "${TEST_TIMEOUT:-600}" \
    "$bin_dir/flashmsa_gpu_tests" --gtest_output="json:$raw/gpu_tests_$shard.json" \
    >"$raw/gpu_tests_$shard.log" 2>&1 &
  pids+=($!)
done
tests_rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || tests_rc=1
done
cat "$raw"/gpu_tests_*.log >"$raw/gpu_tests.log"
grep -h "^\[  PASSED\|^\[  FAILED\|tests ran" "$raw/gpu_tests.log"
python_rc=0
if [[ -n "$python_pid" ]]; then
  echo "== PyTorch tests"
  wait "$python_pid"
  python_rc=$?
  tail -n 25 "$raw/python_tests.log"
fi

# CARRY=<an earlier h200.json>: rows this run does not measure (e.g. ANCHORS=0, whose torch anchors
# do not depend on flashmsa) are kept from it with the commit they were measured at.
carry_args=()
if [[ -n "${CARRY:-}" ]]; then
  cp "$CARRY" "$raw/carry.json" && carry_args=(--carry "$raw/carry.json")
fi
# The results are rewritten after every timing step, so a check cut short (a time limit) still
# leaves what it measured.
write_results() {
  python3 "$root/bench/results.py" --commit "$commit" --gpu "$gpu" \
    --tests "$raw"/gpu_tests_*.json --python-tests "$raw/python_tests.xml" \
    --rows "${row_files[@]}" "${anchor_rows[@]}" "${carry_args[@]}" "${traffic_args[@]}" \
    --out "$results_dir/h200.json"
}
anchor_rows=()
traffic_args=()

echo "== flashmsa benchmarks"
"$bin_dir/flashmsa_bench" --configs "$configs" --seqlens "$seqlens" \
  --out "$raw/flashmsa_rows.json" 2>&1 | tee "$raw/bench.log"
row_files=("$raw/flashmsa_rows.json")
write_results >/dev/null
long_seqlens="${LONG_SEQLENS:-524288,1048576}"
if [[ "$long_seqlens" != "0" ]]; then
  "$bin_dir/flashmsa_bench" --stages select,forward --configs paper --patterns random \
    --seqlens "$long_seqlens" --out "$raw/long_rows.json" 2>&1 | tee -a "$raw/bench.log"
  row_files+=("$raw/long_rows.json")
  write_results >/dev/null
fi
long_step_seqlens="${LONG_STEP_SEQLENS:-524288}"
if [[ "$long_step_seqlens" != "0" ]]; then
  "$bin_dir/flashmsa_bench" --stages backward,step --configs paper,specialized \
    --seqlens "$long_step_seqlens" --repeats 3 --out "$raw/long_step_rows.json" 2>&1 | tee -a "$raw/bench.log"
  row_files+=("$raw/long_step_rows.json")
  write_results >/dev/null
fi
warmup_seqlens="${WARMUP_SEQLENS:-8192,32768,131072}"
if [[ "$warmup_seqlens" != "0" ]]; then
  "$bin_dir/flashmsa_bench" --stages warmup --configs paper --seqlens "$warmup_seqlens" --repeats 1 \
    --out "$raw/warmup_rows.json" 2>&1 | tee -a "$raw/bench.log"
  row_files+=("$raw/warmup_rows.json")
  write_results >/dev/null
fi

# The forward tile kernel's access mix alone (bench/traffic): how fast its bytes can move on this GPU.
rm -f "$raw/traffic.json"
if [[ -x "$bin_dir/flashmsa_traffic" ]]; then
  echo "== access-mix ceiling (flashmsa_traffic)"
  "$bin_dir/flashmsa_traffic" --ctas-per-sm 3 --out "$raw/traffic.json" 2>&1 | tee "$raw/traffic.log"
  [[ -f "$raw/traffic.json" ]] && traffic_args=(--traffic "$raw/traffic.json") && write_results >/dev/null
fi

if [[ "${ANCHORS:-1}" != "0" ]]; then
  echo "== anchors (torch)"
  PYTHONUNBUFFERED=1 python3 "$root/bench/anchors.py" --seqlens "${ANCHOR_SEQLENS:-4096,$seqlens}" \
    --flex "${FLEX:-1}" --flex-budget-s "${FLEX_BUDGET_S:-60}" \
    --out "$raw/anchor_rows.json" 2>&1 | tee "$raw/anchors.log"
  [[ -f "$raw/anchor_rows.json" ]] && anchor_rows=("$raw/anchor_rows.json")
fi

write_results >/dev/null

# ---- Timings through the PyTorch op, alone on the GPU ---------------------------------------------
if [[ -n "$torch_library" ]]; then
  echo "== PyTorch op timings"
  # Host time per op call (the ≤ 50 µs target of the forward op is a benchmark figure, not a test).
  FLASHMSA_TORCH_LIBRARY="$torch_library" timeout 300 python3 "$root/bench/host_overhead.py" \
    > "$raw/host_overhead.log" 2>&1 || true
  sed -n '2,5p' "$raw/host_overhead.log"
  # Warmup mode through the op (main branch on cuDNN) next to cuDNN dense, in one process.
  warmup_torch_seqlens="${WARMUP_TORCH_SEQLENS:-$warmup_seqlens}"
  if [[ "$warmup_torch_seqlens" != "0" ]]; then
    FLASHMSA_TORCH_LIBRARY="$torch_library" timeout 300 python3 "$root/bench/warmup_torch.py" \
      --seqlens "$warmup_torch_seqlens" --out "$raw/warmup_torch_rows.json" 2>&1 | tee "$raw/warmup_torch.log"
    [[ -f "$raw/warmup_torch_rows.json" ]] && row_files+=("$raw/warmup_torch_rows.json")
  fi
fi

write_results
# Results written into the repository regenerate the README table and the plots (plots need matplotlib).
if [[ "$results_dir" -ef "$root/bench/results" ]]; then
  python3 "$root/bench/report.py" || echo "gpu_check: bench/report.py failed; run it by hand"
fi
exit $(( tests_rc != 0 ? tests_rc : python_rc ))
