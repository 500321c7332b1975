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


def test_help_shows_a_sample_run_and_how_to_report_it():
    proc = subprocess.run([sys.executable, "-m", "lik_plugins.kernels.metal.selftest", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "the numbers are placeholders, not measurements" in text
    # the sample is made by the functions a run prints with: the same headings, in order
    order = ["lik_plugins Metal self-test: Apple M2, macOS", "correctness on MPS", "case                         dtype",
             "timing (median ms; ratio > 1 means Metal is faster)", "| shape | dtype | metal fwd ms",
             "correctness cases passed", 'titled\n"Metal self-test: Apple M2"']
    positions = [text.index(piece) for piece in order]
    assert positions == sorted(positions)
    assert "paste this whole output" in text


def test_the_report_request_names_the_chip_of_this_machine():
    env = selftest.environment()
    assert env["chip"] and env["torch"] == torch.__version__
    assert f'"Metal self-test: {env["chip"]}"' in selftest.closing(env, [])
    assert selftest.heading(env).startswith(f"lik_plugins Metal self-test: {env['chip']}, macOS ")
