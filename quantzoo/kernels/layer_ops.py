"""The decoder's small per-layer ops as fused CUDA kernels (cuda/layer_ops.cu), for the runner.

    add_rms_norm(h, delta, w, eps[, q8_1, layout])   h += delta in place; returns rms_norm(h) * w
                                          (with q8_1, also writes that output in Q8_1 there)
    qk_rope_store(qkv, norm_w, cos, sin, pos, k_cache, v_cache, H, KV, eps) -> q (T, H, hd)
                                          q/k RMSNorm (optional) + RoPE; k, v written to the cache
    silu_mul(gu[, q8_1, layout, out])     [gate | up] (T, 2F) -> silu(gate) * up (T, F) (and Q8_1)
    attn_decode(q, k_cache, v_cache, pos, work) -> (1, H*hd)   one token against cache rows <= pos

Each equals the torch code it replaces in quantzoo/model/llm.py with the same fp16 roundings
(tests/test_layer_ops_gpu.py checks them against that code). Every tensor is fp16 and contiguous
on one CUDA device; nothing allocates except the returned outputs (torch), and positions are
read from a device tensor, so the decode step that uses them can be captured in a CUDA graph.
Because they live on the device, position values are not checked here (that would cost a host
sync per call): they must lie in [0, S); the runner (Model.prefill / decode_step) checks them
on the host before anything is launched.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from quantzoo.cuda_launch import MAX_GRID_X, MAX_GRID_YZ, get_kernel, launch, on_tensor_device

HEAD_DIMS = {64: 2, 128: 4}      # head_dim -> elements per lane (E)
MAX_GROUP = 8                    # query heads per KV head served by attn_decode
SPLITS_MAX = 256                 # attn_decode cuts the context into at most this many runs
ATTN_RING = 4                    # attn_decode: stages of each warp's shared-memory ring (layer_ops.cuh)
NORM_CHUNKS = (1, 2, 4)         # 16-byte chunks per thread in add_rms_norm: D <= 8 * 1024 * 4
# Q8_1 output of add_rms_norm / silu_mul (the input a GGUF mmvq reads, kernels.gguf.q8_1_layout):
# the layout name -> the kernels' template value (add_rms_norm's Q; silu_mul_q8_1's SPLIT)
Q8_LAYOUTS = {"interleaved": 1, "split": 2}
SOURCES = {"layer_ops.cu": tuple(f"add_rms_norm<{a}, {v}, {q}>" for a in ("true", "false") for v in NORM_CHUNKS
                                 for q in (0, 1, 2))
           + ("silu_mul", "silu_mul_q8_1<false>", "silu_mul_q8_1<true>")
           + tuple(f"qk_rope_store<{e}, {b}>" for e in HEAD_DIMS.values() for b in ("true", "false"))
           + tuple(f"attn_decode<{e}, {g}, {ATTN_RING}>" for e in HEAD_DIMS.values()
                   for g in range(1, MAX_GROUP + 1))}


def _k(name: str):
    return get_kernel("layer_ops.cu", name, SOURCES["layer_ops.cu"])


def supports(hidden: int, ffn: int, head_dim: int, heads: int, kv_heads: int) -> str | None:
    """None when the fused kernels serve this shape, else why not (the runner then uses torch)."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (fused kernels take {sorted(HEAD_DIMS)})"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} heads over {kv_heads} KV heads (at most {MAX_GROUP} per KV head)"
    if kv_heads > MAX_GRID_YZ:   # attn_decode's gridDim.y
        return f"{kv_heads} KV heads (attn_decode takes at most {MAX_GRID_YZ})"
    if hidden % 8 or hidden > 8 * 1024 * NORM_CHUNKS[-1] or ffn % 2:
        return (f"hidden {hidden} (a multiple of 8 up to {8 * 1024 * NORM_CHUNKS[-1]}) / "
                f"intermediate {ffn} (even)")
    return None


