#!/usr/bin/env bash
# Installs the pinned build dependencies into third_party/ (ignored by git) and nothing else:
#   CUTLASS/CuTe C++ headers from the PyPI wheel nvidia-cutlass==4.2.0.0.
# Idempotent: a second run with the headers present does nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cutlass_version="4.2.0.0"
dest="$root/third_party/cutlass"
stamp="$dest/.version"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$cutlass_version" ]]; then
  exit 0
fi

python_bin="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "setup: fetching nvidia-cutlass==$cutlass_version headers"
"$python_bin" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$cutlass_version"
wheel="$(ls "$tmp"/nvidia_cutlass-*.whl)"
(cd "$tmp" && "$python_bin" -m zipfile -e "$wheel" unpacked)
rm -rf "$dest"
mkdir -p "$dest"
cp -r "$tmp/unpacked/cutlass_library/source/include" "$dest/include"
cp -r "$tmp/unpacked/cutlass_library/source/tools/util/include" "$dest/util_include"
echo "$cutlass_version" > "$stamp"
echo "setup: CUTLASS headers in $dest"
