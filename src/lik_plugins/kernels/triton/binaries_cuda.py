"""The CUDA driver API through ``ctypes``: load a shipped kernel binary and launch it.

This is the part of a Triton launch that does not depend on Triton: ``cuModuleLoadData``
and ``cuModuleGetFunction`` once per binary and device, ``cuLaunchKernel`` on PyTorch's
current stream per call.  The kernel's parameters are the arguments Triton kept when it
compiled the variant (constexprs and integers specialised to 1 are compiled in, so they
are not passed), then two null pointers: the global and profile scratch buffers every
Triton kernel of the supported releases takes last (the binaries shipped need neither:
the build refuses kernels that use scratch memory).
"""
from __future__ import annotations

import ctypes
import re
import struct
import threading

# parameter codes (the manifest's ``params``): one character per positional argument
POINTER, INT32, INT64, UINT64, FLOAT32, INT8, DROPPED = "P", "i", "l", "Q", "f", "B", "-"
# each parameter in its own 8-byte slot, little-endian, padded explicitly (no native alignment)
_SLOT = {POINTER: "Q", INT32: "i4x", INT64: "q", UINT64: "Q", FLOAT32: "f4x", INT8: "B7x"}
# the size the kernel's own parameter has, for the load-time check against the binary
PARAM_BYTES = {POINTER: 8, INT32: 4, INT64: 8, UINT64: 8, FLOAT32: 4, INT8: 1}
# Triton's argument types (the compiled signature) -> parameter code
TRITON_TYPES = {"i32": INT32, "i64": INT64, "u64": UINT64, "fp32": FLOAT32, "f32": FLOAT32, "i1": INT8,
                "u1": INT8, "constexpr": DROPPED}
SCRATCH_POINTERS = 2

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
_FUNC_MAX_DYNAMIC_SHARED = 8          # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_FUNC_STATIC_SHARED = 1               # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_FUNC_MAX_THREADS = 0                 # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
_DEVICE_SHARED_OPTIN = 97             # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_DEVICE_CC_MAJOR, _DEVICE_CC_MINOR = 75, 76
_CACHE_PREFER_SHARED = 1              # CU_FUNC_CACHE_PREFER_SHARED
_STATIC_SHARED_LIMIT = 49152          # above this a kernel must opt in to dynamic shared memory


def param_code(triton_type: str) -> str:
    """The parameter code of one entry of a compiled Triton signature (``*bf16`` -> pointer)."""
    if triton_type.startswith("*"):
        return POINTER
    code = TRITON_TYPES.get(triton_type)
    if code is None:
        raise ValueError(f"no shipped-binary parameter for Triton type {triton_type!r}")
    return code


_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr)?(?:\s+\.global)?(?:\s+\.align\s+\d+)?\s+(\w+)")
_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_param_sizes(ptx: str, function: str) -> list[int]:
    """The sizes of the parameters the PTX entry ``function`` declares, in order."""
    start = ptx.index(f".entry {function}(")
    header = ptx[start:ptx.index(")", start)]
    return [_PTX_BYTES[ty[1:]] for ty, _ in _PTX_PARAM.findall(header)]


def launch_codes(compiled, n_args: int) -> str:
    """The parameter codes of a Triton-compiled kernel launched with ``n_args`` positional
    arguments: which of them Triton kept as parameters and with which type, read from its
    compiled signature and checked against the parameters its PTX entry declares (count and
    sizes, the scratch pointers last), so a Triton whose kernel ABI differs is refused here,
    never at a launch.  Kernels that need more than a plain ``cuLaunchKernel`` (scratch
    memory, clusters, programmatic dependent launch, cooperative grids, tensor descriptors)
    are refused too.  ``ValueError`` says why."""
    md = compiled.metadata
    name = md.name
    refused = [why for why, bad in (
        ("global scratch memory", md.global_scratch_size), ("profile scratch memory", md.profile_scratch_size),
        ("thread-block clusters", md.num_ctas != 1), ("programmatic dependent launch", md.launch_pdl),
        ("a cooperative grid", md.launch_cooperative_grid),
        ("tensor descriptors", getattr(md, "tensordesc_meta", None)),
    ) if bad]
    if refused:
        raise ValueError(f"{name}: needs {', '.join(refused)}, which a launch through the driver does not set up")
    types = list(compiled.src.signature.values())
    if any(isinstance(t, tuple) for t in types):
        raise ValueError(f"{name}: tuple arguments are not supported by a launch through the driver")
    if any(t != "constexpr" for t in types[n_args:]):
        raise ValueError(f"{name}: a parameter after the positional arguments is not a constexpr")
    codes = "".join(param_code(t) for t in types[:n_args])
    declared = ptx_param_sizes(compiled.asm["ptx"], name)
    expected = LaunchLayout(codes).param_sizes()
    if declared != expected:
        raise ValueError(f"{name}: the PTX declares parameters of {declared} bytes, the signature gives {expected} "
                         "(a Triton whose kernel ABI this launcher does not know)")
    return codes


