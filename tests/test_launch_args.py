"""CPU: how cuda_launch turns kernel arguments into the bytes cuLaunchKernelEx copies (the PDL
launches and every launch that passes a TMA descriptor go this way)."""
import ctypes

import numpy as np
import pytest

from quantzoo.cuda_launch import TensorMap, _ctype_arg


@pytest.mark.parametrize("value,raw", [
    (np.int32(-5), (-5).to_bytes(4, "little", signed=True)),
    (np.int64(1 << 40), (1 << 40).to_bytes(8, "little")),
    (np.uint32(7), (7).to_bytes(4, "little")),
    (np.float32(1.5), np.float32(1.5).tobytes()),
    (0x7F00_1234_5678, (0x7F00_1234_5678).to_bytes(8, "little")),   # a device pointer: 8 bytes
])
def test_scalars_and_pointers(value, raw):
    for _ in range(2):   # the second call takes the per-type cache
        assert bytes(_ctype_arg(ctypes, value)) == raw


def test_tensor_map_passes_its_128_bytes():
    raw = (ctypes.c_uint64 * 16)(*range(16))
    assert _ctype_arg(ctypes, TensorMap(raw)) is raw


@pytest.mark.parametrize("bad", [True, np.bool_(False), 1.5, "x", None])
def test_bad_arguments_raise(bad):
    with pytest.raises(TypeError, match="kernel argument"):
        _ctype_arg(ctypes, bad)


def test_tensor_maps_keep_the_encoders_rules(monkeypatch):
    """cuTensorMapEncodeTiled's rules (cuda.h): a map that breaks one is a ValueError naming the
    rule before the driver is asked (which says only CUDA_ERROR_INVALID_VALUE), and the
    descriptor it writes lies at a 64-byte aligned address, as the driver asks (a
    (c_uint64 * 16)() of its own lay at 48 mod 64: CPython's small-object allocator)."""
    import re

    from quantzoo import cuda_launch as cl

    seen = []

    class Lib:
        def cuTensorMapEncodeTiled(self, ref, code, rank, ptr, dims, strides, box, elem, il, swizzle, l2, oob):
            seen.append((ctypes.addressof(ref._obj), rank.value, list(dims), list(strides), list(box), swizzle.value))
            return 0

    monkeypatch.setattr(cl, "_driver", lambda: (ctypes, Lib()))
    monkeypatch.setattr(cl, "_TMAPS", {})
    x = cl.tensor_map_2d(0x10000, 4096, 4096, 128, 64)            # the wgmma kernels' x: 128-byte swizzle
    scales = cl.tensor_map_halves(0x20000, 32, 8192, 2, 128)      # AWQ GLU scales: [gate | up] halves
    assert [s[0] % 64 for s in seen] == [0, 0]
    assert [ctypes.addressof(x.raw), ctypes.addressof(scales.raw)] == [s[0] for s in seen]
    assert seen[0][1:] == (2, [4096, 4096], [8192], [64, 128], 3)
    assert seen[1][1:] == (3, [4096, 2, 32], [8192, 16384], [64, 2, 2], 0)
    seen.clear()
    for args, why in [((0x10008, 64, 64, 8, 64), "the address is not 16-byte aligned"),
                      ((0x10000, 0, 64, 8, 64), "a dimension is outside 1..2^32"),
                      ((0x10000, 2**32 + 1, 64, 8, 64), "a dimension is outside 1..2^32"),
                      ((0x10000, 64, 60, 8, 64), "a stride is not a positive multiple of 16 bytes below 2^40"),
                      ((0x10000, 64, 64, 257, 64), "a box dimension is outside 1..256"),
                      ((0x10000, 64, 64, 8, 4, 0), "a box row of 8 bytes is not a multiple of 16"),
                      ((0x10000, 64, 256, 8, 128), "a box row of 256 bytes is wider than the 128-byte swizzle")]:
        with pytest.raises(ValueError, match=rf"^tensor map \(.* at 0x100[08]+, box .*\): {re.escape(why)}$"):
            cl.tensor_map_2d(*args)
    assert not seen


class _FakeLaunch:
    """What cuda_launch.Plan uses of a PackedLaunch: args, set_pointer, set_map, a call."""

    def __init__(self, args, log):
        self.args, self.now, self.log = args, list(args), log

    def set_pointer(self, i, ptr):
        self.now[i] = ptr

    def set_map(self, i, tm):
        self.now[i] = tm

    def __call__(self):
        self.log.append(list(self.now))


