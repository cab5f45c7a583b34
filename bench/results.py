"""Writes bench/results/h200.json (SPEC.md "Results file") from the GPU check's raw outputs and
prints the short summary table. Standard library only: it runs on the GPU machine and in CI."""
import argparse
import datetime
import json
import sys


def test_counts(path):
    """Counts passed/failed/skipped per suite of a GoogleTest JSON report."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {}
    suites = {}
    for suite in report.get("testsuites", []):
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for case in suite.get("testsuite", []):
            if case.get("failures"):
                counts["failed"] += 1
            elif case.get("result") == "SKIPPED":
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        suites[suite["name"]] = counts
    return suites


def summary_table(rows):
    lines = ["system            stage        config       pattern      S        ms       TFLOP/s"]
    for row in rows:
        lines.append("%-17s %-12s %-12s %-12s %-8d %-8.3f %.1f" % (
            row["system"], row["stage"], row["config"], row["pattern"] or "-", row["S"], row["ms"],
            row.get("tflops") or 0.0))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--tests", required=True)
    parser.add_argument("--rows", nargs="*", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rows = []
    for path in args.rows:
        try:
            with open(path) as f:
                rows.extend(json.load(f))
        except (OSError, ValueError) as error:
            print("results: skipping %s (%s)" % (path, error), file=sys.stderr)
    result = {
        "commit": args.commit,
        "gpu": args.gpu,
        "date": datetime.date.today().isoformat(),
        "tests": {"flashmsa_gpu_tests": _total(test_counts(args.tests))},
        "suites": test_counts(args.tests),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    total = result["tests"]["flashmsa_gpu_tests"]
    print(summary_table(rows))
    print("GPU tests: %(passed)d passed, %(failed)d failed, %(skipped)d skipped" % total)


def _total(suites):
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for counts in suites.values():
        for key in total:
            total[key] += counts[key]
    return total


if __name__ == "__main__":
    main()
