"""Kernel binaries shipped with the package, launched without Triton's JIT.

``binaries/<arch>.zip`` holds one architecture's cubins (deflated, each read on its first use)
and ``manifest.json``, which gives per variant a host's calls reach (keyed by
:func:`variants.variant`) the cubin and what launching it takes: the function name, warps,
shared memory, one parameter code per positional argument (:mod:`binaries_cuda`), and the
variant's group and hints (:func:`variants.group`).  ``python -m lik_plugins.precompile
--ship`` writes them (:mod:`binaries_build`).  :func:`find` is the direct launcher's first stop
for a launch it has no plan for; where it answers ``None`` the launch goes through the JIT as
before, and :func:`diagnostics` says why.

Nothing here imports Triton's compiler or driver: the binaries load through the CUDA driver
API, so the installed Triton's version does not matter, only the kernels' source (each
kernel's :func:`file_key`, checked against the manifest's).  Before the first shipped launch
on a device the self-check kernel's binary runs (:func:`_self_check`); any failure there -- no
``libcuda``, a driver older than the binaries, a load error, a wrong value -- leaves the device
on the JIT path, with the reason.  On by default; ``LIK_SHIPPED_BINARIES=0`` turns it off.

The JIT's own binaries launch through the same driver call (:func:`from_jit`): after a plan's
first launch through the JIT, later ones skip the JIT's per-call argument handling.
"""
from __future__ import annotations

import hashlib
import json
import threading
import types
import zipfile
from pathlib import Path

import torch

from . import binaries_cuda as cuda
from .variants import CHECK_CALLS, CHECK_META, group, self_check_kernel, serves, specialisation, variant

BINARIES_DIR = Path(__file__).with_name("binaries")
FORMAT = 3
MANIFEST = "manifest.json"         # the archive's member naming the others
_PACKAGE = __name__.split(".")[0] + "."

_lock = threading.Lock()
_driver: list = []                 # [Driver] or [reason]: opened once per process
_devices: dict = {}                # ordinal -> _Device, or the reason it serves nothing
_stale: dict = {}                  # kernel name -> reason its binaries are not used
_missing: dict = {}                # kernel name -> launches with no shipped binary
_unserved: dict = {}               # kernel name -> the first of those launches' variant keys
_UNSERVED_KEPT = 16
_file_keys: dict = {}              # id(kernel) -> file_key(kernel)
_driver_checked: dict = {}         # ordinal -> True, or why the JIT's binaries stay on the JIT's launcher
_jit_only: dict = {}               # kernel name -> why a JIT binary of it cannot launch through the driver


def file_key(kernel) -> str:
    """A digest of the files a Triton kernel's binary is compiled from: the bytes and place
    of its code's file and of every JIT function of the package it calls (through a global
    name or a module attribute), transitively, and the values of the plain constants it
    names.  Equal to the build's, the source is the build's; any edit of those files, a
    comment included, retires the binaries until they are rebuilt (a CPU test names the
    rebuild)."""
    digest = hashlib.sha256()
    seen: set = set()

    def visit(jit) -> None:
        fn = getattr(jit, "fn", jit)
        fn = getattr(fn, "fn", fn)                  # an Autotuner wraps the JIT function
        if id(fn) in seen:
            return
        seen.add(id(fn))
        digest.update(f"{_file_sha(fn.__code__.co_filename)}:{fn.__code__.co_firstlineno}".encode())
        names = set().union(*(c.co_names for c in _codes(fn.__code__)))
        for name in sorted(names):
            value = fn.__globals__.get(name)
            if isinstance(value, types.ModuleType):
                for attr in sorted(names):
                    note(getattr(value, attr, None), f"{name}.{attr}")
            else:
                note(value, name)

    def note(value, label) -> None:
        if value is None:
            return
        if hasattr(value, "fn") and callable(value):
            # our JIT functions only: Triton's own (``tl.max``, ...) belong to the compiler
            # that built the binary, and hashing them would tie the key to a Triton release
            if getattr(getattr(value, "fn", None), "__module__", "").startswith(_PACKAGE):
                visit(value)
        elif isinstance(value, (bool, int, float, str)) or type(value).__name__ == "constexpr":
            digest.update(f"{label}={getattr(value, 'value', value)!r};".encode())

    visit(kernel)
    return digest.hexdigest()


