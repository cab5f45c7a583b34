#!/usr/bin/env bash
# Configures and builds flashmsa into build/ (after scripts/setup.sh). Extra arguments are passed to
# `cmake --build` (e.g. `--target flashmsa_cli`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [[ ! -f "$root/build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$root/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$root/build" --parallel "$(nproc)" "$@"
