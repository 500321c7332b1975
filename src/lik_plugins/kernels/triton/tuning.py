"""Kernel configs (forward and lowmem grad_D): which exist, when to sweep, what a choice is keyed on.

The host picks the row blocking (``ROWS_PER_Q``, ``QPB``) from the shape; a config only
chooses the document tile and the pipeline (``BLOCK_N``, ``BLOCK_K``, warps, stages).  The
forward's key is ``(ROWS_PER_Q, QPB, D_PAD, SAVE_ARG, RUNNING_MAX, DOCS_PER_PROGRAM)``, the
launch's size class (:func:`size_class`) and the tensor dtypes, so batch size, document
length, mask presence and query length *within a power-of-two bucket* and a size class
never ask for another config.  (Mask presence, a constexpr, compiles a second variant of
the kernel once, with the same config.)

A sweep compiles every candidate config (a second or more each), so configs come first
from a per-architecture table committed as data (``configs/sm90.json``, written by
``benchmarks/tune_table.py`` from sweeps on that GPU): the exact key, else the same key in
the nearest size class, else -- on an architecture that has a table -- one default config.
Only an architecture without a table is swept, once per key, and Triton persists the
result on disk (``cache_results``).  Small launches (few programs: launch-bound) and
``TRITON_INTERPRET=1`` take one fixed config.  ``LIK_AUTOTUNE`` changes this (``_config.py``).
"""
from __future__ import annotations

import functools
import inspect
import json
from importlib import resources

import torch
import triton

from ..._config import autotune_mode
from .backward import maxsim_bwd_doc_kernel
from .forward import maxsim_fwd_kernel

_INTERPRETED = not isinstance(maxsim_fwd_kernel, triton.runtime.JITFunction)

# Below this many programs a launch is latency-bound: a sweep costs more than it saves.
SMALL_LAUNCH_PROGRAMS = 128


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    # not triton.cdiv: that is a JIT function, and calling one from the host is slow
    return -(-a // b)


def interpreting() -> bool:
    """The kernels run in Triton's interpreter.  Triton decides that when a kernel is
    defined (``TRITON_INTERPRET=1`` at import), so this asks a kernel, not the environment
    (which a caller may change later, and which costs microseconds per read)."""
    return _INTERPRETED


def size_class(n_programs: int) -> int:
    """Launch size class of the forward's autotuning: programs in factors of 8 from 2^12
    (0 below 4096, then 4096-32767, 32768-262143, ...).  A rerank of 1000 documents and
    one of 100k share every other key field, but the first is bound by latency and the
    second by HBM, and a config tuned on the first is slower on the second
    (docs/performance-notes.md, Forward).  Training batches of one size stay in one class."""
    return 0 if n_programs < 4096 else ((n_programs.bit_length() - 1) - 12) // 3 + 1


def k_tile(d_pad: int) -> int:
    return d_pad if d_pad <= 256 else 128


@functools.lru_cache(maxsize=None)
def _smem_budget() -> int:
    if not torch.cuda.is_available():
        return 96 * 1024
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))


def _smem_bytes(block_m, block_n, block_k, stages, elem) -> int:
    # query block resident + `stages` document tiles in flight + fp32 epilogue scratch
    return block_m * block_k * elem + stages * block_n * block_k * elem + block_m * block_n * 4


def _doc_smem_bytes(config: dict, stages: int, d_pad: int, elem: int) -> int:
    # lowmem grad_D: `stages` grad rows tiles [BLOCK_R, D_PAD] in flight + the [BLOCK_T, BLOCK_R] one-hot tile
    return stages * config["BLOCK_R"] * d_pad * elem + config["BLOCK_T"] * config["BLOCK_R"] * elem


def _smem_usable() -> int:
    """Shared memory a config may plan for: the budget less a margin for Triton's own use."""
    return _smem_budget() - 8 * 1024


def _prune(configs, named_args, **kwargs):
    block_m = kwargs["ROWS_PER_Q"] * kwargs["QPB"]
    elem = named_args["Q"].element_size()
    budget = _smem_usable()
    kept = [
        c for c in configs
        if _smem_bytes(block_m, c.kwargs["BLOCK_N"], kwargs["BLOCK_K"], c.num_stages, elem) <= budget
        # 8 warps only pay with a tall block (a warp needs >= 16 rows of the MMA)
        and (c.num_warps == 4 or block_m >= 128)
    ]
    return kept or configs[:1]


# An older Triton without ``cache_results`` sweeps again in every process (nothing persisted).
_PERSISTED = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

_tuned_forward = triton.autotune(
    configs=[triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
             for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)],
    key=["ROWS_PER_Q", "QPB", "D_PAD", "SAVE_ARG", "RUNNING_MAX", "DOCS_PER_PROGRAM", "size_class"],
    prune_configs_by={"early_config_prune": _prune},
    **_PERSISTED,
)(maxsim_fwd_kernel)


# Configs the autotuner settled on, by key: later calls launch the plain kernel with them
# and skip the autotuner's per-call argument handling (tens of microseconds).
_chosen: dict = {}


