"""llama.cpp's 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights, Q8_1 activations.

Storage is bit-identical to a .gguf tensor: a weight (N, K) is uint8 (N, K/32 * bytes), each
row a run of blocks laid out as ggml-common.h declares them:

    Q4_0  18 B  half d;          u8 qs[16]            w = (q - 8) * d        q in 0..15
    Q4_1  20 B  half d, m;       u8 qs[16]            w = q * d + m          q in 0..15
    Q5_0  22 B  half d; u8 qh[4]; u8 qs[16]           w = (q - 16) * d       q in 0..31
    Q5_1  24 B  half d, m; u8 qh[4]; u8 qs[16]        w = q * d + m          q in 0..31
    Q8_0  34 B  half d;          i8 qs[32]            w = q * d              q in -127..127
    Q8_1  36 B  half d, s;       i8 qs[32]            x = q * d, s = sum(x)  (CUDA activation block)

Nibbles: element j of a block is the low nibble of qs[j], element j+16 the high one. Q5's fifth
bit of element j is bit j of the little-endian uint32 qh.

The quantizers follow llama.cpp's reference (ggml-quants.c) as gguf-py reproduces it in numpy:
every intermediate in float32, d rounded to half only when stored, so our bytes equal
`gguf.quants.quantize` (the tests hold us to it). We own the codec instead of calling gguf-py
because the kernels' reference needs the integer fields (q, d, m), which gguf-py never exposes.
"""
from __future__ import annotations

import numbers

import numpy as np

from .base import Format, as_float_matrix, warn
from .tensor import QuantizedTensor

QUANTIZE_CHUNK = 1 << 22   # weights quantized at a time (whole rows)
QK = 32  # elements per block, every format here


def roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero (numpy's np.round goes to even). Exact in float64."""
    v = np.asarray(v, dtype=np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _cast_q(q: np.ndarray) -> np.ndarray:
    """Non-finite q (a block whose fp32 scale is subnormal, so 1/d is inf) -> 0, as llama.cpp's
    and gguf-py's float-to-int casts give on x86; np.clip would turn +inf into the top level."""
    return np.where(np.isfinite(q), q, 0)


def _split_blocks(w: np.ndarray, what: str) -> np.ndarray:
    n, k = w.shape
    if k % QK:
        raise ValueError(f"{what}: in_features K={k} is not a multiple of the block size {QK}")
    return w.reshape(n, k // QK, QK)


class GGUFBlockFormat(Format):
    """Shared codec of the block formats; subclasses set the bit width and the layout."""

    block_size = QK
    bits = 4            # bits per quantized element
    has_min = False     # Q4_1 / Q5_1 store m (the block minimum)
    offset = 0          # Q4_0: 8, Q5_0: 16 (q is stored unsigned, value uses q - offset)
    kernels = "gguf"

    # ---- field layout --------------------------------------------------------------
    def unpack(self, data: np.ndarray) -> dict:
        """uint8 (N, nb*bytes) -> {d: f16 (N, nb), m: f16 | None, q: int16 (N, nb, 32)}."""
        data = np.ascontiguousarray(data, dtype=np.uint8)
        n = data.shape[0]
        blk = data.reshape(n, -1, self.bytes_per_block)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0]
        pos = 2
        m = None
        if self.has_min:
            m = blk[..., 2:4].copy().view(np.float16)[..., 0]
            pos = 4
        if self.bits == 8:
            q = blk[..., pos:pos + QK].view(np.int8).astype(np.int16)
            return {"d": d, "m": m, "q": q}
        qh = None
        if self.bits == 5:
            qh = blk[..., pos:pos + 4].copy().view("<u4")[..., 0]
            pos += 4
        qs = blk[..., pos:pos + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
        if qh is not None:
            hi = (qh[..., None] >> np.arange(QK, dtype=np.uint32)) & 1
            q |= (hi.astype(np.int16) << 4)
        return {"d": d, "m": m, "q": q}

    def _nonfinite_rows(self, qt) -> np.ndarray:
        blk = np.asarray(qt.numpy().data).reshape(qt.shape[0], -1, self.bytes_per_block)
        fields = [blk[..., 0:2]] + ([blk[..., 2:4]] if self.has_min else [])   # d, and m
        bad = np.zeros(qt.shape[0], bool)
        for f in fields:
            bad |= ~np.isfinite(f.copy().view(np.float16)).all(axis=(1, 2))
        return bad

    def pack(self, d: np.ndarray, q: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
        """Inverse of unpack: d (N, nb) half-representable, q (N, nb, 32) ints -> uint8 rows."""
        n, nb = d.shape
        parts = [d.astype(np.float16)[..., None].view(np.uint8)]
        if self.has_min:
            parts.append(m.astype(np.float16)[..., None].view(np.uint8))
        if self.bits == 8:
            parts.append(q.astype(np.int8).view(np.uint8))
        else:
            qu = q.astype(np.uint32)
            if self.bits == 5:
                qh = ((qu >> 4) & 1) << np.arange(QK, dtype=np.uint32)
                parts.append(qh.sum(axis=-1, dtype=np.uint32).astype("<u4")[..., None].view(np.uint8))
            lo = (qu & 0x0F).astype(np.uint8)
            parts.append(lo[..., :16] | (lo[..., 16:] << 4))
        blk = np.concatenate(parts, axis=-1)
        assert blk.shape[-1] == self.bytes_per_block
        return blk.reshape(n, nb * self.bytes_per_block)

    # ---- codec ---------------------------------------------------------------------
    def quantize_fields(self, blocks: np.ndarray) -> dict:
        """float32 blocks (..., 32) -> fields, llama.cpp reference arithmetic."""
        levels = (1 << self.bits) - 1
        if self.has_min:  # asymmetric: q = trunc((x - min) / d + 0.5)
            lo = blocks.min(axis=-1, keepdims=True)
            hi = blocks.max(axis=-1, keepdims=True)
            d = (hi - lo) / np.float32(levels)
            q = np.trunc((blocks - lo) * _safe_inverse(d) + np.float32(0.5))
            return {"d": d[..., 0], "m": lo[..., 0], "q": np.clip(_cast_q(q), 0, levels).astype(np.int16)}
        if self.bits == 8:  # Q8_0: q = roundf(x * (127 / amax))
            d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
            q = roundf(blocks * _safe_inverse(d))
            return {"d": d[..., 0], "m": None, "q": _cast_q(q).astype(np.int16)}
        # symmetric with a signed scale: the largest-magnitude element maps to q = 0 exactly
        imax = np.abs(blocks).argmax(axis=-1)[..., None]
        vmax = np.take_along_axis(blocks, imax, axis=-1)
        d = vmax / np.float32(-self.offset)
        q = np.trunc(blocks * _safe_inverse(d) + np.float32(self.offset + 0.5))
        return {"d": d[..., 0], "m": None, "q": np.clip(_cast_q(q), 0, levels).astype(np.int16)}

    def quantize(self, w, **opts) -> QuantizedTensor:
        """llama.cpp's reference quantizer (the bytes gguf-py writes; q8_1: those of llama.cpp's CUDA
        quantize_q8_1, the class docstring says how) of w (N, K), a numpy array or torch tensor, to
        uint8 blocks (N, K/32 * bytes_per_block) in .gguf file order. No options.
        ValueError for K not a multiple of 32, a block whose fp16 scale (or minimum) overflows, and
        what formats.as_float_matrix refuses (not 2-D, empty, NaN / inf, complex, meta); TypeError
        for any option. Warns (RuntimeWarning) where a block's fp16 scale underflows."""
        if opts:
            raise TypeError(f"{self.name}.quantize: unexpected options {sorted(opts)}")
        w = as_float_matrix(w)
        blocks = _split_blocks(w, f"{self.name}.quantize")
        # Rows are quantized on their own, so a chunk of rows at a time gives the same bytes with
        # temporaries (float32/float64/int16 per element, ~30 bytes per weight) bounded by the
        # chunk instead of the whole matrix (a 150k x 4096 lm_head: ~18 GB at once).
        step = max(1, QUANTIZE_CHUNK // max(1, w.shape[1]))
        out = np.empty((w.shape[0], w.shape[1] // QK * self.bytes_per_block), np.uint8)
        n_lost, first = 0, None   # blocks whose weights the fp16 d lost to underflow (_lost_blocks)
        for r0 in range(0, w.shape[0], step):
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported just below
                f = self.quantize_fields(blocks[r0:r0 + step])
            for key in ("d", "m"):  # the half fields must hold the block's scale and minimum/sum
                if f[key] is None:
                    continue
                with np.errstate(over="ignore"):
                    bad = ~np.isfinite(f[key].astype(np.float16))
                if bad.any():
                    r, b = (int(i) for i in np.argwhere(bad)[0])
                    raise ValueError(f"{self.name}.quantize: row {r0 + r}, block {b}: field {key}="
                                     f"{float(f[key][r, b]):.6g} overflows fp16 (|value| > 65504)")
            if self.kind == "weight":
                count, where = self._lost_blocks(blocks[r0:r0 + step], f)
                if count and first is None:
                    first = (r0 + where[0],) + where[1:]
                n_lost += count
            out[r0:r0 + step] = self.pack(f["d"], f["q"], f["m"])
        if n_lost:
            r, b, d, d16, amax, err = first
            warn(f"{self.name}.quantize: row {r}, block {b}: field d={d:.6g} underflows fp16 (stored as "
                 f"{d16:.6g}), so the block's weights (max |w| {amax:.4g}) dequantize off by up to {err:.4g}; "
                 f"{n_lost} of {blocks.shape[0] * blocks.shape[1]} blocks are off by over half their largest |w| "
                 "(llama.cpp writes these same bytes; scale the weight up or keep it in f16)")
        return QuantizedTensor(self.name, tuple(w.shape), out)

    def _lost_blocks(self, blocks: np.ndarray, f: dict):
        """(count, (row, block, d, stored d, max |w|, max error) of the first) of the blocks whose
        weights the fp16 fields lose (count 0, None if none).

        A block "loses its weights" when it holds a nonzero weight and its values dequantized from
        the stored fp16 d (and m) are off somewhere by more than half its largest magnitude:
        max_j |w_j - w'_j| > max_j |w_j| / 2. That never happens with d and m in fp16's normal
        range: rounding to levels costs at most max|w| / 8 (Q4_0: one step, max|w| / 8, at its
        clipped top level; Q4_1: half a step of (max - min) / 15), and rounding a normal d or m
        to fp16 adds at most 2^-11 of it (times |q| <= 127 for d). It happens where d falls below
        2^-14, fp16's smallest normal, whose subnormals have a fixed spacing of 2^-24: d rounds to
        0 (a weight block with max|w| below 127 * 2^-25 = 3.8e-6 in Q8_0 becomes all zeros) or to
        a subnormal far from it, so only such blocks are dequantized to test it. A constant block (d = 0 with exact m) loses nothing and is not
        reported."""
        tiny = np.abs(f["d"]) < np.float32(2.0 ** -14)
        if not tiny.any():
            return 0, None
        rows, cols = np.nonzero(tiny)
        sub = {"d": f["d"][rows, cols].astype(np.float16),   # what pack stores and unpack reads
               "m": None if f["m"] is None else f["m"][rows, cols].astype(np.float16),
               "q": f["q"][rows, cols]}
        b = blocks[rows, cols]
        amax = np.abs(b).max(axis=-1)
        err = np.abs(self.values(sub) - b).max(axis=-1)
        lost = err > amax / 2
        if not lost.any():
            return 0, None
        i = int(np.flatnonzero(lost)[0])   # np.nonzero is row-major: the first row, then block
        return int(lost.sum()), (int(rows[i]), int(cols[i]), float(f["d"][rows[i], cols[i]]),
                                 float(sub["d"][i]), float(amax[i]), float(err[i]))

    def storage(self, shape, params: dict) -> dict:
        n, k = shape
        if k % QK:
            raise ValueError(f"{self.name}: in_features K={k} is not a multiple of {QK}")
        return {"data": ((n, k // QK * self.bytes_per_block), np.uint8)}

    def from_bytes(self, data: np.ndarray, shape) -> QuantizedTensor:
        """Wrap raw GGUF block bytes (e.g. a tensor read by gguf.GGUFReader) without copying: a
        flat uint8 array of the tensor's size, or one already (N, K/32 * bytes)."""
        try:
            dims = tuple(shape)
        except TypeError:   # not a sequence
            dims = None
        if not (dims and len(dims) == 2 and all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                                and s > 0 for s in dims)):
            raise ValueError(f"{self.name}: shape {shape!r} is not (out_features, in_features), "
                             "two positive integers")
        n, k = (int(s) for s in dims)
        (want, _), = self.storage((n, k), {}).values()
        data = np.asarray(data)
        if data.dtype != np.uint8:
            raise ValueError(f"{self.name}: block bytes must be a uint8 array, got {data.dtype}")
        if data.ndim != 1 and data.shape != want:   # rows of another length: not this tensor's rows
            raise ValueError(f"{self.name}: block bytes of shape {data.shape}; a ({n}, {k}) tensor is "
                             f"{want} (or flat, {want[0] * want[1]} bytes)")
        if data.size != want[0] * want[1]:
            raise ValueError(f"{self.name}: {data.size} bytes given, a ({n}, {k}) tensor needs {want[0] * want[1]}")
        return QuantizedTensor(self.name, (n, k), data.reshape(want))

    def values(self, f: dict) -> np.ndarray:
        """Fields -> float32 (..., 32), the same float ops as gguf-py's dequantize."""
        d = f["d"].astype(np.float32)[..., None]
        if self.has_min:
            return d * f["q"].astype(np.float32) + f["m"].astype(np.float32)[..., None]
        return d * (f["q"] - self.offset).astype(np.float32)

    def _dequantize(self, qt: QuantizedTensor) -> np.ndarray:
        qt = qt.numpy()
        n, k = qt.shape
        return self.values(self.unpack(qt.data)).reshape(n, k)

    def emulate(self, x, qt, return_bound=False):
        from quantzoo.reference import gguf_dot

        self.check(qt)   # (gguf_dot computes by qt's own format: another one's weight ran its emulation)
        return gguf_dot.emulate_matmul(x, qt, return_bound=return_bound)

    # The per-block dot product the kernels compute, in fp32 (DESIGN.md §3):
    # sumi = sum q_w * q_a (int32, DP4A), q_w unsigned for Q4/Q5 (the offset goes through s_a).
    def block_dot(self, sumi, dw, mw, da, sa):
        """One block's term of y in fp32: sumi the int32 dot of the quantized values, dw / mw the
        weight block's scale and minimum (mw unused without one), da / sa the Q8_1 activation
        block's scale and sum."""
        if self.has_min:        # Q4_1, Q5_1: w = q d + m
            return (dw * da) * sumi + mw * sa
        if self.offset:         # Q4_0, Q5_0: w = (q - offset) d
            return dw * (da * sumi - np.float32(self.offset) * sa)
        return (dw * da) * sumi  # Q8_0: w = q d


class Q4_0(GGUFBlockFormat, name="q4_0"):
    bits, offset, bytes_per_block, gguf_type, nmse_ceiling = 4, 8, 18, "Q4_0", 0.0089


class Q4_1(GGUFBlockFormat, name="q4_1"):
    bits, has_min, bytes_per_block, gguf_type, nmse_ceiling = 4, True, 20, "Q4_1", 0.0092


class Q5_0(GGUFBlockFormat, name="q5_0"):
    bits, offset, bytes_per_block, gguf_type, nmse_ceiling = 5, 16, 22, "Q5_0", 0.0045


class Q5_1(GGUFBlockFormat, name="q5_1"):
    bits, has_min, bytes_per_block, gguf_type, nmse_ceiling = 5, True, 24, "Q5_1", 0.0048


class Q8_0(GGUFBlockFormat, name="q8_0"):
    bits, bytes_per_block, gguf_type, nmse_ceiling = 8, 34, "Q8_0", 0.0002


def flush_subnormals(v: np.ndarray) -> np.ndarray:
    """fp32 values below 2^-126 in magnitude -> zero of the same sign, as every fp32 instruction
    of a kernel compiled with -ftz=true does to its inputs and results. CuPy compiles with
    -ftz=true whatever the options say (cupy/cuda/compiler.py appends it; cupy issue 9576), so
    the Q8_1 kernel of fp32 x flushes. fp16 data never meet it: every fp16 value, and every sum
    of them, is 0 or at least 2^-24."""
    v = np.asarray(v, np.float32)
    return np.where(np.abs(v) < np.float32(2.0 ** -126), np.copysign(np.float32(0), v), v).astype(np.float32)


def butterfly_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (32) in the order of a warp's xor-shuffle reduction, in fp32 with
    subnormal results flushed (flush_subnormals: the kernels' -ftz=true).

    Step `off` adds lane i and lane i^off (16, 8, 4, 2, 1); fp32 addition is commutative, so
    every lane ends with the same value and a CUDA warp reduction gives this sum bit for bit.
    """
    v = flush_subnormals(v)
    lanes = np.arange(v.shape[-1])
    off = v.shape[-1] // 2
    while off:
        v = flush_subnormals(v + v[..., lanes ^ off])
        off //= 2
    return v[..., 0]


class Q8_1(GGUFBlockFormat, name="q8_1"):
    """Activation blocks as llama.cpp's CUDA quantize_q8_1 makes them.

    d = amax / 127 (fp32), q = roundf(x / d) (a true fp32 division; q = 0 when d = 0),
    s = sum of the original x over the block, summed in warp-butterfly order (butterfly_sum),
    then d and s rounded to half. fp32 subnormals (x, d, partial sums) are flushed to zero as the
    kernel's -ftz=true does (flush_subnormals): a block of fp32 x with amax < 127 * 2^-126 gets
    d = 0 and q = 0; fp16 x never comes near. Non-finite x: a NaN makes the block's d and s NaN
    and its q 0; an inf makes d inf and q 0 (every kernel then gives NaN), as cuda/q8_1.cuh does.
    The legacy CPU block (fp32 d and d*sum(q), 40 bytes in gguf-py's size table) is a different
    thing; the 36-byte size here is the CUDA one.
    """

    kind = "activation"
    # has_min: the second half of the header (here s) sits where Q4_1 keeps m; same packing.
    bits, has_min, bytes_per_block, kernels, nmse_ceiling = 8, True, 36, "gguf", 0.0
    gguf_type = None  # never stored in a .gguf file

    def quantize_fields(self, blocks):
        blocks = flush_subnormals(blocks)
        amax = np.abs(blocks).max(axis=-1)   # NaN if the block holds one (cuda/q8_1.cuh q8_1_max)
        d = flush_subnormals(amax / np.float32(127))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = blocks / d[..., None]  # fp32 division, correctly rounded like CUDA's '/'
            # q = 0 wherever x / d is not finite: the whole block where d = 0 (amax = 0, or
            # amax / 127 below 2^-126), a NaN block, an inf element (CUDA's float-to-int gives 0)
            q = _cast_q(roundf(ratio))
            s = butterfly_sum(blocks)
        return {"d": d, "m": s, "q": q.astype(np.int16)}

    def values(self, f):
        return f["d"].astype(np.float32)[..., None] * f["q"].astype(np.float32)

    def emulate(self, x, qt, return_bound=False):
        raise TypeError("q8_1 is an activation format: quantize activations with it, not weights")
