"""Compile cuda/ sources with CuPy (NVRTC) once per process and launch on torch's stream.

Kernels take raw device pointers (torch's data_ptr(), passed as Python ints: CuPy hands an
8-byte integer to an 8-byte pointer parameter) and np.int32 scalars. Nothing here allocates:
outputs come from torch, so a launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from functools import lru_cache
from importlib.resources import files


def source_dir():
    return files("quantzoo.cuda")


def read_source(name: str) -> str:
    """The text NVRTC compiles: the file, plus a comment naming a hash of every header in cuda/.
    CuPy's on-disk kernel cache (~/.cupy/kernel_cache) keys a module by this text and the options
    only, not by what it #includes: without the hash, a changed header (an upgrade, an edit)
    silently reused the binary built from the old one."""
    return (source_dir() / name).read_text() + f"\n// quantzoo headers {_headers_hash()}\n"


@lru_cache(maxsize=None)
def _headers_hash() -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted((p for p in source_dir().iterdir() if p.name.endswith(".cuh")), key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def import_cupy():
    """Import CuPy even when the repository root is on sys.path.

    The repository's top-level cuda/ folder (installed as quantzoo.cuda) is also a plain package
    named `cuda` when the checkout root is on sys.path (PYTHONPATH=$PWD, `python -m pytest` run
    from the root), and it then shadows NVIDIA's `cuda` namespace (cuda.pathfinder,
    cuda.bindings) that CuPy imports: "No module named 'cuda.pathfinder'". Hide the root while
    CuPy (and with it the real `cuda`) is imported; later `cuda.*` imports find it in sys.modules.
    """
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    ours = os.path.abspath(str(source_dir()))
    repo_root = os.path.dirname(ours)
    shadow = sys.modules.get("cuda")
    if shadow is not None and os.path.abspath(os.path.dirname(getattr(shadow, "__file__", "") or "")) == ours:
        del sys.modules["cuda"]
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.getcwd()) != repo_root]
    try:
        import cupy
    finally:
        sys.path[:] = saved
    return cupy


@lru_cache(maxsize=None)
def _module(source: str, name_expressions: tuple, arch: str, device: int):
    """The module compiled for arch and loaded into `device`'s context: each device gets its own
    (a CUDA module and its function handles belong to the context they were loaded into)."""
    cupy = import_cupy()

    # CuPy appends -ftz=true to NVRTC's options (cupy/cuda/compiler.py; a -ftz=false here would
    # lose to it): every kernel flushes fp32 subnormals to zero. fp16 values, their products and
    # sums never are one; the Q8_1 quantizer of fp32 x can meet them (gguf_blocks.flush_subnormals
    # models it), and the attention's exp() of scores ~87 below the maximum (weights < 2^-126).
    opts = ("-std=c++17", f"--gpu-architecture={arch}", f"-I{source_dir()}")
    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=read_source(source), options=opts, name_expressions=name_expressions)
        mod.get_function(name_expressions[0])   # load it here, in this device's context
    return mod


_KERNELS: dict = {}


def get_kernel(source: str, name: str, name_expressions: tuple = (), arch_specific: bool = False):
    """The compiled kernel `name` (a name expression for templates) from cuda/<source>.

    Compiled for torch's current device (its architecture, loaded into its context: the
    public entry points make the tensors' device current, on_tensor_device) on first use there;
    later calls are the current device's index and one dict lookup (a prefill launches hundreds
    of kernels, and each microsecond of Python here is paid per launch). arch_specific asks for
    the architecture-specific target (sm_90a: wgmma) instead of the portable one.
    """
    dev = current_device()
    key = (dev, source, name)
    fn = _KERNELS.get(key)
    if fn is None:
        import torch

        major, minor = torch.cuda.get_device_capability(dev)
        arch = f"sm_{major}{minor}" + ("a" if arch_specific else "")
        mod = _module(source, tuple(name_expressions) or (name,), arch, dev)
        fn = _KERNELS[key] = mod.get_function(name)
    return fn


_GET_DEVICE = None   # torch's C binding for the current device, looked up once


def current_device() -> int:
    """torch's current CUDA device index (its C binding: the public call costs a few us; this is
    paid on every launch, so the binding is looked up once, not per call)."""
    global _GET_DEVICE
    get = _GET_DEVICE
    if get is None:
        import torch

        get = _GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    return get()


def on_tensor_device(fn):
    """Run fn(x, ...) with x's CUDA device current, as torch's own ops do whatever the current
    device is: the kernels, their streams and workspaces all follow the current device, and a
    launch on another device's stream with x's addresses is an illegal memory access (seen on
    two H100s, tests/test_multi_gpu.py). x is fn's first parameter, by position or by name.
    Where x's device is current already it costs a few hundred ns (is_cuda, get_device() and
    the current device; not torch.device.type, ~0.6 us by itself)."""
    import functools
    import inspect

    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = args[0] if args else kwargs.get(first)
        if getattr(x, "is_cuda", False):          # a CUDA tensor
            return call_on_device(x.get_device(), fn, *args, **kwargs)
        dev = getattr(x, "device", None)          # a QuantizedTensor's str, "cuda:N"
        if isinstance(dev, str) and dev.startswith("cuda:"):
            return call_on_device(int(dev[5:]), fn, *args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def call_on_device(idx: int | None, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) with CUDA device idx current (None: as it is); the switch and back
    only where idx is not current already."""
    if idx is None or idx == current_device():
        return fn(*args, **kwargs)
    import torch

    with torch.cuda.device(idx):
        return fn(*args, **kwargs)