def forward_kernel_and_meta(*, rows_per_q, qpb, d_pad, dtype, n_programs, save_arg, running_max=False,
                            docs_per_program=1):
    """The kernel to launch, the meta-parameters the caller must pass, and a callback to
    run after the launch (records the autotuner's choice)."""
    block_k = k_tile(d_pad)
    if interpreting() or n_programs < SMALL_LAUNCH_PROGRAMS:
        meta = {"BLOCK_N": 64 if d_pad <= 256 else 32, "BLOCK_K": block_k}
        if not interpreting():
            # a 256-row block on 4 warps would hold 128 fp32 accumulators per thread
            meta.update(num_warps=8 if rows_per_q * qpb >= 256 else 4, num_stages=2)
        return maxsim_fwd_kernel, meta, None
    key = (rows_per_q, qpb, d_pad, bool(save_arg), bool(running_max), docs_per_program, size_class(n_programs),
           dtype)
    config = _chosen.get(key)
    if config is None:
        config = _from_table("forward", key, size_at=6,
                             default=_default_forward(rows_per_q * qpb, block_k, d_pad, dtype))
    if config is not None:
        return maxsim_fwd_kernel, {"BLOCK_K": block_k, **config}, None
    return _tuned_forward, {"BLOCK_K": block_k}, _remembering(_tuned_forward, key)


def _remembering(tuned, key: tuple):
    """The after-launch callback of a sweep: records the config ``tuned`` settled on for ``key``."""
    def remember():
        best = tuned.best_config
        _chosen[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}

    return remember


def _default_forward(block_m: int, block_k: int, d_pad: int, dtype) -> dict:
    """The config for a key the table lacks: the table's most common pick for 16-bit
    ColBERT shapes, with fewer stages where shared memory would not hold them."""
    elem = _operand_bytes(dtype)
    block_n = 64 if d_pad <= 256 and elem <= 2 else 32
    config = {"BLOCK_N": block_n, "num_warps": 8 if block_m >= 256 else 4, "num_stages": 3}
    return _fit_forward(config, block_m, block_k, elem)


def _operand_bytes(dtype) -> int:
    """Bytes per element of the forward's MMA operand: the documents' dtype (fp8 against
    float queries), but for documents built in the kernel (residual, projection head:
    (Q, D, kind, ...) keys) Q's dtype."""
    return (dtype if not isinstance(dtype, tuple) else dtype[0] if len(dtype) >= 3 else dtype[1]).itemsize


def _fit_forward(config: dict, block_m: int, block_k: int, elem: int) -> dict:
    """``config`` with fewer pipeline stages where shared memory would not hold them.
    _smem_bytes is the autotuner's estimate (it skips a config that does not fit); with no
    sweep to catch a miss, keep a margin: the estimate has fallen short of what a compiled
    fp32 config needed (docs/performance-notes.md, Host path)."""
    stages = config["num_stages"]
    while stages > 1 and 1.4 * _smem_bytes(block_m, config["BLOCK_N"], block_k, stages, elem) > _smem_usable():
        stages -= 1
    return {**config, "num_stages": stages}


def _fit_doc(config: dict, d_pad: int, elem: int) -> dict:
    """A lowmem grad_D config with fewer stages where shared memory would not hold them
    (the autotuner's prune, :func:`_doc_prune`)."""
    stages = config["num_stages"]
    while stages > 1 and _doc_smem_bytes(config, stages, d_pad, elem) > _smem_usable():
        stages -= 1
    return {**config, "num_stages": stages}


def _fitted(kernel: str, key: tuple, config: dict) -> dict:
    """A config of another architecture's table, made to fit this one's shared memory."""
    if kernel == "forward":
        return _fit_forward(config, key[0] * key[1], k_tile(key[2]), _operand_bytes(key[7]))
    return _fit_doc(config, key[2], 4 if key[3] else _operand_bytes(key[8]))


# ---------------------------------------------------------------- the config table
TABLE_VERSION = 1


def _encode_key(key: tuple) -> str:
    """A key as a stable string: dtypes by name (``torch.bfloat16`` -> ``bfloat16``)."""
    def enc(v):
        if isinstance(v, torch.dtype):
            return str(v).replace("torch.", "")
        if isinstance(v, tuple):
            return [enc(x) for x in v]
        return v
    return json.dumps(enc(key))