def test_plan_reaims_pointers_into_x_and_y_only(monkeypatch):
    """Pointers inside x's bytes (and y's) move with the new x (y) at the same offset; a
    TensorMap over x is rebuilt for the new address; a torch step gets the new x and y, or x
    and its own workspace output; weights, workspaces and sizes stay."""
    from quantzoo import cuda_launch as cl

    monkeypatch.setattr(cl, "tensor_map_2d", lambda ptr, *rest: ("map", ptr) + rest)
    x, y, w, ws = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000
    log = []
    xmap = TensorMap(None, (x, 512, 4096, 128, 64, 128, "f16"))
    wmap = TensorMap(None, (w, 512, 1024, 64, 32, 128, "u32"))
    class Ptr:
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p

    step = lambda a, b: log.append(("torch", a, b))  # noqa: E731
    launches = [_FakeLaunch((x, w, ws, y + 4096, np.int32(7)), log),
                cl.TorchStep(step, Ptr(y + 64)), cl.TorchStep(step, Ptr(ws)),
                _FakeLaunch((xmap, wmap, y, ws + 64, x + 100, y - 1), log)]
    plan = cl.Plan(launches, x, 512 * 4096 * 2, y, 512 * 6144 * 2)
    x2, y2 = Ptr(0x5000_0000), Ptr(0x6000_0000)
    plan.replay(x2, y2)
    assert log[0] == [x2.p, w, ws, y2.p + 4096, np.int32(7)]
    assert log[1] == ("torch", x2, y2)
    assert log[2] == ("torch", x2, launches[2].y)
    assert log[3] == [("map", x2.p, 512, 4096, 128, 64, 128, "f16"), wmap, y2.p, ws + 64, x2.p + 100, y - 1]


def test_plan_cache_is_bounded_and_dropped_when_workspaces_change():
    from quantzoo import cuda_launch as cl

    a, b = cl.PlanCache(), cl.PlanCache()
    for m in range(cl.PlanCache.LIMIT + 5):
        a.put(m, f"plan {m}")
    assert len(a) == cl.PlanCache.LIMIT and 0 not in a and cl.PlanCache.LIMIT + 4 in a   # oldest out
    b.put("k", "plan")
    cl.workspaces_changed()
    assert not a and not b
    ia = id(a)
    del a                                        # a dropped cache leaves the registry with it
    assert ia not in cl._PLAN_CACHES and cl._PLAN_CACHES[id(b)] is b


def test_a_copied_weight_gets_a_fresh_registered_plan_cache():
    """deepcopy / pickle of a weight (or of a module holding it) carries its memo. Plans hold
    ctypes pointers (the copy failed) and this weight's addresses; a copy made of an empty cache
    was not registered, so workspaces_changed never emptied it and its later plans could outlive
    the workspaces they point into."""
    import copy
    import pickle

    from quantzoo import cuda_launch as cl

    a = cl.PlanCache()
    a.put((1, 0), ctypes.c_void_p(5))            # not picklable, as a real plan's launches are not
    for b in (copy.deepcopy(a), pickle.loads(pickle.dumps(a)), copy.deepcopy(cl.PlanCache())):
        assert type(b) is cl.PlanCache and not b and cl._PLAN_CACHES[id(b)] is b
        b.put("k", "plan")
        cl.workspaces_changed()
        assert not b


def test_misaligned_x_or_y_runs_unplanned(monkeypatch):
    """A plan replays launch choices made for the addresses it recorded (gguf's split-K reduce
    writes 8 bytes at a time when y is 8-byte aligned): an x or y at an odd offset runs its own
    launches and leaves no plan."""
    import torch

    from quantzoo.formats import get
    from quantzoo.kernels import checked_once, run_planned

    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    qt = get("q8_0").quantize(np.zeros((8, 64), np.float32))
    checked_once(qt, lambda q: None)
    plans = qt.__dict__["_kernels_checked"][3]
    x = torch.zeros(4, 64, dtype=torch.float16)
    big = torch.zeros(64, dtype=torch.float16)
    calls = []
    for y in (big[1:33].view(4, 8), big[4:36].view(4, 8)):   # 2 and 8 bytes past a 16-byte boundary
        run_planned(qt, 4, x, y, lambda: calls.append(1))
    assert len(calls) == 2 and not plans