@lru_cache(maxsize=None)
def wgmma_available(device) -> bool:
    """Hopper's wgmma kernels (sm_90a instructions) run on compute capability 9.0 only."""
    import torch

    return torch.cuda.get_device_capability(device) == (9, 0)


@lru_cache(maxsize=None)
def clusters_available(device) -> bool:
    """Thread-block clusters and distributed shared memory: compute capability 9.0 and newer."""
    import torch

    return torch.cuda.get_device_capability(device) >= (9, 0)


_SMEM_MAX: dict = {}   # kernel's function handle -> the dynamic shared memory it may take so far
_SMEM_LOCK = threading.Lock()


def set_max_dynamic_smem(kernel, nbytes: int) -> None:
    """Let `kernel` take nbytes of dynamic shared memory (above the default 48 KB). The limit only
    ever rises: one kernel launched with several sizes (the persistent decode's depends on the
    model's shapes) keeps fitting the largest, where setting each size in turn had left a later,
    larger launch over the limit (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, or an invalid value)."""
    ptr = getattr(kernel, "ptr", None)
    key = ptr if ptr is not None else id(kernel)
    if nbytes <= max(_SMEM_MAX.get(key, 0), 40 * 1024):   # static shared memory counts against 48 KB too
        return
    cupy = import_cupy()
    attr = getattr(cupy.cuda.driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
    with _SMEM_LOCK:   # two threads raising it at once must not leave the driver below the record
        if nbytes <= _SMEM_MAX.get(key, 0):
            return
        if ptr is None:
            kernel.max_dynamic_shared_size_bytes = nbytes
        else:
            cupy.cuda.driver.funcSetAttribute(ptr, attr, nbytes)
        _SMEM_MAX[key] = nbytes


_RESIDENT: dict = {}


def resident_blocks(kernel, smem: int, threads: int = 128) -> int:
    """Blocks of `kernel` one SM holds at once, by its registers and shared memory (1..8);
    worked out once per (kernel, smem, threads): CuPy asks the driver for num_regs each time."""
    key = (kernel, smem, threads)
    n = _RESIDENT.get(key)
    if n is None:
        regs = getattr(kernel, "num_regs", 0) or 168
        by_regs = 65536 // (threads * ((regs + 7) // 8 * 8))
        by_smem = (227 * 1024) // (smem + 1024)
        n = _RESIDENT[key] = max(1, min(8, by_regs, by_smem))
    return n


_SM_COUNTS: dict = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (for grid sizing), looked up once per device."""
    key = str(device)
    n = _SM_COUNTS.get(key)
    if n is None:
        import torch

        n = _SM_COUNTS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


class _StreamHandle:
    """A raw cudaStream_t (int) wearing the CUDA stream protocol that Stream.from_external wants."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


@lru_cache(maxsize=64)
def _cupy_stream(ptr: int):
    cupy = import_cupy()
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        # CuPy 14 takes an object with __cuda_stream__ (returning (version, handle)), not an int.
        try:
            return from_external(_StreamHandle(ptr))
        except (TypeError, AttributeError):
            pass
    return cupy.cuda.ExternalStream(ptr)


def current_stream_ptr() -> int:
    """torch's current CUDA stream as a raw handle. torch.cuda.current_stream() builds a Stream
    object and resolves the device through several Python layers (~5-10 us); the C binding below
    is what torch itself uses for this, with the public call as the fallback."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(current_device())
    return torch.cuda.current_stream().cuda_stream


def launch(kernel, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on torch's current stream (so graph capture and stream semantics hold); inside
    `programmatic_launches()` with programmatic dependent launch (cuda/pdl.cuh); inside a
    `recording()` as a PackedLaunch it keeps. Arguments are int pointers and numpy scalars; a
    kernel that takes a TensorMap goes through `launch_tma`."""
    if _PDL.on or _RECORDING.launches is not None:
        launch_tma(kernel, grid, block, args, shared_mem)
        return
    # cupy.cuda.Function takes the stream per call; entering it as CuPy's current stream instead
    # costs a context switch in Python on every launch.
    kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem,
           stream=_cupy_stream(current_stream_ptr()))