def architecture() -> str | None:
    """``"sm90"`` etc. for the current CUDA device, None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return f"sm{major}{minor}"


# Architectures without a table of their own, and the table they take instead: an A100
# (sm_80) gets the H100's picks, with fewer pipeline stages where its smaller shared memory
# would not hold them (:func:`_fitted`), and sweeps nothing -- so its launches are the ones
# ``precompile --ship --arch sm_80`` builds from the same table.  No sm_80 sweep has been run.
STAND_IN_TABLES = {"sm80": "sm90"}


def _table(arch: str | None) -> dict | None:
    """``{kernel: {encoded key: config}}`` for ``arch`` (its own, else the table it takes,
    :data:`STAND_IN_TABLES`), or None."""
    own = _own_table(arch)
    return own if own is not None else _own_table(STAND_IN_TABLES.get(arch))


@functools.lru_cache(maxsize=None)
def _own_table(arch: str | None) -> dict | None:
    """``{kernel: {encoded key: config}}`` for ``arch``, or None where none is committed."""
    if arch is None:
        return None
    try:
        text = resources.files(__package__).joinpath("configs", f"{arch}.json").read_text()
    except OSError:
        return None
    data = json.loads(text)
    if data.get("version") != TABLE_VERSION:
        return None
    table: dict = {}
    for entry in data["entries"]:
        # the table's keys were written by _encode_key (benchmarks/tune_table.py): dumped again, they match it
        table.setdefault(entry["kernel"], {})[json.dumps(entry["key"])] = entry["config"]
    return table


def _from_table(kernel: str, key: tuple, *, size_at: int | None, default: dict) -> dict | None:
    """The config for ``key`` without a sweep, remembered in ``_chosen``; None when the
    autotuner must run (``LIK_AUTOTUNE=1``, or no table for this GPU and sweeps allowed).
    ``size_at``: position of the size class in the key (the nearest class stands in)."""
    mode = autotune_mode()
    if mode == "always":
        return None
    arch = architecture()
    table = _table(arch)
    config = None
    if table is not None:
        rows = table.get(kernel, {})
        config = rows.get(_encode_key(key))
        if config is None and size_at is not None:
            # the same key in the nearest size class that has a row (the smaller of two as near)
            for other in sorted(range(8), key=lambda size: abs(size - key[size_at])):
                config = rows.get(_encode_key(key[:size_at] + (other,) + key[size_at + 1:]))
                if config is not None:
                    break
        if config is not None and _own_table(arch) is None:
            config = _fitted(kernel, key, config)
    if config is None:
        if table is None and mode == "auto":
            return None
        config = default
    _chosen[key] = dict(config)
    return _chosen[key]


# ---------------------------------------------------------------- lowmem grad_D
def _doc_prune(configs, named_args, **kwargs):
    d_pad = kwargs["D_PAD"]
    elem = 4 if kwargs["F32_DOT"] else named_args["Q"].element_size()
    budget = _smem_usable()
    kept = [
        c for c in configs
        # fp32 accumulator [BLOCK_T, D_PAD] must stay in registers
        if c.kwargs["BLOCK_T"] * d_pad <= 128 * 128
        and _doc_smem_bytes(c.kwargs, c.num_stages, d_pad, elem) <= budget
        and (c.num_warps == 4 or c.kwargs["BLOCK_T"] >= 64)
    ]
    return kept or [triton.Config({"BLOCK_T": 16, "BLOCK_R": 16}, num_warps=4, num_stages=1)]


_tuned_doc = triton.autotune(
    # tall token tiles and K >= 64 won every cross shape of the sweep behind the sm90 table;
    # narrower tiles stay for wide embeddings (the accumulator must fit)
    configs=[triton.Config({"BLOCK_T": t, "BLOCK_R": r}, num_warps=w, num_stages=st)
             for t in (32, 64, 128) for r in (64, 128) for w in (4, 8) for st in (2, 3)],
    key=["CROSS", "D_PAD", "F32_DOT", "NORMALIZE", "WITH_GATHER", "GUARD_ROWS", "COMPACT"],
    prune_configs_by={"early_config_prune": _doc_prune},
    **_PERSISTED,
)(maxsim_bwd_doc_kernel)


def doc_kernel_and_meta(*, d_pad, n_programs_at_64, cross, f32_dot, normalize, with_gather, dtype, guard_rows,
                        compact=False):
    """lowmem grad_D kernel, its meta-parameters and an after-launch callback, as
    :func:`forward_kernel_and_meta`.  The grid depends on BLOCK_T, so callers pass a grid
    function of the meta-parameters."""
    block_t = 64 if d_pad <= 128 else (32 if d_pad <= 256 else 16)
    if interpreting() or n_programs_at_64 < SMALL_LAUNCH_PROGRAMS:
        meta = {"BLOCK_T": block_t, "BLOCK_R": 32 if d_pad <= 256 else 16}
        if not interpreting():
            meta.update(num_warps=4, num_stages=2)
        return maxsim_bwd_doc_kernel, meta, None
    key = ("doc", bool(cross), d_pad, bool(f32_dot), bool(normalize), bool(with_gather), bool(guard_rows),
           bool(compact), dtype)
    config = _chosen.get(key)
    if config is None:
        config = _from_table("doc", key, size_at=None, default={
            "BLOCK_T": block_t, "BLOCK_R": 64 if d_pad <= 128 else 32, "num_warps": 4, "num_stages": 2})
    if config is not None:
        return maxsim_bwd_doc_kernel, dict(config), None
    return _tuned_doc, {}, _remembering(_tuned_doc, key)
