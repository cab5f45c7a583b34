"""bench/compare.py on rows files, and scripts/compare.sh driving stand-in flashmsa_bench programs
(shell scripts that write rows and log the order in which they ran)."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import compare  # noqa: E402


def row(stage, ms, pattern="random", seqlen=131072):
    return {"system": "flashmsa", "stage": stage, "config": "paper", "pattern": pattern,
            "S": seqlen, "B": 1, "ms": ms, "tflops": 0, "peak_mem_gb": 0, "note": ""}


class CompareTableTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, rows):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump(rows, f)
        return path

    def cells(self, text, stage):
        for line in text.splitlines()[2:]:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if cells[0] == stage:
                return cells
        self.fail("no %s row in\n%s" % (stage, text))

    def test_medians_and_ratio(self):
        a = [self.write("a1", [row("forward", 40.0), row("backward", 70.0)]),
             self.write("a2", [row("forward", 38.0), row("backward", 72.0)]),
             self.write("a3", [row("forward", 39.0), row("backward", 71.0)])]
        b = [self.write("b1", [row("forward", 30.0)]), self.write("b2", [row("forward", 31.0)]),
             self.write("b3", [row("forward", 35.0)])]
        text = compare.table([compare.read_build("base=" + ",".join(a)),
                              compare.read_build("new=" + ",".join(b))])
        self.assertEqual(text.splitlines()[0],
                         "| stage | config | pattern | S | base ms | new ms | new / base |")
        # Medians 39 and 31: 31 / 39 = 0.795; every round listed in its order.
        self.assertEqual(self.cells(text, "forward"),
                         ["forward", "paper", "random", "128K", "40.000 / 38.000 / 39.000",
                          "30.000 / 31.000 / 35.000", "0.795"])
        # A row only the first build has: no time and no ratio for the other.
        self.assertEqual(self.cells(text, "backward")[4:], ["70.000 / 72.000 / 71.000", "-", "-"])

    def test_bad_arguments(self):
        self.assertEqual(compare.main([]), 2)
        self.assertEqual(compare.main(["no_equals_sign.json"]), 2)
        self.assertEqual(compare.main(["a=" + os.path.join(self.dir.name, "absent.json")]), 2)
        path = self.write("rows", [row("forward", 1.0)])
        self.assertEqual(compare.main(["a=" + path, "a=" + path]), 2)


STAND_IN = """#!/usr/bin/env bash
# Writes this directory's rows (rows.json) where --out says, and logs its run.
dir="$(cd "$(dirname "$0")" && pwd)"
out=""
while [[ $# -gt 0 ]]; do
  [[ "$1" == "--out" ]] && out="$2"
  shift
done
echo "$(basename "$dir")" >> "$dir/../order"
cp "$dir/rows.json" "$out"
"""


class CompareScriptTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        for name, ms in (("base", 40.0), ("turns", 36.0)):
            build = os.path.join(self.dir.name, name)
            os.mkdir(build)
            with open(os.path.join(build, "rows.json"), "w") as f:
                json.dump([row("forward", ms)], f)
            program = os.path.join(build, "flashmsa_bench")
            with open(program, "w") as f:
                f.write(STAND_IN)
            os.chmod(program, os.stat(program).st_mode | stat.S_IXUSR)

    def run_script(self, *args, rounds="3"):
        env = dict(os.environ, ROUNDS=rounds, OUT_DIR=os.path.join(self.dir.name, "out"))
        return subprocess.run(["bash", os.path.join(ROOT, "scripts", "compare.sh")] + list(args),
                              env=env, capture_output=True, text=True)

    def test_builds_alternate_and_table(self):
        result = self.run_script(os.path.join(self.dir.name, "base"),
                                 os.path.join(self.dir.name, "turns"))
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(self.dir.name, "order")) as f:
            self.assertEqual(f.read().split(), ["base", "turns"] * 3)
        last = result.stdout.strip().splitlines()[-1]
        self.assertEqual([cell.strip() for cell in last.strip("|").split("|")],
                         ["forward", "paper", "random", "128K", "40.000 / 40.000 / 40.000",
                          "36.000 / 36.000 / 36.000", "0.900"])

    def test_usage_errors(self):
        base = os.path.join(self.dir.name, "base")
        self.assertEqual(self.run_script(base).returncode, 2)
        self.assertIn("ROUNDS must be", self.run_script(base, base, rounds="0").stderr)
        self.assertIn("two builds named base", self.run_script(base, base).stderr)
        self.assertIn("has no flashmsa_bench", self.run_script(base, self.dir.name).stderr)


if __name__ == "__main__":
    unittest.main()