# ---- programmatic dependent launch ---------------------------------------------------------
# CuPy launches through cuLaunchKernel, which takes no launch attributes; PDL needs
# cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so these launches
# go to the driver through ctypes. Building the ctypes structures costs a few microseconds of
# Python per launch, which is why PDL is opt-in (`programmatic_launches()`): the runner turns it
# on while it captures its decode graph, where Python cost is paid once and replays are free.
class _ThreadFlag(threading.local):
    """A per-thread flag whose default is a class attribute: a thread that never set it reads
    False directly. getattr(threading.local(), "on", False) on such a thread raises and catches
    an AttributeError inside, ~0.7 us a read on the 2-core CPU box against ~0.1, and the launch
    path reads these flags on every launch (a plan's replay too)."""
    on = False


_PDL = _ThreadFlag()   # .on: inside programmatic_launches() on this thread
MAX_GRID_YZ = 65535   # CUDA's limit on gridDim.y and gridDim.z
MAX_GRID_X = 2**31 - 1   # and on gridDim.x
_ATTR_COOPERATIVE = 2                         # CUlaunchAttributeID (cuda.h, CUDA >= 12.0)
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class programmatic_launches:
    """Context manager: kernels launched inside it use programmatic dependent launch, so each
    may start while the previous kernel on the stream finishes (every kernel of cuda/ waits
    for its predecessor with griddepcontrol.wait before touching memory it could share).
    Nested uses keep the outer setting on exit. The setting is the calling thread's: two
    threads' blocks that overlap (two models capturing their decode graphs) leave each other's
    launches as they were."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)

    def __enter__(self):
        self._saved, _PDL.on = pdl_enabled(), self.enabled
        return self

    def __exit__(self, *exc):
        _PDL.on = self._saved
        return False


def pdl_enabled() -> bool:
    """Whether this thread's launches use programmatic dependent launch (programmatic_launches)."""
    return _PDL.on


@lru_cache(maxsize=1)
def _driver():
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")

    class Attribute(ctypes.Structure):     # CUlaunchAttribute: id, 4 bytes pad, a 64-byte union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

    class Config(ctypes.Structure):        # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attribute)),
                    ("num_attrs", ctypes.c_uint)]

    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return ctypes, lib, Attribute, Config, fn


_CTYPE_OF: dict = {}   # numpy scalar type -> its ctypes type (looked up once per type)


def launch_tma(kernel, grid, block, args, shared_mem: int = 0) -> None:
    """`launch` for a kernel with a TensorMap argument (a TMA descriptor passed by value), which
    CuPy cannot pass: always through cuLaunchKernelEx (a PackedLaunch), with PDL inside
    programmatic_launches(); kept by a `recording()`."""
    pl = PackedLaunch(kernel, grid, block, args, shared_mem)
    rec = _RECORDING.launches
    if rec is not None:
        rec.append(pl)
    pl()


def _driver_error(ctypes, lib, err: int) -> str:
    """'NAME (code)' of a CUresult."""
    name = ctypes.c_char_p()
    lib.cuGetErrorName(err, ctypes.byref(name))
    return f"{(name.value or b'?').decode()} ({err})"


