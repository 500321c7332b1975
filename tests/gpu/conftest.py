"""The GPU suite shares helpers with the CPU kernel tests (``tests/kernel_paths/maxsim_testlib.py``)."""
import sys
from pathlib import Path

_KERNEL_TESTS = str(Path(__file__).resolve().parent.parent / "kernel_paths")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)
