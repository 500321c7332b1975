"""Build the shipped kernel binaries (``binaries/<arch>.zip``): run by
``python -m lik_plugins.precompile --ship``, on any machine (no GPU needed).

Each variant is the binary the JIT's own ``warmup`` builds for that launch; what a launch
needs is read from the compiled kernel: the cubin, the function name, warps, shared memory
and its parameters (:func:`binaries_cuda.launch_codes`: a Triton whose kernel ABI differs
fails the build, not a launch).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import zipfile
from pathlib import Path

from . import binaries_cuda as cuda
from .binaries_loader import FORMAT, MANIFEST, archive_path, file_key, variant_key
from .variants import group, kernel_name, variant


# The section ``ptxas -lineinfo`` fills with the kernel's PTX source, for debuggers and
# profilers mapping SASS back to PTX; nearly half a cubin, and read by nothing that loads it.
_PTX_TEXT_SECTION = b".nv_debug_ptx_txt"


def without_ptx_text(cubin: bytes) -> bytes:
    """``cubin`` with the PTX text section's bytes set to zero (deflated, next to nothing):
    the ELF layout -- every section's offset and size, the code, its relocations -- is
    unchanged, so the driver loads the same kernel."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:      # 64-bit little-endian ELF
        raise ValueError("not a 64-bit little-endian ELF cubin")
    (table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, table + i * entry_size) for i in range(count)]
    names_at = sections[names_index][4]
    out = bytearray(cubin)
    for name, _, _, _, offset, size in sections:
        start = names_at + name
        if cubin[start:cubin.index(b"\0", start)] == _PTX_TEXT_SECTION:
            out[offset:offset + size] = bytes(size)
    return bytes(out)


def stage(todo: list[tuple], compiled: list, arch: str, stage_dir: Path, shared_limit: int) -> dict:
    """Write the cubins of ``todo``'s launches (``(kernel, args, meta)``, compiled for ``arch``
    as ``compiled``) into ``stage_dir`` and return their manifest entries, ``{key: entry}``.
    A binary needing more shared memory than ``shared_limit`` (the target's per-block opt-in)
    fails the build: the launchers planned a config that GPU cannot run."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    entries = {}
    for (kernel, args, meta), binary in zip(todo, compiled):
        md, cubin = binary.metadata, binary.asm["cubin"]
        entry = {"kernel": md.name, "function": md.name, "file": hashlib.sha256(cubin).hexdigest()[:24] + ".cubin",
                 "num_warps": md.num_warps, "shared": md.shared, "params": cuda.launch_codes(binary, len(args))}
        if entry["shared"] > shared_limit:
            raise ValueError(f"{entry['function']} {meta}: needs {entry['shared']} bytes of shared memory, "
                             f"{arch} has {shared_limit}")
        needed = variant(kernel, args, meta)
        entry["group"], entry["hints"] = group(needed)
        path = stage_dir / entry["file"]
        if not path.exists():
            path.write_bytes(without_ptx_text(cubin))
        entries[variant_key(needed)] = entry
    return entries


def ptxas_release() -> tuple[int, int]:
    """(major, minor) of the ``ptxas`` Triton compiles with."""
    import triton

    text = subprocess.run([triton.knobs.nvidia.ptxas.path, "--version"], capture_output=True, text=True,
                          check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


# every member's date: the same binaries give the same archive, byte for byte
_MEMBER_DATE = (2020, 1, 1, 0, 0, 0)


def write_archive(todo: list[tuple], entries: dict, arch: str, stage_dir: Path, out_root: Path | None,
                  workload: dict) -> Path:
    """Write ``<arch>.zip`` under ``out_root`` (default the package's binaries folder): the
    manifest of the merged ``entries`` and the cubins they name (from ``stage_dir``), deflated,
    in a stable order; its path.  ``workload``: the precompile arguments the variants came
    from (hosts, dtypes, dims), so a check can list them again and compare."""
    import triton
    import torch

    kernels = {kernel_name(kernel): kernel for kernel, _, _ in todo}      # one per kernel, not per variant
    file_keys = {name: file_key(kernel) for name, kernel in kernels.items()}
    major, minor = ptxas_release()
    manifest = {
        "format": FORMAT, "arch": arch, "workload": workload,
        "built_with": {"triton": triton.__version__, "torch": torch.__version__, "ptxas": f"{major}.{minor}"},
        # a cubin needs a driver of its ptxas' major CUDA release or newer (minor-version compatibility)
        "cuda_driver": major * 1000,
        "file_keys": dict(sorted(file_keys.items())),
        "variants": dict(sorted(entries.items())),
    }
    path = archive_path(arch, out_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    members = [(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())]
    members += [(name, (stage_dir / name).read_bytes()) for name in sorted({e["file"] for e in entries.values()})]
    partial = path.with_suffix(".zip.partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in members:
            info = zipfile.ZipInfo(name, _MEMBER_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data, compresslevel=9)
    partial.replace(path)          # a reader never sees half an archive
    return path