def _ctype_arg(ctypes, a):
    """A kernel argument as a ctypes value: int -> 8-byte pointer (as CuPy passes them), numpy
    scalar -> its own ctypes type, TensorMap -> its 128 bytes. A launch converts ~12 of these,
    so the common types take one dict lookup (numpy.ctypeslib per scalar cost ~5 us each)."""
    t = type(a)
    if t is int:
        return ctypes.c_uint64(a & 0xFFFFFFFFFFFFFFFF)
    c = _CTYPE_OF.get(t)
    if c is not None:
        return c(a.item())
    if t is TensorMap:
        return a.raw
    import numpy as np

    if isinstance(a, (bool, np.bool_)):
        raise TypeError(f"kernel argument {a!r}: pass an np.int32 flag, not a bool")
    if isinstance(a, int):            # an int subclass: a pointer all the same
        return ctypes.c_uint64(int(a) & 0xFFFFFFFFFFFFFFFF)
    if isinstance(a, np.generic):
        c = _CTYPE_OF[t] = np.ctypeslib.as_ctypes_type(np.dtype(t))
        return c(a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__}: expected an int pointer or a numpy scalar")


# ---- TMA descriptors -------------------------------------------------------------------------
class TensorMap:
    """A CUtensorMap (the driver's 128-byte TMA descriptor) for a kernel parameter declared
    `const __grid_constant__ wg::TmaDesc` (cuda/wgmma_sm90.cuh); `launch_tma` passes it by value.
    key is tensor_map_2d's arguments (ptr, rows, cols, box_rows, box_cols, swizzle, dtype)."""
    __slots__ = ("raw", "key")

    def __init__(self, raw, key=()):
        self.raw, self.key = raw, key


_TMAPS: dict = {}
_TMAP_TYPES = {"f16": (6, 2), "u32": (2, 4), "u8": (0, 1)}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / UINT32 / UINT8, bytes
_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}   # CU_TENSOR_MAP_SWIZZLE_NONE / 32B / 64B / 128B
_L2_256B = 3        # CU_TENSOR_MAP_L2_PROMOTION_L2_256B


def tensor_map_2d(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, swizzle: int = 128,
                  dtype: str = "f16") -> TensorMap:
    """The TMA descriptor of a row-major matrix [rows, cols] of fp16 ("f16"), 32-bit words
    ("u32") or bytes ("u8") at device address ptr (16-byte aligned, rows 16-byte multiples), copied in boxes of
    box_rows x box_cols with the given shared-memory swizzle (0 = none); elements past the matrix
    read as zeros. Encoded once per distinct argument tuple (a prefill reuses a few activation
    buffers) and remembered."""
    key = (ptr, rows, cols, box_rows, box_cols, swizzle, dtype)
    tm = _TMAPS.get(key)
    if tm is None:
        tm = _TMAPS[key] = TensorMap(_encode(ptr, (cols, rows), (cols,), (box_cols, box_rows), swizzle, dtype), key)
    return tm