class LaunchLayout:
    """The parameter memory of one variant, built when it loads: one 8-byte slot per parameter
    and the array of slot addresses ``cuLaunchKernel`` reads.  ``codes`` has one code per
    positional argument of the launch (``-`` for those compiled in); the scratch pointers follow."""

    def __init__(self, codes: str):
        kept = [i for i, c in enumerate(codes) if c != DROPPED]
        self.codes = codes
        self.slots = len(kept) + SCRATCH_POINTERS
        self.buffer = ctypes.create_string_buffer(8 * self.slots)      # scratch slots stay 0: null pointers
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * self.slots)(*[base + 8 * k for k in range(self.slots)])
        # one generated function per layout: index, read addresses and pack in a single
        # Python call (a loop over the arguments costs several times as much per launch)
        values = ", ".join(f"a[{i}].data_ptr()" if codes[i] == POINTER else f"a[{i}]" for i in kept)
        scope = {"_pack": struct.Struct("<" + "".join(_SLOT[codes[i]] for i in kept)).pack_into,
                 "_buffer": self.buffer}
        exec(f"def pack(a):\n    _pack(_buffer, 0{', ' if values else ''}{values})\n", scope)
        # pack(args): one call's arguments into the slots (tensors as their device addresses);
        # ShippedKernel checks their count
        self.pack = scope["pack"]

    def param_sizes(self) -> list[int]:
        """The size of each kernel parameter in order, scratch pointers included."""
        return [PARAM_BYTES[c] for c in self.codes if c != DROPPED] + [8] * SCRATCH_POINTERS


class CudaError(RuntimeError):
    pass


