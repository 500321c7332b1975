"""``fast_plaid.search.FastPlaid.search`` served by :func:`lik_plugins.plaid_search.plaid_search`.

Whoever calls it -- PyLate's ``indexes.PLAID``, colpali-engine's ``get_topk_plaid``, a user --
gets what fast-plaid returns (per query a list of ``(passage_id, score)``, best first) from
the same index folder (``self.index``), read in whichever layout a release wrote it
(:mod:`._files`).  Each release's own ``search`` signature is bound (its parameters, its
defaults); the parameters that do not change results are accepted and left to ours:
``batch_size`` (an int, or ``"auto"`` where the release takes it: ours sizes its own query
batches), ``show_progress`` and ``n_processes`` (fast-plaid's CPU threads).  Queries are
searched as the release searches them: 1.4 pads a list and probes with every token, 1.5 and
newer (``pack_queries`` in the release's module) drop each query's trailing zero tokens.

Ours serves when the index is searched on one CUDA device (or on the CPU under
``LIK_BACKEND=triton``, the interpreter's tests) and placed on it (1.4: ``low_memory`` off;
1.5 and newer: ``index_gpu_memory`` ``"auto"`` -- where the index fits in
``index_memory_fraction`` of the device -- ``"medium"`` or ``"high"``), the queries are a 3-D
tensor or a list of 2-D / 3-D tensors, the files are in a known layout, and neither
``LIK_DISABLE=1`` nor a host's ``*_SCORES_BACKEND=torch`` / ``flash`` asks for the host's code.
Everything else runs fast-plaid's own search.  :func:`lik_plugins.routing_counts` counts every
call under ``fast_plaid.search`` and :func:`lik_plugins.routing_reasons` the reason of each call
fast-plaid served (an unknown layout or parameter among them).

Once ours has served an index, fast-plaid's copy of it on the device is released
(``FastPlaid.indices``); fast-plaid reloads it from disk by itself if it is asked to search
again (after ``unpatch_fast_plaid()``, say): one copy of the index on the GPU, not two.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

import torch

from .. import _routing
from .._config import disabled, forced_backend, scores_backend
from ..kernels.dispatch import served_by
from ._files import UnknownIndexLayout, index_files

ENTRY = "fast_plaid.search"

#: Every parameter some release's ``search`` takes, and that ours serves; a release with
#: another one is served by fast-plaid (its meaning is unknown here).
KNOWN_PARAMETERS = ("self", "queries_embeddings", "top_k", "batch_size", "n_full_scores", "n_ivf_probe",
                    "show_progress", "subset", "n_processes")
#: The hosts' switches to their own code, which reaches their PLAID search too.
HOST_BACKENDS = ("PYLATE_SCORES_BACKEND", "COLPALI_SCORES_BACKEND")

logger = logging.getLogger(__name__)
_logged: set = set()


def _declined(reason: str) -> None:
    """Count a call fast-plaid serves, and why (logged once per reason)."""
    _routing.record(ENTRY, "original", reason=reason)
    if reason not in _logged:
        _logged.add(reason)
        logger.info("lik_plugins: fast-plaid serves its own search (%s)", reason)


def _switched_off() -> str | None:
    if disabled():
        return "LIK_DISABLE=1"
    for variable in HOST_BACKENDS:
        value = scores_backend(variable)
        if value in ("torch", "flash"):
            return f"{variable}={value}"
    return None


def _device(fast_plaid) -> torch.device | str:
    """The one device ours searches on, or why not."""
    devices = getattr(fast_plaid, "devices", None)
    if not isinstance(devices, list) or len(devices) != 1:
        return "not one device"
    device = torch.device(devices[0])
    if device.type == "cpu" and forced_backend() != "triton":
        return "a CPU index (fast-plaid's CPU search)"
    if device.type not in ("cuda", "cpu"):
        return f"a {device.type} index"
    path = served_by(torch.empty(0, dtype=torch.float16, device=device), "residual")
    return device if path == "triton" else f"the kernels do not serve {device} ({path})"


def _placement(fast_plaid) -> str | None:
    """Why the user's placement keeps ours out (None: the index may live on the device)."""
    if hasattr(fast_plaid, "index_gpu_memory"):                     # 1.5 and newer
        tier = fast_plaid.index_gpu_memory
        if tier == "low":
            return "index_gpu_memory='low' (documents kept in host memory)"
        return None if tier in ("auto", "medium", "high") else f"unknown index_gpu_memory={tier!r}"
    if hasattr(fast_plaid, "low_memory"):                           # 1.4
        return "low_memory=True (documents kept in host memory)" if fast_plaid.low_memory else None
    return "FastPlaid has neither index_gpu_memory nor low_memory"


def _fits(fast_plaid, device: torch.device, files) -> bool:
    """``index_gpu_memory="auto"``: whether our copy (int32 codes, uint8 residuals) fits where
    fast-plaid's rule would put its own -- free memory less the index leaves at least
    ``1 - index_memory_fraction`` of the device."""
    if getattr(fast_plaid, "index_gpu_memory", None) != "auto" or device.type != "cuda":
        return True
    tokens = sum(files.lengths)
    row_bytes = 4 + files.row_bytes                  # an int32 code and the residual's bytes
    free, total = torch.cuda.mem_get_info(device)
    fraction = float(getattr(fast_plaid, "index_memory_fraction", 0.7))
    return free - tokens * row_bytes >= (1.0 - fraction) * total


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _argument_refuses(arguments: dict, signature: inspect.Signature) -> str | None:
    for name in ("top_k", "n_full_scores", "n_ivf_probe"):
        if not _positive_int(arguments[name]):
            return f"{name}={arguments[name]!r}"
    batch = arguments["batch_size"]
    if not (_positive_int(batch) or batch == signature.parameters["batch_size"].default):
        return f"batch_size={batch!r}"       # fast-plaid's own error, or its own meaning
    return None


