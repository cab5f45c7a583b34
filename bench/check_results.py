"""CI check of the committed GPU results: bench/results/h200.json parses, follows the schema of
SPEC.md "Results file" and names a commit of this repository (and so does every row that carries
its own commit, from an earlier run). Passes with a message when the file
does not exist yet."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "bench", "results", "h200.json")
STAGES = {"select", "schedule", "forward", "backward", "fwd_bwd", "step", "warmup_fwd", "warmup_fwd_bwd", "warmup_kl"}


def is_commit(sha):
    return bool(sha) and subprocess.run(["git", "-C", ROOT, "cat-file", "-e", sha + "^{commit}"],
                                        capture_output=True).returncode == 0


def main():
    if not os.path.exists(PATH):
        print("check_results: no bench/results/h200.json yet; nothing to check")
        return 0
    with open(PATH) as f:
        result = json.load(f)
    errors = []
    commit = result.get("commit", "")
    if not is_commit(commit):
        errors.append("commit %r is not a commit of this repository" % commit)
    for key in ("gpu", "date", "tests", "rows"):
        if key not in result:
            errors.append("missing key %r" % key)
    for index, row in enumerate(result.get("rows", [])):
        for key in ("system", "stage", "config", "pattern", "S", "B", "ms"):
            if key not in row:
                errors.append("rows[%d]: missing %r" % (index, key))
        if row.get("stage") not in STAGES:
            errors.append("rows[%d]: unknown stage %r" % (index, row.get("stage")))
        if not (isinstance(row.get("ms"), (int, float)) and row["ms"] > 0):
            errors.append("rows[%d]: ms must be a positive number" % index)
        if "commit" in row and not is_commit(row["commit"]):  # a row carried from an earlier run
            errors.append("rows[%d]: commit %r is not a commit of this repository" % (index, row["commit"]))
    for error in errors:
        print("check_results: " + error, file=sys.stderr)
    if errors:
        return 1
    print("check_results: h200.json ok (commit %s, %d rows)" % (commit[:10], len(result["rows"])))
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), "--check"]).returncode


if __name__ == "__main__":
    sys.exit(main())
