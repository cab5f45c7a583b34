#!/usr/bin/env bash
# Quick start, command 2: installs the pinned dependencies, builds everything and runs all tests
# with ctest. GPU tests skip (with a message) on a machine without an H100/H200.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure --parallel "$(nproc)" --timeout 600