_file_shas: dict = {}              # file name -> sha256 of its bytes


def _file_sha(filename: str) -> str:
    value = _file_shas.get(filename)
    if value is None:
        with open(filename, "rb") as fh:
            value = _file_shas[filename] = hashlib.sha256(fh.read()).hexdigest()
    return value


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def archive_path(arch: str, root: Path | None = None) -> Path:
    """Where ``arch``'s binaries are (under ``root``, default the package's)."""
    return (root or BINARIES_DIR) / f"{arch}.zip"


def read_manifest(arch: str, root: Path | None = None) -> dict:
    """The manifest of ``arch``'s archive, checked for its format."""
    with zipfile.ZipFile(archive_path(arch, root)) as archive:
        return _manifest_of(archive)


def _manifest_of(archive: zipfile.ZipFile) -> dict:
    manifest = json.loads(archive.read(MANIFEST))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{archive.filename}: format {manifest.get('format')!r}, this loader reads {FORMAT}")
    return manifest


def shipped_manifests(root: Path | None = None) -> dict:
    """``{arch: manifest}`` of every archive shipped (under ``root``)."""
    return {path.stem: read_manifest(path.stem, root) for path in sorted((root or BINARIES_DIR).glob("sm_*.zip"))}


class _Device:
    """The shipped binaries of one device: its architecture's archive (opened once: its
    directory of a few hundred members takes milliseconds to read, on a first call), the
    manifest and the variants loaded so far."""

    def __init__(self, driver: cuda.Driver, ordinal: int, arch: str, manifest: dict, archive: zipfile.ZipFile | None):
        self.driver, self.ordinal, self.arch, self._archive = driver, ordinal, arch, archive
        self._read_lock = threading.Lock()      # one ZipFile, read from the threads that launch
        self.entries = manifest["variants"]
        self.file_keys = manifest["file_keys"]
        self.loaded: dict = {}
        self.chosen: dict = {}             # a launch's variant -> the key of the binary serving it, or None
        self.served: dict = {}             # a launch's variant -> its loaded binary (find's first look)
        self._groups: dict = {}            # group -> [(hints, params, key)], most specialised first

    def key_for(self, variant: tuple) -> str | None:
        """The manifest key of the binary that serves a launch of ``variant``: its own, else
        the most specialised one of its group whose hints the launch satisfies; decided once
        per variant."""
        if variant not in self.chosen:
            self.chosen[variant] = self._choose(variant)
        return self.chosen[variant]

    def _choose(self, variant: tuple) -> str | None:
        key = variant_key(variant)
        if key in self.entries:
            return key
        name, hints = group(variant)
        candidates = self._groups.get(name)
        if candidates is None:      # one group's binaries, not the whole manifest's: a first call's cost
            candidates = sorted(((entry["hints"], entry["params"], other) for other, entry in self.entries.items()
                                 if entry["group"] == name), key=lambda c: (-specialisation(c[0]), c[0]))
            self._groups[name] = candidates
        for have, params, other in candidates:
            if serves(have, params, hints):
                return other
        return None

    def kernel(self, key: str | None):
        if key not in self.loaded and key in self.entries:
            self.loaded[key] = self._load(self.entries[key])
        return self.loaded.get(key)

    def _load(self, entry: dict) -> cuda.ShippedKernel:
        layout = cuda.LaunchLayout(entry["params"])
        with self._read_lock:
            image = self._archive.read(entry["file"])
        function = self.driver.load(image, entry["function"], entry["shared"], 32 * entry["num_warps"], self.ordinal)
        declared = self.driver.param_sizes(function)
        if declared is not None and declared != layout.param_sizes():
            raise cuda.CudaError(f"{entry['function']}: the binary takes parameters of {declared} bytes, "
                                 f"the manifest says {layout.param_sizes()}")
        return cuda.ShippedKernel(entry["function"], self.driver, function, entry["num_warps"], entry["shared"],
                                  layout, self.ordinal)