def tensor_map_halves(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, swizzle: int = 0,
                      dtype: str = "f16") -> TensorMap:
    """The TMA descriptor of a row-major matrix [rows, cols] whose columns are two halves [A | B]
    (cols even, a half's row a 16-byte multiple), seen as 3-D (column in the half, half, row):
    its boxes of box_rows x (box_cols / 2 columns of A, then the same columns of B) land in shared
    memory as box_rows rows of box_cols elements, each row's A part before its B part, and
    columns past a half's end read as zeros (not as the other half's). The AWQ kernel's GLU
    epilogue (matmul(glu=True)) reads a fused [gate | up] weight's scales and zeros this way."""
    key = ("halves", ptr, rows, cols, box_rows, box_cols, swizzle, dtype)
    tm = _TMAPS.get(key)
    if tm is None:   # key () on the map: launch plans never re-aim it (it is a weight's, not x's)
        half = cols // 2
        tm = _TMAPS[key] = TensorMap(_encode(ptr, (half, 2, rows), (half, cols), (box_cols // 2, 2, box_rows),
                                             swizzle, dtype))
    return tm


def _map_rule_broken(ptr: int, dims: tuple, strides: tuple, box: tuple, swizzle: int, size: int) -> str | None:
    """Which of cuTensorMapEncodeTiled's documented rules (cuda.h, CUDA 13; no interleave)
    a tiled map breaks, None if none: strides in bytes, dims and box innermost first."""
    if not 1 <= len(dims) <= 5:
        return f"rank {len(dims)} (1..5)"
    if ptr % 16:
        return "the address is not 16-byte aligned"
    if not all(1 <= d <= 2**32 for d in dims):
        return "a dimension is outside 1..2^32"
    if not all(s % 16 == 0 and 0 < s < 2**40 for s in strides):
        return "a stride is not a positive multiple of 16 bytes below 2^40"
    if not all(1 <= b <= 256 for b in box):
        return "a box dimension is outside 1..256"
    if box[0] * size % 16:
        return f"a box row of {box[0] * size} bytes is not a multiple of 16"
    if swizzle and box[0] * size > swizzle:
        return f"a box row of {box[0] * size} bytes is wider than the {swizzle}-byte swizzle"
    return None


def _encode(ptr: int, dims: tuple, strides: tuple, box: tuple, swizzle: int, dtype: str):
    """cuTensorMapEncodeTiled: dims and box innermost first, strides (in elements) of dims 1..;
    elements past the tensor read as zeros. Its rules are checked first, so that a map the
    driver would refuse (CUDA_ERROR_INVALID_VALUE) is a ValueError saying which rule."""
    code, size = _TMAP_TYPES[dtype]
    shape = f"{' x '.join(map(str, dims[::-1]))} {dtype} at {ptr:#x}, box {' x '.join(map(str, box[::-1]))}"
    why = _map_rule_broken(ptr, dims, tuple(size * s for s in strides), box, swizzle, size)
    if why:
        raise ValueError(f"tensor map ({shape}): {why}")
    ctypes, lib, *_ = _driver()
    # the driver asks for a 64-byte aligned CUtensorMap; a (c_uint64 * 16)() of its own sits at
    # 48 mod 64 (CPython's small-object allocator), so the map is placed in a larger buffer
    buf = (ctypes.c_uint8 * (128 + 64))()
    raw = (ctypes.c_uint64 * 16).from_buffer(buf, -ctypes.addressof(buf) % 64)   # (keeps buf alive)
    r = len(dims)
    err = lib.cuTensorMapEncodeTiled(
        ctypes.byref(raw), ctypes.c_int(code), ctypes.c_uint32(r), ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * r)(*dims), (ctypes.c_uint64 * (r - 1))(*(size * s for s in strides)),
        (ctypes.c_uint32 * r)(*box), (ctypes.c_uint32 * r)(*([1] * r)),
        ctypes.c_int(0), ctypes.c_int(_SWIZZLE[swizzle]), ctypes.c_int(_L2_256B), ctypes.c_int(0))
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled ({shape}) failed: {_driver_error(ctypes, lib, err)}")
    if len(_TMAPS) >= 1024:
        _TMAPS.clear()
    return raw


# ---- launch plans ----------------------------------------------------------------------------
# A quantized matmul costs 50-100 us of Python per call (checks, path choice, tile schedule,
# workspace lookups, argument packing) against 5-30 us of GPU time at small M and ~20 us of host
# time for F.linear, so a prefill of a few hundred such calls is bound by the host. A Plan keeps
# the launches one call queued, packed for the driver, and replays them with only the input's and
# the output's addresses changed. Workspace pointers (and views, in torch steps) are baked in, so
# every (re)allocation or release of a workspace empties every PlanCache (workspaces_changed):
# no plan can point into a freed buffer or keep one alive.
class _ThreadRecording(threading.local):
    launches = None   # (a class default, as _ThreadFlag's)


_RECORDING = _ThreadRecording()   # .launches: the list a recording() on this thread fills
_PLAN_CACHES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()   # id -> PlanCache
_WORKSPACE_GENERATION = 0   # how many times workspaces_changed has dropped the plans


class PlanCache(dict):
    """One weight's plans by key (kernels.run_planned), at most LIMIT of them, the oldest dropped
    first (a server sees many prompt lengths); emptied by workspaces_changed."""
    LIMIT = 32

    def __init__(self):
        super().__init__()
        _PLAN_CACHES[id(self)] = self

    def __reduce__(self):
        # copy.deepcopy / pickle of a weight (or of a module holding it) carries its memo: the
        # copy gets a fresh cache, registered (so workspaces_changed empties it), and no plans
        # (they hold ctypes pointers, and raw addresses of this weight and these workspaces)
        return (PlanCache, ())

    def put(self, key, plan) -> None:
        while len(self) >= self.LIMIT:
            del self[next(iter(self))]
        self[key] = plan


