"""benchmarks/bench_scale.py (issue 22) in a real small run: simulated ranks over two processes, each with
its own client of one real TCPStore, make their exchanges, and the report lists every world size with
the keys each rank read: rank 0 one per rank, every other rank one (the answer). Speed is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_scale_reports_every_world_size_with_the_keys_read(tmp_path):
    out = tmp_path / "scale.md"
    out.write_text("# kept\n")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_scale.py"), "--ranks", "1,6",
                          "--procs", "2", "--exchanges", "3", "--rank-timeout", "30", "--timeout", "120",
                          "--out", str(out), "--scratch", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# kept\n") and "<!-- bench_scale:begin -->" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert set(rows) == {"1", "6"}, rows
    assert rows["1"][3] == "1 / 0" and rows["6"][3] == "6 / 1", rows
    assert all(r[2] != "not measured" for r in rows.values()), rows
