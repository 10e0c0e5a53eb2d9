"""The two-rank demo (examples/demo.py --ranks 2) runs as the README says: an FSDP2 job under
torch.distributed.run is SIGKILLed whole, restarts, and ends bit-identical on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "demo.py")


def test_two_rank_demo(tmp_path):
    out = subprocess.run([sys.executable, DEMO, "--ranks", "2", "--steps", "16", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step" in out.stdout
    assert "bit-identical to the uninterrupted run: True" in out.stdout
    assert "demo OK" in out.stdout