def _open_driver():
    if not _driver:
        try:
            _driver.append(cuda.Driver.open())
        except (OSError, AttributeError, cuda.CudaError) as exc:
            _driver.append(f"no usable CUDA driver library ({type(exc).__name__}: {exc})")
    return _driver[0]


def _open_device(ordinal: int):
    """The device's :class:`_Device`, or the reason it launches nothing shipped."""
    driver = _open_driver()
    if isinstance(driver, str):
        return driver
    try:
        major, minor = driver.capability(ordinal)
    except cuda.CudaError as exc:
        return f"device {ordinal}: {exc}"
    arch = f"sm_{major}{minor}"
    path = archive_path(arch)
    if not path.is_file():
        return f"no shipped binaries for {arch}"
    archive = None
    try:
        archive = zipfile.ZipFile(path)
        manifest = _manifest_of(archive)
        need = manifest["cuda_driver"]
        have = driver.version()
        if have < need:
            reason = f"the CUDA driver ({have}) is older than the binaries need ({need})"
        else:
            device = _Device(driver, ordinal, arch, manifest, archive)
            if _self_check(ordinal, _shipped_check_binary(device)):
                return device
            reason = "the shipped self-check kernel wrote other values than it must"
    except Exception as exc:    # a load or launch error of the check: this device stays on the JIT
        reason = f"the shipped self-check failed ({type(exc).__name__}: {exc})"
    if archive is not None:     # the device serves nothing shipped: its archive is not read again
        archive.close()
    return reason


def _self_check(ordinal: int, binary_for) -> bool:
    """Two launches through the driver of the self-check kernel's binary (``binary_for(args)``)
    with other lengths, scalars and output rows; input and outputs copied to the device in one
    copy and back in one, compared on the host.  No PyTorch kernel runs (a first use of one
    loads its module: tens of ms inside a user's first step).  On a stream of its own: the
    copy back waits for the check's launches, not for the work the caller queued before its
    first launch (a step's encoder forward)."""
    x_host = torch.arange(100, dtype=torch.float32)
    side = torch.cuda.Stream(ordinal)
    with torch.cuda.stream(side):
        rows = torch.cat([x_host[None], torch.full((len(CHECK_CALLS), 100), -1.0)]).to(f"cuda:{ordinal}")
        x, outs = rows[0], rows[1:]
        for out, (n, scale) in zip(outs, CHECK_CALLS):
            args = (x, out, n, scale)
            binary = binary_for(args)
            if binary is None:
                return False
            binary((2,), side.cuda_stream, args)
        got = outs.cpu()
    want = torch.stack([torch.where(torch.arange(100) < n, x_host * k, -1.0) for n, k in CHECK_CALLS])
    return torch.equal(got, want)


def _shipped_check_binary(device: _Device):
    return lambda args: device.kernel(variant_key(variant(self_check_kernel, args, CHECK_META)))


def from_jit(compiled, n_args: int, ordinal: int):
    """``compiled`` (the JIT's binary of a launch with ``n_args`` positional arguments, loaded
    by that launch) as a :class:`binaries_cuda.ShippedKernel` that launches it through the
    driver; ``None`` where the driver path is not usable here or the kernel needs more than
    it sets up (:func:`diagnostics` says why): the caller keeps launching through the JIT."""
    driver = _open_driver()
    if isinstance(driver, str) or _driver_launches_ok(ordinal) is not True:
        return None
    try:
        return _wrap(driver, compiled, n_args, ordinal)
    except ValueError as exc:
        _jit_only.setdefault(compiled.metadata.name, str(exc))
        return None


def _wrap(driver, compiled, n_args: int, ordinal: int) -> cuda.ShippedKernel:
    codes = cuda.launch_codes(compiled, n_args)
    if compiled.function is None:
        compiled.run                       # Triton loads the binary onto the device on first use of ``run``
    md = compiled.metadata
    return cuda.ShippedKernel(md.name, driver, compiled.function, md.num_warps, md.shared, cuda.LaunchLayout(codes),
                              ordinal)


