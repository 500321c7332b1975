"""The Mac self-test cannot run here: it must say so clearly and exit non-zero."""
import subprocess
import sys

import torch

from lik_plugins.kernels.metal import selftest


def test_selftest_without_mps_exits_with_a_clear_message():
    if torch.backends.mps.is_available():   # pragma: no cover - only on a Mac
        return
    proc = subprocess.run([sys.executable, "-m", "lik_plugins.kernels.metal.selftest", "--quick"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing was run" in proc.stdout and "Apple GPU" in proc.stdout
    assert selftest.unavailable_reason() is not None


def test_timing_table_renders_ratios_and_gaps():
    rows = [{"shape": "s", "dtype": "float16", "metal_fwd": 1.0, "chunked_fwd": 3.0, "eager_fwd": 2.0,
             "metal_train": 2.0, "chunked_train": None, "eager_train": 5.0}]
    table = selftest.timing_table(rows)
    assert "| 2.00x |" in table and "| 2.50x |" in table and "| - |" in table
