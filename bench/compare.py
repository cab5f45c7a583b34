"""Same-run comparison table: the rows of several builds' flashmsa_bench runs side by side.

  python3 bench/compare.py LABEL=ROWS.json[,ROWS.json...] LABEL=...

Each LABEL names a build and its rows files, one per round of scripts/compare.sh (the builds run in
turn, A B A B ..., so clock and power drift fall on every build alike). A table row is one
(stage, config, pattern, S): every round's ms per build, and the ratio of each build's median to
the first build's (below 1: faster than the first).
"""

import json
import statistics
import sys

from report import fmt_seqlen


def read_build(spec):
    """LABEL=a.json,b.json -> (label, [rows of each file]); ValueError naming the argument."""
    label, sep, files = spec.partition("=")
    if not sep or not label or not files:
        raise ValueError("expected LABEL=ROWS.json[,ROWS.json...], got '%s'" % spec)
    rounds = []
    for path in files.split(","):
        try:
            with open(path) as f:
                rounds.append(json.load(f))
        except (OSError, ValueError) as error:
            raise ValueError("%s: %s" % (label, error))
    return label, rounds


def row_key(row):
    return (row["stage"], row["config"], row.get("pattern") or "-", int(row["S"]),
            row.get("system", "flashmsa"))


def table(builds):
    """Markdown table of the builds' rows; builds: [(label, [rows of each round])]."""
    times = {}  # key -> label -> [ms per round]
    order = []
    for label, rounds in builds:
        for rows in rounds:
            for row in rows:
                key = row_key(row)
                if key not in times:
                    times[key] = {}
                    order.append(key)
                times[key].setdefault(label, []).append(float(row["ms"]))
    labels = [label for label, _ in builds]
    first = labels[0]
    header = ["stage", "config", "pattern", "S"] + ["%s ms" % label for label in labels]
    header += ["%s / %s" % (label, first) for label in labels[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in order:
        stage, config, pattern, seqlen, system = key
        cells = [stage if system == "flashmsa" else "%s (%s)" % (stage, system), config, pattern,
                 fmt_seqlen(seqlen)]
        medians = {}
        for label in labels:
            runs = times[key].get(label)
            if runs:
                medians[label] = statistics.median(runs)
                cells.append(" / ".join("%.3f" % ms for ms in runs))
            else:
                cells.append("-")
        for label in labels[1:]:
            if label in medians and medians.get(first):
                cells.append("%.3f" % (medians[label] / medians[first]))
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    if not argv:
        print("usage: python3 bench/compare.py LABEL=ROWS.json[,ROWS.json...] LABEL=...",
              file=sys.stderr)
        return 2
    try:
        builds = [read_build(spec) for spec in argv]
    except ValueError as error:
        print("compare: %s" % error, file=sys.stderr)
        return 2
    labels = [label for label, _ in builds]
    if len(set(labels)) != len(labels):
        print("compare: labels must differ, got %s" % ", ".join(labels), file=sys.stderr)
        return 2
    print(table(builds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
