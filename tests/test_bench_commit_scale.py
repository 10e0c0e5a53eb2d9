"""benchmarks/bench_commit_scale.py (issue 22) in a real small run: a cut of a few ranks committed as format 5
and as format 3 on the local disk and on moto's S3 server, the report listing each with its commit record's
bytes (a rank's share at most 256 in format 5, a format-3 manifest growing with every rank's arrays) and the
load of one rank beside a one-rank cut's. Speed is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_commit_scale_reports_both_formats_on_both_stores(tmp_path):
    out = tmp_path / "scale.md"
    out.write_text("# kept\n")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_commit_scale.py"), "--ranks", "1,4",
                          "--tensors", "20", "--s3", "--s3-ranks", "4", "--out", str(out), "--scratch", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# kept\n") and "<!-- bench_commit_scale:begin -->" in text
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| local") or line.startswith("| s3")]
    by = {(r[0], r[1], r[3]): r for r in rows}
    assert set(by) == {("local", "1", "4"), ("local", "4", "5"), ("local", "4", "3"), ("s3", "4", "5")}
    for key in (("local", "4", "5"), ("s3", "4", "5")):
        record = by[key][7]  # "bytes (a rank)"
        per_rank = int(record.split("(")[1].rstrip(")"))
        assert per_rank <= 256, by[key]
        assert "x (" in by[key][9], by[key]  # the load of one rank beside a one-rank cut's
    assert "PUT" in by[("s3", "4", "5")][5]
    v3 = int(by[("local", "4", "3")][7].split(" ")[0].replace(",", ""))
    v5 = int(by[("local", "4", "5")][7].split(" ")[0].replace(",", ""))
    assert v3 > 4 * 20 * 50 > v5  # format 3 lists every rank's arrays; format 5 one entry a rank
