"""The throughput bench runs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_throughput_bench_runs_tiny():
    """End to end on CPU in its tiny mode: both sides train and the ratio line is printed (no timing asserted)."""
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as a user has, not the tests' eight
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--tiny"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ratio podtrain/reference: min" in result.stdout