def workspaces_changed() -> None:
    """Call when a workspace a kernel argument may point into is allocated, grown or released:
    every recorded plan is dropped (the next call of each records anew)."""
    global _WORKSPACE_GENERATION
    _WORKSPACE_GENERATION += 1
    for cache in list(_PLAN_CACHES.values()):
        cache.clear()


_FRESH = _ThreadFlag()   # .on: inside fresh_workspaces() on this thread


@contextlib.contextmanager
def fresh_workspaces():
    """Inside (per thread): the kernels' workspaces are allocated per call and not cached, and no
    launch plan (which points into cached ones) is recorded or replayed -- as during a CUDA graph
    capture. For torch.compile's CUDA graphs (quantzoo.torch_ops): its warm-up runs allocate from
    the graph's private pool, and a buffer cached there would be a live allocation the graph does
    not know of (torch refuses it: "tensor(s) in the cudagraph pool not tracked as outputs")."""
    was = _FRESH.on
    _FRESH.on = True
    try:
        yield
    finally:
        _FRESH.on = was


def fresh_workspaces_on() -> bool:
    """Whether this thread is inside fresh_workspaces()."""
    return _FRESH.on


@lru_cache(maxsize=1)
def _capture_info():
    """cuStreamGetCaptureInfo_v2, its ctypes signature set once: (stream, status*, id*, graph*,
    deps**, n deps*), the last three optional."""
    ctypes, lib = _driver()[:2]
    fn = lib.cuStreamGetCaptureInfo_v2
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def capture_id(stream: int) -> int | None:
    """The id of the CUDA graph capture under way on stream (a raw handle), None when there is
    none (cuStreamGetCaptureInfo; ids are unique within the process)."""
    ctypes, lib = _driver()[:2]
    status, cid = ctypes.c_int(), ctypes.c_uint64()
    err = _capture_info()(stream, ctypes.byref(status), ctypes.byref(cid), None, None, None)
    if err:
        raise RuntimeError(f"cuStreamGetCaptureInfo: {_driver_error(ctypes, lib, err)}")
    return cid.value if status.value == 1 else None   # CU_STREAM_CAPTURE_STATUS_ACTIVE


def uncached_workspaces() -> bool:
    """Whether a kernel's workspace must be its own, freed with the call: during a CUDA graph
    capture (the graph's pool holds it for the replays) and inside fresh_workspaces()."""
    import torch

    if _FRESH.on:
        return True
    try:
        return torch._C._cuda_isCurrentStreamCapturing()
    except RuntimeError:   # a CPU-only torch build (its CUDA bindings are stubs that raise)
        return False


def workspace_generation() -> int:
    """A count that moves whenever workspaces_changed drops the plans: equal before and after a
    call means every plan the call recorded is still there."""
    return _WORKSPACE_GENERATION


class PackedLaunch:
    """One kernel launch with its configuration and arguments packed once into the driver's
    structures (cuLaunchKernelEx through ctypes: for the programmatic-serialization attribute
    and for arguments CuPy cannot pass); calling it launches on torch's current stream, with
    PDL inside programmatic_launches(). set_pointer / set_map change one argument in place.
    cooperative: a cooperative launch instead (never PDL), which the driver refuses
    (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) unless every block of the grid can be resident
    at once -- what a kernel with grid-wide barriers needs so as not to wait forever."""
    __slots__ = ("args", "cfg", "cfg_ref", "attr", "func", "vals", "params", "cooperative")

    def __init__(self, kernel, grid, block, args, shared_mem: int = 0, cooperative: bool = False):
        ctypes, lib, Attribute, Config, fn = _driver()
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        self.args = tuple(args)
        self.cooperative = bool(cooperative)
        self.attr = Attribute(id=_ATTR_COOPERATIVE if cooperative else _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1
        self.cfg = Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), int(shared_mem),
                          None, ctypes.pointer(self.attr), 0)
        self.cfg_ref = ctypes.pointer(self.cfg)
        self.func = ctypes.c_void_p(getattr(kernel, "ptr", None) or kernel.kernel.ptr)
        self.vals = [_ctype_arg(ctypes, a) for a in self.args]
        self.params = (ctypes.c_void_p * max(1, len(self.vals)))(*[ctypes.addressof(v) for v in self.vals])

    def set_pointer(self, i: int, ptr: int) -> None:
        self.vals[i].value = ptr

    def set_map(self, i: int, tm: "TensorMap") -> None:
        self.vals[i] = tm.raw                     # keeps the descriptor alive with the launch
        self.params[i] = _driver()[0].addressof(tm.raw)

    def __call__(self) -> None:
        cfg = self.cfg
        cfg.stream = current_stream_ptr()
        pdl = _PDL.on
        cfg.num_attrs = 1 if pdl or self.cooperative else 0
        err = _driver()[4](self.cfg_ref, self.func, self.params, None)
        if err:
            ctypes, lib, *_ = _driver()
            how = " (cooperative)" if self.cooperative else " (programmatic dependent launch)" if pdl else ""
            raise RuntimeError(f"cuLaunchKernelEx{how} failed: {_driver_error(ctypes, lib, err)}")