def _check(name, t, shape=None, dtype=None, device=None, align=0):
    """align: the widest load or store (bytes) the kernel makes at t's address."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor, got {type(t).__name__}"
                         + ("" if not isinstance(t, torch.Tensor) else f" on {t.device}"))
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, the other operands are on {device}")
    if t.dtype != (dtype or torch.float16):
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype or torch.float16}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if align and t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name}: its data must start at a {align}-byte boundary (the kernel reads "
                         f"{align} bytes at a time; address % {align} = {t.data_ptr() % align})")


def _check_q8_1(q8_1, layout, T, D, device, arg):
    """The Q8_1 output buffer of T rows of D values: uint8, exactly T * D / 32 blocks of 36 bytes."""
    import torch

    if layout not in Q8_LAYOUTS:
        raise ValueError(f"layout: {layout!r}, one of {tuple(Q8_LAYOUTS)}")
    if D % 32:
        raise ValueError(f"{arg}: a row of {D} values is not whole 32-value Q8_1 blocks")
    _check("q8_1", q8_1, (T * D // 32 * 36,), torch.uint8, device)
    if q8_1.data_ptr() % 16:
        raise ValueError("q8_1: address not 16-byte aligned")


def norm_shape(D: int) -> tuple[int, int]:
    """add_rms_norm's (V, threads) for a row of D values: V 16-byte chunks per thread, threads a
    whole number of warps (the persistent decode kernel reproduces it to give the same bits)."""
    V = next(v for v in NORM_CHUNKS if D <= 8 * 1024 * v)
    return V, -(-D // (8 * V * 32)) * 32


@on_tensor_device
def add_rms_norm(h, delta, w, eps: float, q8_1=None, layout: str = "split"):
    """h (T, D) fp16 (updated in place to h + delta when delta is not None) -> fp16 (T, D).
    With q8_1 (uint8, T * D / 32 * 36 bytes; D % 32 == 0) the output is also written there as
    Q8_1 blocks in `layout` ("split" or "interleaved"), the bytes kernels.gguf.quantize_q8_1(_split)
    would make of it."""
    import torch

    _check("h", h, align=16)   # 16-byte chunks of h, delta, w (layer_ops.cuh, rms_norm_row)
    limit = 8 * 1024 * NORM_CHUNKS[-1]
    if h.dim() != 2 or h.shape[1] % 8 or h.shape[1] > limit:
        raise ValueError(f"h: shape {tuple(h.shape)}, expected (T, D) with D a multiple of 8, at most {limit}")
    T, D = h.shape
    if T > MAX_GRID_X:   # one block a row
        raise ValueError(f"h: {T} rows, past CUDA's gridDim.x limit of {MAX_GRID_X} (add_rms_norm runs a block a row)")
    if delta is not None:
        _check("delta", delta, (T, D), device=h.device, align=16)
    _check("w", w, (D,), device=h.device, align=16)
    q = 0
    if q8_1 is not None:
        _check_q8_1(q8_1, layout, T, D, h.device, "h")
        q = Q8_LAYOUTS[layout]
    out = torch.empty_like(h)
    if T == 0:   # (a grid of no blocks is an invalid launch)
        return out
    kern, grid, block, scalars = _norm_launch(T, D, delta is not None, q, eps)
    launch(kern, grid, block, (h.data_ptr(), delta.data_ptr() if delta is not None else 0, w.data_ptr(),
                               out.data_ptr(), q8_1.data_ptr() if q else 0) + scalars)
    return out


def _norm_launch(T: int, D: int, has_delta: bool, q: int, eps: float):
    """add_rms_norm's (kernel, grid, block, scalar arguments); its 5 pointers come first."""
    V, threads = norm_shape(D)
    return (_k(f"add_rms_norm<{'true' if has_delta else 'false'}, {V}, {q}>"), (T,), (threads,),
            (np.int32(D), np.float32(eps)))