def _driver_launches_ok(ordinal: int):
    """True where launches through the driver were checked on the device: by the shipped
    self-check, else by the self-check kernel compiled through the JIT; else the reason."""
    ok = _driver_checked.get(ordinal)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return "not checked yet (the self-check copies to the host, which a CUDA graph's capture forbids)"
        if isinstance(_devices.get(ordinal), _Device):
            ok = True
        else:
            try:
                driver = _open_driver()
                x = torch.empty(100, device=f"cuda:{ordinal}")
                compiled = self_check_kernel.warmup(x, x, *CHECK_CALLS[0], grid=(2,), **CHECK_META)
                binary = _wrap(driver, compiled, 4, ordinal)
                ok = _self_check(ordinal, lambda args: binary) or \
                    "the self-check kernel, launched through the driver, wrote other values than it must"
            except Exception as exc:   # a load or launch error: the JIT's own launcher stays
                ok = f"the driver-launch self-check failed ({type(exc).__name__}: {exc})"
        _driver_checked[ordinal] = ok
    return ok


def variant_key(variant: tuple) -> str:
    """The manifest's key of a :func:`variants.variant` tuple."""
    return repr(variant)


def find(kernel, variant: tuple, ordinal: int):
    """The shipped binary for a launch of ``kernel`` whose :func:`variants.variant` is
    ``variant`` on CUDA device ``ordinal``, loaded on first use; ``None`` where there is none
    or it cannot be used here (:func:`diagnostics` says why)."""
    device = _devices.get(ordinal)
    if device is None:
        if not isinstance(_open_driver(), str) and torch.cuda.is_current_stream_capturing():
            return None                                  # the self-check copies to the host
        with _lock:
            device = _devices.get(ordinal)
            if device is None:
                device = _devices[ordinal] = _open_device(ordinal)
    if isinstance(device, str):
        return None
    shipped = device.served.get(variant)
    if shipped is not None:
        return shipped
    name = variant[0]
    if name in _stale:
        return None
    try:
        if id(kernel) not in _file_keys:
            _file_keys[id(kernel)] = file_key(kernel)
    except OSError as exc:    # no source to check (a .pyc-only install)
        _stale[name] = f"{name}: its source cannot be read to check the binaries ({type(exc).__name__}: {exc})"
        return None
    if _file_keys[id(kernel)] != device.file_keys.get(name):
        _stale[name] = (f"{name}: its source differs from the one the {device.arch} binaries were built from"
                        if name in device.file_keys else f"{name}: not among the shipped kernels")
        return None
    try:
        shipped = device.kernel(device.key_for(variant))
    except Exception as exc:
        _stale[name] = f"{name}: a binary failed to load ({type(exc).__name__}: {exc})"
        return None
    if shipped is None:
        _missing[name] = _missing.get(name, 0) + 1
        unserved = _unserved.setdefault(name, [])
        if len(unserved) < _UNSERVED_KEPT:
            unserved.append(variant_key(variant))
    else:
        device.served[variant] = shipped
    return shipped


def diagnostics() -> dict:
    """What the shipped binaries serve in this process and, where they serve nothing, why:
    ``devices`` (ordinal -> architecture and loaded variants, or the reason),
    ``driver_launch`` (ordinal -> True where the JIT's binaries launch through the driver,
    else the reason), ``jit_only`` (name -> why a JIT binary of that kernel launches through
    Triton's own launcher), ``kernels`` whose shipped binaries are not used (name -> reason),
    ``missing`` (name -> launches of a variant no shipped binary serves, which went through
    the JIT) and ``unserved`` (name -> the first of those variants' keys: what a wider
    precompile grid would add)."""
    devices = {}
    for ordinal, device in sorted(_devices.items()):
        devices[ordinal] = device if isinstance(device, str) else {
            "arch": device.arch, "shipped": len(device.entries), "loaded": len(device.loaded)}
    return {"devices": devices, "driver_launch": dict(_driver_checked), "jit_only": dict(_jit_only),
            "kernels": dict(_stale), "missing": dict(_missing),
            "unserved": {name: list(keys) for name, keys in _unserved.items()}}


def reset() -> None:
    """Forget every device and reason (the next launch opens them again); tests use it."""
    for state in (_driver, _devices, _stale, _missing, _unserved, _file_keys, _file_shas, _driver_checked, _jit_only):
        state.clear()