class TorchStep:
    """Torch work between a call's launches (a cuBLAS product), kept by a recording as fn(x, y):
    a plan's replay calls it with that call's x and y -- or, where the recorded y was not the
    call's output but a workspace (a product that a later launch reads, as the GLU matmul's
    fallback does), with that workspace again."""
    __slots__ = ("fn", "y")

    def __init__(self, fn, y):
        self.fn, self.y = fn, y


def torch_step(fn, x, y) -> None:
    """Run fn(x, y) now, and while recording keep it in the plan. fn must reach the call's input
    and output only through its x and y arguments (views of them are fine); y is the call's
    output or a workspace (kept as it is by the plan)."""
    rec = _RECORDING.launches
    if rec is not None:
        rec.append(TorchStep(fn, y))
    fn(x, y)


class recording:
    """Context manager: this thread's launches inside it go through PackedLaunch and are kept in
    `.launches` (they still run). Not re-entrant."""

    def __enter__(self):
        if _RECORDING.launches is not None:
            raise RuntimeError("recording: already recording launches")
        self.launches = _RECORDING.launches = []
        return self

    def __exit__(self, *exc):
        _RECORDING.launches = None
        return False


class Plan:
    """Recorded launches (and TorchSteps) of one call on input x and output y, replayable on other
    tensors of the same shapes: every pointer argument inside x's bytes (inside y's) is re-aimed
    at the same offset of the new x (y), and a TensorMap over x is re-encoded for the new address
    (cached by tensor_map_2d); TorchSteps get the new x and y. Everything else -- weights,
    workspaces, sizes, grid -- stays as recorded."""
    __slots__ = ("steps",)

    def __init__(self, launches, x_ptr: int, x_bytes: int, y_ptr: int, y_bytes: int):
        self.steps = []
        for pl in launches:
            if type(pl) is TorchStep:   # its y: the call's output (None: the replay's y) or a workspace
                inside = y_ptr <= pl.y.data_ptr() < y_ptr + y_bytes
                self.steps.append((pl.fn, None, None if inside else pl.y))
                continue
            ptrs, maps = [], []
            for i, a in enumerate(pl.args):
                if type(a) is int:
                    if x_ptr <= a < x_ptr + x_bytes:
                        ptrs.append((i, 0, a - x_ptr))
                    elif y_ptr <= a < y_ptr + y_bytes:
                        ptrs.append((i, 1, a - y_ptr))
                elif type(a) is TensorMap and a.key and x_ptr <= a.key[0] < x_ptr + x_bytes:
                    maps.append((i, a.key[0] - x_ptr, a.key[1:]))
            self.steps.append((pl, tuple(ptrs), tuple(maps)))

    def replay(self, x, y) -> None:
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        for pl, ptrs, maps in self.steps:
            if ptrs is None:   # a TorchStep: pl its fn, maps its workspace output or None
                pl(x, y if maps is None else maps)
                continue
            for i, which, off in ptrs:
                pl.set_pointer(i, (y_ptr if which else x_ptr) + off)
            for i, off, rest in maps:
                pl.set_map(i, tensor_map_2d(x_ptr + off, *rest))
            pl()