class Driver:
    """The driver entry points the loader uses, from ``libcuda.so.1`` (or a stand-in with
    the same functions, for tests)."""

    def __init__(self, lib):
        self.lib = lib
        vp, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        for name, argtypes in (
                ("cuInit", [u]), ("cuDriverGetVersion", [ctypes.POINTER(i)]),
                ("cuDeviceGet", [ctypes.POINTER(i), i]),
                ("cuDeviceGetAttribute", [ctypes.POINTER(i), i, i]),
                ("cuCtxGetCurrent", [ctypes.POINTER(vp)]), ("cuCtxSetCurrent", [vp]),
                ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), i]),
                ("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]),
                ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                ("cuFuncGetAttribute", [ctypes.POINTER(i), i, vp]), ("cuFuncSetAttribute", [vp, i, i]),
                ("cuFuncSetCacheConfig", [vp, i]),
                ("cuLaunchKernel", [vp, u, u, u, u, u, u, u, vp, vp, vp]),
                ("cuGetErrorString", [i, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        # CUDA 12.4+: the size of each parameter of a loaded function (a check, where present)
        self._param_info = getattr(lib, "cuFuncGetParamInfo", None)
        if self._param_info is not None:
            self._param_info.argtypes = [vp, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.POINTER(ctypes.c_size_t)]
            self._param_info.restype = ctypes.c_int
        self._launch = lib.cuLaunchKernel
        self._contexts: dict[int, int] = {}
        self._check(lib.cuInit(0), "cuInit")

    @classmethod
    def open(cls) -> "Driver":
        return cls(ctypes.CDLL("libcuda.so.1"))

    def _check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(f"{what}: CUDA error {code} ({(text.value or b'?').decode()})")

    def _int(self, fn, *args) -> int:
        out = ctypes.c_int()
        self._check(getattr(self.lib, fn)(ctypes.byref(out), *args), fn)
        return out.value

    def version(self) -> int:
        """The driver's CUDA version, e.g. 13000 for 13.0."""
        return self._int("cuDriverGetVersion")

    def capability(self, ordinal: int) -> tuple[int, int]:
        device = self._int("cuDeviceGet", ordinal)
        return (self._int("cuDeviceGetAttribute", _DEVICE_CC_MAJOR, device),
                self._int("cuDeviceGetAttribute", _DEVICE_CC_MINOR, device))

    def make_current(self, ordinal: int) -> None:
        """Make the device's primary context (the one PyTorch uses) current in this thread."""
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            device = self._int("cuDeviceGet", ordinal)
            handle = ctypes.c_void_p()
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain")
            ctx = self._contexts[ordinal] = handle.value
        current = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != ctx:
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, image: bytes, name: str, shared: int, threads: int, ordinal: int) -> int:
        """Load ``image`` (a cubin) into the device's primary context; the handle of its
        function ``name``, set up to take ``shared`` bytes of dynamic shared memory."""
        self.make_current(ordinal)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                    "cuModuleGetFunction")
        handle = function.value
        if threads > self._int("cuFuncGetAttribute", _FUNC_MAX_THREADS, handle):
            raise CudaError(f"{name}: {threads} threads per block exceed what the binary allows")
        device = self._int("cuDeviceGet", ordinal)
        optin = self._int("cuDeviceGetAttribute", _DEVICE_SHARED_OPTIN, device)
        if shared > optin:
            raise CudaError(f"{name}: needs {shared} bytes of shared memory, the device has {optin}")
        if shared > _STATIC_SHARED_LIMIT:
            # as Triton's own loader: prefer shared memory and allow all the device opts in to
            static = self._int("cuFuncGetAttribute", _FUNC_STATIC_SHARED, handle)
            self._check(self.lib.cuFuncSetCacheConfig(handle, _CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
            self._check(self.lib.cuFuncSetAttribute(handle, _FUNC_MAX_DYNAMIC_SHARED, optin - static),
                        "cuFuncSetAttribute")
        return handle

    def param_sizes(self, function: int) -> list[int] | None:
        """The sizes of the function's parameters as the binary declares them (``None``
        where the driver cannot tell: before CUDA 12.4)."""
        if self._param_info is None:
            return None
        sizes, offset, size = [], ctypes.c_size_t(), ctypes.c_size_t()
        while self._param_info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == CUDA_SUCCESS:
            sizes.append(size.value)
        return sizes or None        # none at all: a binary without parameter records, not a mismatch

    def relaunch(self, code: int, function: int, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
                 params, ordinal: int) -> None:
        """After a launch that returned ``code``: a thread that has not used this device yet
        gets its primary context and the launch is made again; any other error raises."""
        if code == CUDA_ERROR_INVALID_CONTEXT:
            self.make_current(ordinal)
            code = self._launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, params, None)
        self._check(code, "cuLaunchKernel")


class ShippedKernel:
    """One loaded binary on one device: ``kernel(grid, stream, args)`` launches it."""

    __slots__ = ("name", "driver", "function", "threads", "shared", "layout", "ordinal", "_lock", "_launch",
                 "_pack", "_params", "_n_args")

    def __init__(self, name: str, driver: Driver, function: int, num_warps: int, shared: int, layout: LaunchLayout,
                 ordinal: int):
        self.name, self.driver, self.function = name, driver, function
        self.threads, self.shared, self.layout, self.ordinal = 32 * num_warps, shared, layout, ordinal
        # the slots are shared by every call of this variant; the driver call releases the
        # GIL, so two threads launching it at once must not interleave packing and launch
        self._lock = threading.Lock()
        self._launch, self._pack, self._params = driver._launch, layout.pack, layout.params
        self._n_args = len(layout.codes)

    def __call__(self, grid: tuple, stream: int, args: tuple) -> None:
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        if gx * gy * gz == 0:
            return
        if len(args) != self._n_args:
            raise TypeError(f"{self.name}: the binary takes {self._n_args} positional arguments, "
                            f"the launch passed {len(args)}")
        with self._lock:
            self._pack(args)
            code = self._launch(self.function, gx, gy, gz, self.threads, 1, 1, self.shared, stream, self._params,
                                None)
            if code != CUDA_SUCCESS:       # the driver retries where this thread had no context yet
                self.driver.relaunch(code, self.function, (gx, gy, gz), self.threads, self.shared, stream,
                                     self._params, self.ordinal)
