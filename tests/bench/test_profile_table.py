"""bench/profile_table.py on a report in Nsight Compute's raw CSV layout (header, units, launches),
after the profiled program's own output, as scripts/profile.sh captures it."""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import profile_table  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum",
          "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
          "lts__t_sector_hit_rate.pct", "smsp__issue_active.avg.pct_of_peak_sustained_active",
          STALL % "long_scoreboard", STALL % "barrier", STALL % "selected", STALL % "wait",
          STALL % "math_pipe_throttle"]
UNITS = ["", "", "msecond", "Gbyte", "Mbyte", "%", "%", "%", "", "", "", "", ""]
FIRST = ["0", "sparse_forward_pipelined", "4.00", "8.00", "2,000.00", "61.5", "48.25", "38.0",
         "3.5", "1.25", "9.0", "2.0", "0.5"]
SECOND = ["1", "sparse_forward_pipelined", "9.00", "1.00", "1.00", "1.0", "1.0", "1.0",
          "0", "0", "0", "0", "0"]


def quoted(row):
    return ",".join('"%s"' % cell for cell in row)


class ProfileTableTest(unittest.TestCase):
    def write(self, text):
        handle, path = tempfile.mkstemp(suffix=".csv")
        with os.fdopen(handle, "w") as f:
            f.write(text)
        self.addCleanup(os.remove, path)
        return path

    def test_first_launch_after_program_output(self):
        report = self.write("flashmsa forward paper random S=32768 9.1 ms\n==PROF== Disconnected\n" +
                            "\n".join(quoted(r) for r in (HEADER, UNITS, FIRST, SECOND)) + "\n")
        row = profile_table.table([("forward_tile", report)]).splitlines()[2]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        # 8 GB read + 2 GB written in 4 ms: 2.50 TB/s; the second launch is not read.
        self.assertEqual(cells[:8], ["forward_tile", "4.000", "2.50", "8.0", "2.0", "61.5", "48.2", "38.0"])
        # The largest stalls, "selected" (issuing) left out.
        self.assertEqual(cells[8], "long_scoreboard 3.5, wait 2.0, barrier 1.2")

    def test_report_without_launch(self):
        report = self.write("==PROF== No kernels were profiled.\n")
        self.assertIn("no launch", profile_table.table([("combine", report)]))
        self.assertIn("no launch", profile_table.table([("combine", report + ".absent")]))

    def test_bad_argument(self):
        self.assertEqual(profile_table.main(["forward_tile"]), 2)
        self.assertEqual(profile_table.main([]), 2)


if __name__ == "__main__":
    unittest.main()
