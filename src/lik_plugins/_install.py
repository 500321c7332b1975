"""How to install a host beside the torch a user already has.

The hosts' own metadata would replace or break that torch: PyLate 1.6 requires fast-plaid,
whose every release pins one exact torch (a CUDA build from PyPI), and colpali-engine
requires torchvision, which from PyPI is built for the CUDA torch of its version and breaks
transformers' imports beside a CPU torch.  Packaging cannot say "this host without that
dependency", so lik_plugins has no extra that installs a host: these two-step commands
install the host's other dependencies, then the host alone.  The patchers' ImportErrors
quote them, and docs/install.md shows the same strings (a test keeps them equal).
"""
from __future__ import annotations

# pip check then reports only "pylate 1.6.0 requires fast-plaid" (needed by PyLate's PLAID
# index alone; lik_plugins.ops.plaid covers the compressed index without it).
PYLATE = ("pip install sentence-transformers==5.3.0 transformers==5.3.0 datasets accelerate pandas ujson==5.12.0 "
          "ninja==1.11.1.4 fastkmeans==0.5.0 && pip install --no-deps pylate==1.6.0")

# pip check then reports only "colpali-engine 0.3.18 requires torchvision".  transformers
# stays below 5.5, whose Qwen2-VL imports need torchvision.
COLPALI = ('pip install "transformers>=5.3,<5.5" "peft>=0.18,<0.21" pillow scipy requests '
           "&& pip install --no-deps colpali-engine==0.3.18")


def missing_host(patcher: str, host: str, command: str) -> str:
    """The ImportError message of a patcher whose host is not installed."""
    return (f"{patcher} needs {host}. To install it without replacing your torch: {command} "
            f"(docs/install.md says what the plain `pip install` of it would do to torch)")
