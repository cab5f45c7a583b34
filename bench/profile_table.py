"""The table scripts/profile.sh prints: one row per profiled kernel from Nsight Compute's raw CSV.

    python3 bench/profile_table.py NAME=REPORT.csv [NAME=REPORT.csv ...]

A report is `ncu --csv --page raw` output, possibly after the profiled program's own output; its
first data row (the first launch profiled) is read. Columns: duration, DRAM bytes read and written,
their rate and its share of the peak, L2 hit rate, issue slots busy, and the three largest warp
stall reasons as cycles per issued instruction (the warp state statistics).
"""

import csv
import sys

DURATION = "gpu__time_duration.sum"
COLUMNS = [
    # (heading, metric, scale to the shown unit)
    ("read GB", "dram__bytes_read.sum", 1e-9),
    ("write GB", "dram__bytes_write.sum", 1e-9),
    ("DRAM % peak", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1.0),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
UNIT_SCALE = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
              "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


def first_launch(path):
    """{metric: (value, unit)} of the report's first data row, or None when it has none."""
    try:
        with open(path, newline="") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return None
    rows = list(csv.reader(lines[start:]))
    if len(rows) < 3:  # header, units, one launch
        return None
    header, units, values = rows[0], rows[1], rows[2]
    return {name: (value, unit) for name, unit, value in zip(header, units, values)}


def number(metrics, name, unit_scale=True):
    """A metric's value in base units (bytes, seconds) or as printed; None when absent or not numeric."""
    if name not in metrics:
        return None
    value, unit = metrics[name]
    try:
        x = float(value.replace(",", ""))
    except ValueError:
        return None
    return x * UNIT_SCALE.get(unit, 1.0) if unit_scale else x


def stalls(metrics, count=3):
    """The `count` largest warp stall reasons, as 'reason cycles' strings."""
    found = []
    for name in metrics:
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
            if name == STALL_PREFIX + "selected" + STALL_SUFFIX:  # issuing, not a stall
                continue
            x = number(metrics, name, unit_scale=False)
            if x is not None:
                found.append((x, name[len(STALL_PREFIX):-len(STALL_SUFFIX)]))
    found.sort(reverse=True)
    return ", ".join("%s %.1f" % (reason, x) for x, reason in found[:count]) or "-"


def table(reports):
    heading = ["kernel", "ms", "TB/s"] + [c[0] for c in COLUMNS] + ["largest stalls (cycles/issue)"]
    lines = ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
    for name, path in reports:
        metrics = first_launch(path)
        if metrics is None:
            lines.append("| %s | no launch in %s |" % (name, path))
            continue
        seconds = number(metrics, DURATION)
        moved = [number(metrics, "dram__bytes_read.sum"), number(metrics, "dram__bytes_write.sum")]
        rate = sum(moved) / seconds * 1e-12 if seconds and None not in moved else None
        cells = [name, "%.3f" % (seconds * 1e3) if seconds else "-", "%.2f" % rate if rate else "-"]
        for _, metric, scale in COLUMNS:
            x = number(metrics, metric)
            cells.append("-" if x is None else "%.1f" % (x * scale))
        cells.append(stalls(metrics))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    reports = []
    for item in argv:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print("profile_table: expected NAME=REPORT.csv, got %r" % item, file=sys.stderr)
            return 2
        reports.append((name, path))
    if not reports:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
