"""CI check of the committed GPU results: bench/results/h200.json (and h100.json, the same schema
for checks run on an H100) parses, follows the schema of SPEC.md "Results file" and names a commit
of this repository (and so does every row that carries its own commit, from an earlier run).
Passes with a message when h200.json does not exist yet."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "bench", "results", "h200.json")
H100_PATH = os.path.join(ROOT, "bench", "results", "h100.json")
STAGES = {"select", "schedule", "forward", "backward", "fwd_bwd", "step", "warmup_fwd", "warmup_fwd_bwd", "warmup_kl"}


def is_commit(sha):
    return bool(sha) and subprocess.run(["git", "-C", ROOT, "cat-file", "-e", sha + "^{commit}"],
                                        capture_output=True).returncode == 0


def schema_errors(result):
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
    traffic = result.get("traffic")  # flashmsa_traffic's access-mix rates, when measured
    if traffic is not None:
        modes = traffic.get("modes") if isinstance(traffic, dict) else None
        if not modes or not all(isinstance(m.get("tbps"), (int, float)) and m["tbps"] > 0 for m in modes):
            errors.append("traffic: needs a non-empty \"modes\" list with positive \"tbps\"")
        if isinstance(traffic, dict) and "commit" in traffic and not is_commit(traffic["commit"]):
            errors.append("traffic: commit %r is not a commit of this repository" % traffic["commit"])
    return errors


def main():
    if not os.path.exists(PATH):
        print("check_results: no bench/results/h200.json yet; nothing to check")
        return 0
    failed = False
    for path in (PATH, H100_PATH):
        if not os.path.exists(path):
            continue
        name = os.path.basename(path)
        with open(path) as f:
            result = json.load(f)
        errors = schema_errors(result)
        for error in errors:
            print("check_results: %s: %s" % (name, error), file=sys.stderr)
        if errors:
            failed = True
        else:
            print("check_results: %s ok (commit %s, %d rows)" % (name, result["commit"][:10], len(result["rows"])))
    if failed:
        return 1
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), "--check"]).returncode


if __name__ == "__main__":
    sys.exit(main())