@on_tensor_device
def qk_rope_store(qkv, norm_w, cos, sin, pos, k_cache, v_cache, H: int, KV: int, eps: float):
    """qkv (T, (H + 2 KV) hd); norm_w (H + KV, hd) or None; cos/sin (S, hd); pos (T,) int64;
    k_cache/v_cache (KV, S, hd) of one layer. Returns q (T, H, hd); k and v land in the caches."""
    import torch

    _check("k_cache", k_cache)
    if k_cache.dim() != 3 or k_cache.shape[0] != KV:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}, expected ({KV}, S, head_dim)")
    _, S, hd = k_cache.shape
    if hd not in HEAD_DIMS:
        raise ValueError(f"k_cache: head_dim {hd}, the fused kernels take {sorted(HEAD_DIMS)}")
    _check("v_cache", v_cache, (KV, S, hd), device=k_cache.device)
    _check("qkv", qkv, device=k_cache.device)
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * KV) * hd:
        raise ValueError(f"qkv: shape {tuple(qkv.shape)}, expected (T, {(H + 2 * KV) * hd})")
    T = qkv.shape[0]
    _check("pos", pos, (T,), torch.int64, k_cache.device)
    _check("cos", cos, (S, hd), device=k_cache.device)
    _check("sin", sin, (S, hd), device=k_cache.device)
    if norm_w is not None:
        _check("norm_w", norm_w, (H + KV, hd), device=k_cache.device)
    items = T * (H + 2 * KV)
    if items and not S:   # (q heads read cos and sin at pos[t] too: tables of no rows)
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}, no positions to rotate at or store k and v at")
    q = torch.empty((T, H, hd), dtype=qkv.dtype, device=qkv.device)
    if items == 0:   # (a grid of no blocks is an invalid launch)
        return q
    kern, grid, block, scalars = _rope_launch(T, H, KV, S, hd, norm_w is not None, eps)
    launch(kern, grid, block,
           (qkv.data_ptr(), norm_w.data_ptr() if norm_w is not None else 0, cos.data_ptr(), sin.data_ptr(),
            pos.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()) + scalars)
    return q


def _rope_launch(T: int, H: int, KV: int, S: int, hd: int, has_norm: bool, eps: float):
    """qk_rope_store's (kernel, grid, block, scalar arguments); its 8 pointers come first."""
    name = f"qk_rope_store<{HEAD_DIMS[hd]}, {'true' if has_norm else 'false'}>"
    return (_k(name), (math.ceil(T * (H + 2 * KV) / 4),), (128,),
            (np.int32(T), np.int32(H), np.int32(KV), np.int32(S), np.float32(eps)))


