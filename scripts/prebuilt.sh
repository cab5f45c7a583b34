# Sourced by the scripts that run prebuilt binaries on a GPU machine (gpu_check.sh, sanitize.sh,
# profile.sh).
#
#   bin_dir="$(prebuilt_dir DIR TARGET...)" || exit 1
#
# Prints DIR when it holds the first TARGET as an executable; otherwise builds the TARGETs into
# build/ (scripts/build.sh, whose output goes to stderr) and prints that directory.
prebuilt_dir() {
  local dir="$1"
  shift
  if [[ -x "$dir/$1" ]]; then
    echo "$dir"
    return 0
  fi
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bash "$root/scripts/build.sh" --target "$@" >&2 || return 1
  echo "$root/build"
}