def _true_length(q: torch.Tensor) -> int:
    """1.5+'s query length: its last nonzero token + 1 (at least 1)."""
    nonzero = (q != 0).any(dim=-1).nonzero()
    return int(nonzero[-1]) + 1 if nonzero.numel() else 1


def _queries(queries_embeddings, packs: bool):
    """``(Q [Nq, Lq, d], lengths or None)`` as the release searches them, or None (not served):
    1.4 pads a list with zero tokens and keeps them; 1.5+ (``packs``) keeps each query's tokens
    up to its last nonzero one."""
    if isinstance(queries_embeddings, torch.Tensor) and queries_embeddings.dim() == 3:
        if not packs:
            return queries_embeddings, None
        queries = list(queries_embeddings.unbind(0))
    elif isinstance(queries_embeddings, list) and queries_embeddings \
            and all(isinstance(q, torch.Tensor) and q.dim() in (2, 3) for q in queries_embeddings):
        queries = [q[0] if q.dim() == 3 else q for q in queries_embeddings]
    else:
        return None
    lengths = [_true_length(q) for q in queries] if packs else None
    if packs:
        queries = [q[:n] for q, n in zip(queries, lengths)]
    return torch.nn.utils.rnn.pad_sequence(queries, batch_first=True, padding_value=0.0), lengths


def _normalised_subset(subset, n_queries: int):
    """fast-plaid's own normalisation of ``subset`` (``FastPlaid._prepare_search``)."""
    if subset is None:
        return None
    if isinstance(subset, int):
        subset = [subset] * n_queries
    if isinstance(subset, list) and len(subset) == 0:
        return None
    if isinstance(subset, list) and isinstance(subset[0], int):
        subset = [subset] * n_queries
    if len(subset) != n_queries:
        raise ValueError("Subset length must match number of queries.")
    return subset


def _release_host_copy(fast_plaid) -> None:
    lock = getattr(fast_plaid, "_index_swap_lock", None)
    indices = getattr(fast_plaid, "indices", None)
    if lock is None or not isinstance(indices, dict) or all(v is None for v in indices.values()):
        return
    with lock:
        fast_plaid.indices = {device: None for device in indices}


def _plan(fast_plaid, arguments: dict, signature: inspect.Signature, packs: bool):
    """``(device, (Q, lengths))`` where ours serves this call, else the reason it does not."""
    reason = _switched_off() or _placement(fast_plaid) or _argument_refuses(arguments, signature)
    if reason:
        return reason
    device = _device(fast_plaid)
    if isinstance(device, str):
        return device
    queries = _queries(arguments["queries_embeddings"], packs)
    if queries is None:
        return "queries not a 3-D tensor or a list of 2-D / 3-D tensors"
    if not os.path.exists(os.path.join(fast_plaid.index, "metadata.json")):
        return "no index on disk"                       # fast-plaid's own error
    try:
        files = index_files(fast_plaid.index)
    except UnknownIndexLayout as exc:
        logger.info("lik_plugins: %s", exc)
        return "unknown index layout"
    if not _fits(fast_plaid, device, files):
        return "index_gpu_memory='auto' and the index does not fit index_memory_fraction"
    return device, queries


def make_search(original):
    """The replacement of ``FastPlaid.search`` for the release ``original`` comes from."""
    signature = inspect.signature(original)
    unknown = [name for name in signature.parameters if name not in KNOWN_PARAMETERS]
    missing = [name for name in KNOWN_PARAMETERS[:6] if name not in signature.parameters]
    # a release's own signature decides for every call: one it does not match is never ours
    release_reason = (f"unknown search parameter {unknown[0]!r}" if unknown
                      else f"search without parameter {missing[0]!r}" if missing else None)
    packs = hasattr(sys.modules.get(original.__module__), "pack_queries")

    def search(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            bound.apply_defaults()
        plan = (release_reason or _plan(self, bound.arguments, signature, packs)) if bound is not None \
            else "arguments fast-plaid's search does not take"          # its own TypeError follows
        if isinstance(plan, str):
            _declined(plan)
            return original(self, *args, **kwargs)
        return _serve(self, *plan, bound.arguments)

    return search


def _serve(fast_plaid, device: torch.device, queries, arguments: dict):
    from .. import plaid_search

    Q, lengths = queries
    subset = _normalised_subset(arguments.get("subset"), Q.shape[0])
    with torch.inference_mode():
        _release_host_copy(fast_plaid)              # before ours loads: never two copies at once
        index = plaid_search.load_fast_plaid_index(fast_plaid.index, device)
        scores, ids = plaid_search.plaid_search(index, Q, arguments["top_k"], n_ivf_probe=arguments["n_ivf_probe"],
                                                n_full_scores=arguments["n_full_scores"], subset=subset,
                                                query_lengths=lengths)
    _routing.record(ENTRY, "triton")
    scores, ids = scores.cpu().tolist(), ids.cpu().tolist()                    # the one read-back
    return [[(p, s) for p, s in zip(row_ids, row) if s != float("-inf")] for row_ids, row in zip(ids, scores)]
