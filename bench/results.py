"""Writes bench/results/h200.json (SPEC.md "Results file") from the GPU check's raw outputs and
prints the short summary table. Standard library only: it runs on the GPU machine and in CI."""
import argparse
import datetime
import json
import sys


def load_or_skip(path):
    """The JSON in `path`, or None (with a message) when it is missing or does not parse."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        print("results: skipping %s (%s)" % (path, error), file=sys.stderr)
        return None


def carried(entry, earlier):
    """A copy of an entry of the earlier results file `earlier`, naming the commit it measured."""
    entry = dict(entry)
    entry.setdefault("commit", earlier["commit"])
    return entry


def test_counts(paths):
    """Counts passed/failed/skipped per suite over GoogleTest JSON reports (one per shard)."""
    suites = {}
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        for suite in report.get("testsuites", []):
            counts = suites.setdefault(suite["name"], {"passed": 0, "failed": 0, "skipped": 0})
            for case in suite.get("testsuite", []):
                if case.get("failures"):
                    counts["failed"] += 1
                elif case.get("result") == "SKIPPED":
                    counts["skipped"] += 1
                else:
                    counts["passed"] += 1
    return suites


def pytest_counts(path):
    """Counts of a pytest JUnit XML report, or None when there is none."""
    if not path:
        return None
    try:
        import xml.etree.ElementTree as ElementTree
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


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
    parser.add_argument("--tests", nargs="+", required=True)
    parser.add_argument("--python-tests", default="")
    parser.add_argument("--rows", nargs="*", default=[])
    parser.add_argument("--carry", default="",
                        help="an earlier results file: its rows for (system, stage, config, pattern, S, "
                             "B) that this run did not measure are kept, each with the commit it was "
                             "measured at (for a run cut short; the README table shows that commit)")
    parser.add_argument("--traffic", default="",
                        help="flashmsa_traffic --out: the forward tile kernel's access mix alone, "
                             "stored as the file's \"traffic\" entry (an earlier file's is carried)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rows, skipped = [], []
    for path in args.rows:  # a list of rows, or {"rows": [...], "skipped": [...]} (bench/anchors.py)
        data = load_or_skip(path)
        if data is None:
            continue
        rows.extend(data["rows"] if isinstance(data, dict) else data)
        if isinstance(data, dict):
            skipped.extend(data.get("skipped", []))
    if args.carry:
        with open(args.carry) as f:
            earlier = json.load(f)
        key = lambda r: (r["system"], r["stage"], r["config"], r["pattern"], r["S"], r.get("B", 1))
        measured = {key(r) for r in rows}
        for row in earlier.get("rows", []):
            if key(row) not in measured:
                rows.append(carried(row, earlier))
    result = {
        "commit": args.commit,
        "gpu": args.gpu,
        "date": datetime.date.today().isoformat(),
        "tests": {"flashmsa_gpu_tests": _total(test_counts(args.tests))},
        "suites": test_counts(args.tests),
        "rows": rows,
        "skipped": skipped,  # anchors left out, each {"system", "S", "reason"}
    }
    traffic = load_or_skip(args.traffic) if args.traffic else None
    if traffic is None and args.carry and "traffic" in earlier:
        traffic = carried(earlier["traffic"], earlier)
    if traffic is not None:
        result["traffic"] = traffic
    python_counts = pytest_counts(args.python_tests)
    if python_counts is not None:
        result["tests"]["pytest_tests_python"] = python_counts
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(summary_table(rows))
    for suite, counts in result["tests"].items():
        print("%s: %d passed, %d failed, %d skipped" % (suite, counts["passed"], counts["failed"],
                                                        counts["skipped"]))


def _total(suites):
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for counts in suites.values():
        for key in total:
            total[key] += counts[key]
    return total


if __name__ == "__main__":
    main()
