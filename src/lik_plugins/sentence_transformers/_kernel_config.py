"""``kernel_config()``: pick lik_plugins' MaxSim layers through sentence-transformers 6.3's own
kernel mechanism (``MultiVectorEncoder(kernel_config=...)``), without the patch."""
from __future__ import annotations

from pathlib import Path
from typing import Any

#: The ``kernels`` layer repository shipped inside the package (one build variant, ``torch-universal``).
REPOSITORY = Path(__file__).resolve().parent / "kernel_repository"

#: ST's kernel targets -> the layer of ours that serves each.
LAYERS = {"STMaxSim": "MaxSim", "STMaxSimPairwise": "MaxSimPairwise"}


def kernel_config():
    """A ``transformers.KernelConfig`` mapping sentence-transformers 6.3's MaxSim targets
    (``STMaxSim``, ``STMaxSimPairwise``) to the layers shipped in this package.

    ``MultiVectorEncoder(..., kernel_config=kernel_config())`` then scores ``model.similarity``,
    ``model.similarity_pairwise``, the evaluators and the losses' default path with the fused
    MaxSim op (Triton on CUDA, Metal on MPS, chunked torch on the CPU) through ST's own
    ``kernels`` integration -- no patch, nothing downloaded (``use_local_kernel=True``: the
    repository is a folder of the installed package).  Results are ST's (see
    :mod:`lik_plugins.sentence_transformers.kernel_layers`); :func:`lik_plugins.routing_counts`
    counts each launch under ``sentence_transformers.maxsim`` / ``..._pairwise``.

    Only the MaxSim targets are mapped: the backbone's kernels and ``STWardClustering`` keep
    ST's defaults.  To combine with other targets, update the returned config's
    ``kernel_mapping``.

    Requires sentence-transformers >= 6.3 with its ``kernels`` extra
    (``pip install "sentence-transformers[kernels]>=6.3"``).

    Example::

        from sentence_transformers import MultiVectorEncoder
        from lik_plugins.sentence_transformers import kernel_config

        model = MultiVectorEncoder("lightonai/GTE-ModernColBERT-v1", kernel_config=kernel_config())
    """
    try:
        from transformers import KernelConfig
    except ImportError as exc:  # pragma: no cover - transformers comes with sentence-transformers
        raise ImportError('kernel_config() needs transformers: pip install "sentence-transformers[kernels]>=6.3"') from exc
    mapping = {target: f"{REPOSITORY}:{layer}" for target, layer in LAYERS.items()}
    return KernelConfig(mapping, use_local_kernel=True)


def is_our_layer(entry: Any, use_local_kernel: bool) -> bool:
    """Whether one ``kernel_mapping`` value names a layer of :data:`REPOSITORY`: a
    ``"path:Layer"`` string (or ``(string, metadata)``) read as a local folder, a device dict
    whose every value is ours, or a ``kernels.LocalLayerRepository`` over that folder."""
    if isinstance(entry, dict):
        return bool(entry) and all(is_our_layer(value, use_local_kernel) for value in entry.values())
    if isinstance(entry, tuple) and entry:
        entry = entry[0]
    if isinstance(entry, str):
        path, separator, layer = entry.rpartition(":")
        return use_local_kernel and bool(separator) and layer in LAYERS.values() and _same_folder(path)
    path = getattr(entry, "_repo_path", None)   # kernels.LocalLayerRepository
    return path is not None and getattr(entry, "layer_name", None) in LAYERS.values() and _same_folder(path)


def _same_folder(path: Any) -> bool:
    try:
        return Path(path).resolve() == REPOSITORY
    except (TypeError, OSError):
        return False