@on_tensor_device
def silu_mul(gu, q8_1=None, layout: str = "split", out=None):
    """gu (T, 2F) fp16 = [gate | up] -> silu(gate) * up (T, F) fp16 (into `out` if given); with
    q8_1 (uint8, T * F / 32 * 36 bytes; F % 32 == 0) also as Q8_1 blocks in `layout` (as
    add_rms_norm)."""
    import torch

    _check("gu", gu, align=0 if q8_1 is not None else 4)   # silu_mul's half2 loads
    if gu.dim() != 2 or gu.shape[1] % 4:
        raise ValueError(f"gu: shape {tuple(gu.shape)}, expected (T, 2F) with F even")
    T, F2 = gu.shape
    if F2 // 2 >= 2**31:   # (the kernels take F as an int)
        raise ValueError(f"gu: shape {tuple(gu.shape)}, F={F2 // 2} too large for the kernels' 32-bit F")
    if out is None:
        out = torch.empty((T, F2 // 2), dtype=gu.dtype, device=gu.device)
    else:
        _check("out", out, (T, F2 // 2), gu.dtype, gu.device, align=0 if q8_1 is not None else 4)
    if q8_1 is not None:
        _check_q8_1(q8_1, layout, T, F2 // 2, gu.device, "gu")
        if T * F2 // 64 == 0:   # (no Q8_1 block: a grid of none is an invalid launch)
            return out
        launch(*_silu_launch(T, F2, layout, (gu.data_ptr(), out.data_ptr(), q8_1.data_ptr())))
        return out
    launch(*_silu_launch(T, F2, None, (gu.data_ptr(), out.data_ptr())))
    return out


def _silu_launch(T: int, F2: int, layout: str | None, pointers: tuple):
    """silu_mul's (kernel, grid, block, arguments) with Q8_1 output in `layout` or without (None);
    its pointers (gu, out[, q8_1]) come first."""
    scalars = (np.int64(T), np.int32(F2 // 2))
    if layout is not None:   # a thread block a run of 8 Q8_1 blocks
        return (_k(f"silu_mul_q8_1<{'true' if layout == 'split' else 'false'}>"), (-(-(T * F2 // 64) // 8),),
                (256,), pointers + scalars)
    blocks = max(1, min(math.ceil(T * F2 // 4 / 256), 132 * 8))   # a thread a pair of outputs
    return _k("silu_mul"), (blocks,), (256,), pointers + scalars


class Repeated:
    """add_rms_norm, qk_rope_store and silu_mul as the runner calls them (model/llm.py,
    _forward_fused): on every layer the same shapes, on the model's own tensors, with their
    device current. The first call of each shape (T rows, sizes, Q8_1 layout) runs the checked op
    above and packs its launch (cuda_launch.PackedLaunch); later calls of that shape -- the other
    layers', the next prompt's of the same length -- aim the packed launch at their tensors and
    check nothing. Through the checked ops a call cost 33-41 us of host time on the lent H100's
    host, most of a short prefill's time (bench/NOTES.md, session 55). At most LIMIT shapes are
    kept, the oldest dropped first. One per model: not for two threads at once."""
    LIMIT = 64

    def __init__(self):
        self._packed: dict = {}

    def _pack(self, key, launch_cfg, n_pointers: int) -> None:
        """Keep launch_cfg's (kernel, grid, block, scalar arguments) packed for key, its first
        n_pointers arguments to be aimed per call."""
        from quantzoo.cuda_launch import PackedLaunch

        while len(self._packed) >= self.LIMIT:
            del self._packed[next(iter(self._packed))]
        kern, grid, block, scalars = launch_cfg
        self._packed[key] = PackedLaunch(kern, grid, block, (0,) * n_pointers + scalars)

    @staticmethod
    def _launch(pl, pointers) -> None:
        for i, p in enumerate(pointers):
            pl.set_pointer(i, p)
        pl()

    def add_rms_norm(self, h, delta, w, eps: float, q8_1=None, layout: str = "split"):
        T, D = h.shape
        q = Q8_LAYOUTS[layout] if q8_1 is not None else 0
        key = ("norm", T, D, delta is not None, q, eps)
        pl = self._packed.get(key)
        if pl is None:
            out = add_rms_norm(h, delta, w, eps, q8_1, layout)
            if T:
                self._pack(key, _norm_launch(T, D, delta is not None, q, eps), 5)
            return out
        out = h.new_empty((T, D))
        self._launch(pl, (h.data_ptr(), delta.data_ptr() if delta is not None else 0, w.data_ptr(),
                          out.data_ptr(), q8_1.data_ptr() if q else 0))
        return out

    def qk_rope_store(self, qkv, norm_w, cos, sin, pos, k_cache, v_cache, H: int, KV: int, eps: float):
        T, (_, S, hd) = qkv.shape[0], k_cache.shape
        key = ("rope", T, qkv.shape[1], H, KV, S, hd, norm_w is not None, eps)
        pl = self._packed.get(key)
        if pl is None:
            q = qk_rope_store(qkv, norm_w, cos, sin, pos, k_cache, v_cache, H, KV, eps)
            if T and S:
                self._pack(key, _rope_launch(T, H, KV, S, hd, norm_w is not None, eps), 8)
            return q
        q = qkv.new_empty((T, H, hd))
        self._launch(pl, (qkv.data_ptr(), norm_w.data_ptr() if norm_w is not None else 0, cos.data_ptr(),
                          sin.data_ptr(), pos.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()))
        return q

    def silu_mul(self, gu, q8_1=None, layout: str = "split"):
        T, F2 = gu.shape
        lay = layout if q8_1 is not None else None
        key = ("silu", T, F2, lay)
        pl = self._packed.get(key)
        if pl is None:
            out = silu_mul(gu, q8_1, layout)
            if T * F2 // 64:
                kern, grid, block, args = _silu_launch(T, F2, lay, ())
                self._pack(key, (kern, grid, block, args), 3 if lay else 2)
            return out
        out = gu.new_empty((T, F2 // 2))
        self._launch(pl, (gu.data_ptr(), out.data_ptr()) + ((q8_1.data_ptr(),) if lay else ()))
        return out


class DecodeWork:
    """fp32 scratch of attn_decode for one cache size S: the runs' partial outputs. The kernel
    cuts rows 0..pos into one run up to 128 positions, else ceil((pos + 1) / 64) runs, at most
    n_split (cuda/layer_ops.cuh, AttnRuns), and its grid is n_split x kv_heads CTAs, so n_split
    is also capped at about two CTAs per SM: more, shorter runs cost more than they gain (H100,
    Qwen3-8B heads, a 16k-token context: 37 us with runs of 512 positions, 42 with 256, 87 with
    64; bench/NOTES.md, session 30)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, S: int, device):
        import torch

        from quantzoo.cuda_launch import sm_count

        # (Python ints: numpy's would make a numpy n_split, which attn_decode's check refuses)
        heads, kv_heads, head_dim, S = map(operator.index, (heads, kv_heads, head_dim, S))
        sms = sm_count(device) if torch.device(device).type == "cuda" else 132   # (CPU: the tests)
        self.n_split = max(1, min(SPLITS_MAX, S // 64, -(-2 * sms // kv_heads)))
        self.S = S
        self.o = torch.empty((heads, self.n_split, head_dim), dtype=torch.float32, device=device)
        self.ml = torch.empty((heads, self.n_split, 2), dtype=torch.float32, device=device)
        self.count = torch.zeros(kv_heads, dtype=torch.int32, device=device)  # finished CTAs


def _desc(t) -> str:
    import torch

    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


@on_tensor_device
def attn_decode(q, k_cache, v_cache, pos, work: DecodeWork):
    """q (1, H, hd) one token; k_cache/v_cache (KV, S, hd); pos (1,) int64 -> (1, H*hd) fp16:
    softmax(q k^T / sqrt(hd)) v over cache rows 0..pos (GQA: head h reads KV head h // G)."""
    import torch

    _check("k_cache", k_cache)
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}, expected (KV, S, head_dim)")
    KV, S, hd = k_cache.shape
    if not KV or not S:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}, no KV heads or no positions")
    if KV > MAX_GRID_YZ:   # the grid is n_split x KV CTAs
        raise ValueError(f"k_cache: {KV} KV heads, past CUDA's gridDim.y limit of {MAX_GRID_YZ} (attn_decode "
                         "runs a row of CTAs per KV head)")
    _check("v_cache", v_cache, (KV, S, hd), device=k_cache.device)
    _check("q", q, device=k_cache.device)
    if q.dim() != 3 or q.shape[0] != 1 or q.shape[2] != hd or not q.shape[1] or q.shape[1] % KV:
        raise ValueError(f"q: shape {tuple(q.shape)}, expected (1, H, {hd}) with H a positive multiple of {KV}")
    H = q.shape[1]
    G = H // KV
    if hd not in HEAD_DIMS or G > MAX_GROUP:
        raise ValueError(f"attn_decode: head_dim {hd} / group {G} not served "
                         f"(head_dim in {sorted(HEAD_DIMS)}, group <= {MAX_GROUP})")
    _check("pos", pos, (1,), torch.int64, k_cache.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:   # the kernel copies cache rows in 16-byte pieces (cp.async)
            raise ValueError(f"{name}: its data must start at a 16-byte boundary")
    if q.data_ptr() % (2 * HEAD_DIMS[hd]):   # a lane loads its E halves of a head at once
        raise ValueError(f"q: its data must start at a {2 * HEAD_DIMS[hd]}-byte boundary")
    if work.o.device != k_cache.device:
        raise ValueError(f"work: on {work.o.device}, the cache is on {k_cache.device}")
    if work.S != S or work.o.shape[0] != H or work.count.shape[0] != KV:
        raise ValueError(f"work: made for S={work.S}, {work.o.shape[0]} heads / {work.count.shape[0]} KV heads;"
                         f" the cache has S={S}, {H} / {KV}")
    # the kernel writes n_split partials of hd floats a head into o, and n_split (max, sum) into ml
    # (~2 us of Python; a cache of this check keyed on the tensors was more code than it saved)
    o, ml, count, n = work.o, work.ml, work.count, work.n_split
    if (not isinstance(n, int) or not 1 <= n <= SPLITS_MAX
            or any(not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype
                   or t.device != k_cache.device or not t.is_contiguous()
                   for t, shape, dtype in ((o, (H, n, hd), torch.float32), (ml, (H, n, 2), torch.float32),
                                           (count, (KV,), torch.int32)))):
        raise ValueError(f"work: n_split={n!r}, o {_desc(o)}, ml {_desc(ml)}, count {_desc(count)}; "
                         f"the cache needs n_split in 1..{SPLITS_MAX}, o ({H}, n_split, {hd}) and ml ({H}, "
                         f"n_split, 2) float32, count ({KV},) int32, contiguous on {k_cache.device} "
                         f"(DecodeWork({H}, {KV}, {hd}, {S}, device) makes them)")
    E = HEAD_DIMS[hd]
    scale_log2 = math.log2(math.e) / math.sqrt(hd)
    out = torch.empty((1, H * hd), dtype=q.dtype, device=q.device)
    launch(_k(f"attn_decode<{E}, {G}, {ATTN_RING}>"), (n, KV), (128,),
           (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos.data_ptr(), o.data_ptr(),
            ml.data_ptr(), count.data_ptr(), out.data_ptr(), np.int32(S), np.int32(n),
            np.float32(scale_log2)))
    return out