def test_compiled_text_changes_with_any_header(tmp_path, monkeypatch):
    """CuPy caches a compiled module on disk by its source text and options, not by the headers
    it #includes: read_source's text names a hash of cuda/*.cuh, so an edited header (or an
    upgrade) recompiles instead of reusing the old binary -- which it did (session 34: an A/B of
    q8_1.cuh on the lent GPU ran the first variant twice)."""
    from quantzoo import cuda_launch as cl

    (tmp_path / "k.cu").write_text('#include "a.cuh"\n__global__ void k() {}\n')
    (tmp_path / "a.cuh").write_text("#define A 1\n")
    monkeypatch.setattr(cl, "source_dir", lambda: tmp_path)
    try:
        cl._headers_hash.cache_clear()
        first = cl.read_source("k.cu")
        assert first.startswith((tmp_path / "k.cu").read_text())
        (tmp_path / "a.cuh").write_text("#define A 2\n")
        cl._headers_hash.cache_clear()
        assert cl.read_source("k.cu") != first
        (tmp_path / "a.cuh").write_text("#define A 1\n")
        cl._headers_hash.cache_clear()
        assert cl.read_source("k.cu") == first
        (tmp_path / "a.cuh").rename(tmp_path / "b.cuh")   # the names count too: another #include graph
        cl._headers_hash.cache_clear()
        assert cl.read_source("k.cu") != first
    finally:
        cl._headers_hash.cache_clear()   # the real cuda/ next


class _FakeCuda:
    """What on_tensor_device reads of a CUDA tensor on device `index` (CPU-only torch has none)."""
    is_cuda = True

    def __init__(self, index):
        self.index = index

    def get_device(self):
        return self.index

    @property
    def device(self):
        import torch

        return torch.device("cuda", self.index)


@pytest.fixture
def fake_devices(monkeypatch):
    """torch.cuda.device and cuda_launch.current_device over a list holding the current index."""
    import torch

    from quantzoo import cuda_launch as cl

    current = [0]

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            self.prev, current[0] = current[0], self.i

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(cl, "current_device", lambda: current[0])
    return current


def test_on_tensor_device_takes_x_by_name_too(fake_devices):
    """The first parameter may come by keyword, as the undecorated function took it (the wrapper
    was `wrapper(x, *args, **kwargs)`: read(src=t) was a TypeError, 'missing x')."""
    import torch

    from quantzoo.cuda_launch import on_tensor_device
    from quantzoo.kernels import layer_ops, stream

    seen = []
    f = on_tensor_device(lambda src, out=None: seen.append(fake_devices[0]))
    f(_FakeCuda(1))
    f(src=_FakeCuda(1), out=None)
    f(out=None, src=_FakeCuda(0))
    assert seen == [1, 1, 0] and fake_devices[0] == 0
    with pytest.raises(ValueError, match="src must be a contiguous CUDA tensor"):
        stream.read(src=torch.zeros(4))
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        layer_ops.add_rms_norm(h=torch.zeros(1, 8), delta=None, w=torch.zeros(8), eps=1e-6)


