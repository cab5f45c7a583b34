#!/usr/bin/env bash
# Quick start, command 1: builds the `flashmsa` CLI and runs its default job (one training step of
# the paper config). Without a Hopper GPU it runs the CPU reference on a small problem and says so.
# Arguments are passed to the CLI (see `build/flashmsa --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" --target flashmsa_cli
exec "$root/build/flashmsa" "$@"
