#!/usr/bin/env bash
# The PyTorch side: a project-local virtual environment .venv-torch/ (ignored by git) with the
# pinned torch and test tools, and the flashmsa package built and installed into it.
#
#   scripts/setup_torch.sh            # then: .venv-torch/bin/python -m pytest tests/python
#
# Steps: (1) the venv and the pins (skipped when the pins are already installed); (2) the flashmsa
# core (C++ API, kernels, reference) through scripts/build.sh into build/, incrementally; (3)
# `pip install .` (scikit-build-core, bindings/torch/CMakeLists.txt) linking that core; (4) a copy
# of the library at build-torch/libflashmsa_torch.so, the file scripts/gpu_check.sh tests on a GPU
# machine, and the pytest wheels in .whl/ for a machine that has torch but no pytest.
# Environment: PYTHON (default python3) makes the venv; FLASHMSA_TORCH_VENV moves it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLASHMSA_TORCH_VENV:-$root/.venv-torch}"
pins=(torch==2.11.0 pytest==9.2.0 numpy==2.3.5 scikit-build-core==0.11.6 expecttest==0.3.0)

if [[ ! -x "$venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
stamp="$venv/.flashmsa-pins"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "${pins[*]}" ]]; then
  echo "setup_torch: installing ${pins[*]} into $venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
  echo "${pins[*]}" > "$stamp"
fi

bash "$root/scripts/build.sh" --target flashmsa flashmsa_reference

echo "setup_torch: building and installing the flashmsa package"
FLASHMSA_PREBUILT_CORE="$root/build" "$venv/bin/pip" install --quiet --disable-pip-version-check \
  --no-build-isolation --no-deps "$root"

library="$("$venv/bin/python" -c 'import flashmsa; print(flashmsa.library_path())')"
mkdir -p "$root/build-torch"
cp "$library" "$root/build-torch/libflashmsa_torch.so"
"$venv/bin/pip" download --quiet --disable-pip-version-check --only-binary=:all: \
  -d "$root/.whl" pytest==9.2.0
echo "setup_torch: flashmsa installed in $venv; library copy: build-torch/libflashmsa_torch.so"