def test_every_public_launching_entry_point_runs_on_its_tensors_device(fake_devices, monkeypatch):
    """fp16.linear (the runner's fp16 linears, the GEMV at M <= 4) and awq.dequantize_into launch
    kernels too: with cuda:0 current, an x on cuda:1 launched on cuda:0's context and stream."""
    from quantzoo.kernels import awq, fp16

    seen = []
    monkeypatch.setattr(fp16, "gemv_ok", lambda x, w: True)
    monkeypatch.setattr(fp16, "_launch_gemv", lambda x, w: seen.append(("gemv", fake_devices[0])))
    fp16.linear(_FakeCuda(1), None)
    monkeypatch.setattr(awq, "_kernel", lambda *a: None)
    monkeypatch.setattr(awq, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(awq, "_launch", lambda *a, **k: seen.append(("dequant", fake_devices[0])))

    class W(_FakeCuda):
        def data_ptr(self):
            return 0

    awq.dequantize_into(W(1), W(1), W(1), W(1), 64, 64, 32)
    assert seen == [("gemv", 1), ("dequant", 1)] and fake_devices[0] == 0


def test_on_tensor_device_follows_a_quantized_tensors_device(fake_devices, monkeypatch):
    """A QuantizedTensor first argument (awq.dequantize(qt)) has no is_cuda: its device string
    "cuda:N" picks the device; a CPU one runs where it is."""
    from quantzoo.cuda_launch import on_tensor_device
    from quantzoo.formats.tensor import QuantizedTensor
    from quantzoo.kernels import awq

    def qt(i):
        return QuantizedTensor("awq", (64, 64), {"qweight": _FakeCuda(i), "qzeros": _FakeCuda(i),
                                                 "scales": _FakeCuda(i)}, {"group_size": 32})

    assert qt(1).device == "cuda:1"
    seen = []
    f = on_tensor_device(lambda q: seen.append(fake_devices[0]))
    f(qt(1))
    fake_devices[0] = 1
    f(qt(0))
    f(QuantizedTensor("q8_0", (1, 32), np.zeros((1, 34), np.uint8), {}))   # CPU: left as it is
    fake_devices[0] = 0
    assert seen == [1, 0, 1]

    class Seen(Exception):
        pass

    def unpack(q):
        seen.append(("unpack", fake_devices[0]))
        raise Seen

    monkeypatch.setattr(awq, "_unpack_qt", unpack)
    with pytest.raises(Seen):
        awq.dequantize(qt(1))
    assert seen[-1] == ("unpack", 1) and fake_devices[0] == 0


def test_get_kernel_compiles_and_caches_per_device(fake_devices, monkeypatch):
    """A module and its function handles belong to the context they were loaded into: each
    device gets its own, built for its own architecture, and a cached handle is not handed to
    another device."""
    import torch

    from quantzoo import cuda_launch as cl

    built = []

    class Mod:
        def __init__(self, arch, dev):
            self.arch, self.dev = arch, dev

        def get_function(self, name):
            return (name, self.arch, self.dev)

    def module(source, name_expressions, arch, device):
        built.append((arch, device))
        return Mod(arch, device)

    monkeypatch.setattr(cl, "_KERNELS", {})
    monkeypatch.setattr(cl, "_module", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: {0: (9, 0), 1: (8, 0)}[dev])
    assert cl.get_kernel("k.cu", "k") == ("k", "sm_90", 0)
    fake_devices[0] = 1
    assert cl.get_kernel("k.cu", "k") == ("k", "sm_80", 1)
    fake_devices[0] = 0
    assert cl.get_kernel("k.cu", "k") == ("k", "sm_90", 0)
    assert built == [("sm_90", 0), ("sm_80", 1)]


@pytest.mark.parametrize("other", ["unplanned call", "forced path", "release", "awq forced path"])
def test_no_other_thread_between_a_calls_launches(monkeypatch, other):
    """The workspaces are cached per (kind, device, stream), and host threads share a stream (each
    one's default stream is the device's): another thread's unplanned call (x or y off a 16-byte
    boundary, a forced path, plans off) or release_workspaces ran between one call's launches --
    its quantize between the first call's quantize and GEMV, which then read the other call's Q8_1
    activations, or the workspace freed under a plan being recorded, which kept pointing into it."""
    import threading
    import types

    import torch

    from quantzoo import cuda_launch as cl
    from quantzoo.formats import get
    from quantzoo.kernels import awq, checked_once, gguf, run_planned, workspaces

    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(cl, "current_stream_ptr", lambda: 0)
    log, inside, done = [], threading.Event(), threading.Event()

    def other_call():   # what the second thread does, logged; done once it is over
        log.append(f"{other}: start")
        log.append(f"{other}: end")
        done.set()

    x = torch.zeros(4, 64, dtype=torch.float16)
    if other == "unplanned call":
        qb = get("q8_0").quantize(np.zeros((8, 64), np.float32))
        checked_once(qb, lambda q: None)
        yb = torch.zeros(64, dtype=torch.float16)[1:33].view(4, 8)   # 2 bytes past a 16-byte boundary
        call = lambda: run_planned(qb, 4, x, yb, other_call)  # noqa: E731
    elif other == "forced path":
        qb = types.SimpleNamespace(format="q4_0", shape=(8, 64), data=torch.zeros(8, 36, dtype=torch.uint8))
        monkeypatch.setattr(gguf, "checked_once", lambda qt, check: ("q4_0", 8, 64))
        monkeypatch.setattr(gguf, "_check_act", lambda x, k, arg: (4, 64))
        monkeypatch.setattr(gguf, "_queue", lambda *a: other_call())
        call = lambda: gguf.matmul(x, qb, path="mmvq")  # noqa: E731
    elif other == "awq forced path":
        monkeypatch.setattr(awq, "_check_x", lambda x, k, device: None)
        monkeypatch.setattr(awq, "_queue", lambda *a: other_call())
        qw = types.SimpleNamespace(device=x.device)
        call = lambda: awq._gemm(x, qw, None, None, 64, 8, 32, None, "small")  # noqa: E731
    else:
        monkeypatch.setattr(workspaces, "_CACHE", {})
        monkeypatch.setattr(cl, "workspaces_changed", other_call)
        call = workspaces.release

    def first():   # a planned call's launches, with time for the other thread to get between them
        log.append("quantize")
        inside.set()
        done.wait(0.3)
        log.append("gemv")

    t = threading.Thread(target=lambda: (inside.wait(5), call()), daemon=True)
    t.start()
    qa = get("q8_0").quantize(np.zeros((8, 64), np.float32))
    checked_once(qa, lambda q: None)
    run_planned(qa, 4, x, torch.zeros(4, 8, dtype=torch.float16), first)
    t.join(5)
    assert log == ["quantize", "gemv", f"{other}: start", f"{other}: end"]


def test_programmatic_launches_is_per_thread():
    """Two threads' programmatic_launches() blocks that overlap (two models capturing decode
    graphs) each see their own setting, and neither leaves it on: a process-wide flag ended
    True after both blocks had exited (every later launch then went through the slower ctypes
    path with PDL)."""
    import threading

    from quantzoo import cuda_launch as cl

    entered, exited, seen = threading.Event(), threading.Event(), {}

    def other():
        with cl.programmatic_launches():
            entered.set()
            exited.wait(5)
            seen["other inside"] = cl.pdl_enabled()
        seen["other after"] = cl.pdl_enabled()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    entered.wait(5)
    seen["main while other is inside"] = cl.pdl_enabled()
    with cl.programmatic_launches():
        exited.set()
        t.join(5)
        seen["main inside"] = cl.pdl_enabled()
    seen["main after"] = cl.pdl_enabled()
    assert seen == {"main while other is inside": False, "other inside": True, "other after": False,
                    "main inside": True, "main after": False}


def test_raising_a_kernels_shared_memory_limit_from_two_threads(monkeypatch):
    """Two threads raising one kernel's dynamic shared memory limit at once: the record of the
    limit must never exceed the driver's setting (a later launch that trusts the record would
    fail). Here the larger setting returns late, so without the lock the smaller one was set
    after it and the record kept the larger one."""
    import threading
    import time
    import types

    from quantzoo import cuda_launch as cl

    class Kernel:   # ptr None: the limit is this attribute, as on a CuPy RawKernel
        set_to = 0

        @property
        def max_dynamic_shared_size_bytes(self):
            return self.set_to

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, nbytes):
            self.set_to = nbytes
            if nbytes == 150_000:
                time.sleep(0.2)   # the larger call is slow to come back

    monkeypatch.setattr(cl, "import_cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(driver=None)))
    monkeypatch.setattr(cl, "_SMEM_MAX", {})
    kern = Kernel()
    big = threading.Thread(target=cl.set_max_dynamic_smem, args=(kern, 150_000), daemon=True)
    big.start()
    time.sleep(0.05)
    cl.set_max_dynamic_smem(kern, 100_000)
    big.join(5)
    assert cl._SMEM_MAX[id(kern)] <= kern.set_to == 150_000


def test_per_thread_launch_flags_have_a_default_on_every_thread():
    """The per-thread flags the launch path reads on every launch (a plan's replay too):
    programmatic_launches' (cuda_launch._PDL), recording's and fresh_workspaces'. A thread that
    never set one reads its default as a plain attribute: getattr(threading.local(), name,
    default) there raised and caught an AttributeError inside, ~0.7 us a read on the 2-core CPU
    box against ~0.1 (pdl_enabled was a global's read, ~0.05, before it became per thread)."""
    import threading

    from quantzoo import cuda_launch as cl

    seen = {}

    def fresh_thread():
        try:
            seen["read"] = (cl._PDL.on, cl._RECORDING.launches, cl._FRESH.on,
                            cl.pdl_enabled(), cl.uncached_workspaces())
        except AttributeError as e:
            seen["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=fresh_thread, daemon=True)
    t.start()
    t.join(10)
    assert seen == {"read": (False, None, False, False, False)}
