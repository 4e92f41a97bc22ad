"""AWQ W4A16, the "gemm" layout of HF AWQ checkpoints (AutoAWQ, vLLM).

    qweight int32 [K, N/8]    8 nibbles per int32, along the output dimension
    qzeros  int32 [K/G, N/8]  zero points, packed the same way
    scales  fp16  [K/G, N]    one scale per (group of G along K, output column)
    w[k, n] = (q[k, n] - z[k/G, n]) * s[k/G, n]            (K = in_features, N = out_features)

Note the [in, out] orientation, transposed from torch's Linear weight.

Interleave: nibble slot j (bits 4j..4j+3) of an int32 holds output column 8c + ORDER[j],
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; column 8c + i therefore sits at shift 4 * REVERSE[i],
REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]. The point of the shuffle: masking an int32 with
0x000f000f picks slots 0 and 4 = columns 0 and 1, so the LOP3 trick (cuda/) turns one int32
into the half2 pairs (0,1), (2,3), (4,5), (6,7) with no further shuffling.

Quantizer: round to nearest, no activation-aware scale search. Per group and column:
s = max(max - min, 1e-5) / 15 (rounded to fp16: the stored value is the one q is fitted to),
z = clip(round(-min / s), 0, 15), q = clip(round(w / s) + z, 0, 15).
This is AutoAWQ's round-to-nearest, limits included: a group whose values do not straddle 0
(all positive, or all negative) gets z clipped to 0 or q to 15, so it is represented badly (a
constant group of 1.0 dequantizes to 1e-5). Real linear weights, centred on 0, do not meet this;
quantize warns (RuntimeWarning naming the first group and column, and the count) where it does.
A weight past fp16's +-65504 is refused (ValueError naming it): the kernels' fp16 weight cannot
hold it, whether the rest of its group is spread out or constant.
"""
from __future__ import annotations

import numbers

import numpy as np

from .base import Format, as_float_matrix, warn
from .tensor import QuantizedTensor

REVERSE = np.array([0, 4, 1, 5, 2, 6, 3, 7])
GROUP_SIZES = (32, 64, 128)
QUANTIZE_CHUNK = 1 << 22   # weights quantized at a time (whole output rows, a multiple of 8)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q int [R, N] with values 0..15 -> int32 [R, N/8] in the AWQ interleave."""
    r, n = q.shape
    q8 = q.astype(np.uint32).reshape(r, n // 8, 8)
    packed = np.zeros((r, n // 8), dtype=np.uint32)
    for i in range(8):
        packed |= q8[..., i] << np.uint32(4 * REVERSE[i])
    return packed.view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [R, N/8] -> uint8 [R, N]: column 8c + i is nibble slot REVERSE[i] of word c."""
    p = np.asarray(packed).view(np.uint32)
    shifts = (4 * REVERSE).astype(np.uint32)
    q = (p[..., None] >> shifts) & np.uint32(0xF)
    return q.reshape(p.shape[0], -1).astype(np.uint8)


def check_shape(n: int, k: int, group_size: int, what: str = "awq") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size not in GROUP_SIZES:
        raise ValueError(f"{what}: group_size={group_size!r} is not supported; choose one of {GROUP_SIZES}")
    if n % 8:
        raise ValueError(f"{what}: out_features N={n} must be a multiple of 8 (8 nibbles per int32)")
    if k % group_size:
        raise ValueError(f"{what}: in_features K={k} is not a multiple of group_size={group_size}")


class AWQ(Format, name="awq"):
    block_size = 128          # default group size
    param_names = ("group_size",)
    kernels = "awq"
    nmse_ceiling = 0.012      # g128 on the standard workload (issue: under 1.2 %)

    @property
    def bits_per_weight(self) -> float:
        return self.bits_for(self.block_size)

    @staticmethod
    def bits_for(group_size: int) -> float:
        """Storage bits per weight at this group size: 4 + (16 + 4) / group_size (a formula: the
        group size is not checked)."""
        return 4.0 + (16 + 4) / group_size  # fp16 scale + 4-bit zero per group and column

    def quantize(self, w, group_size: int = 128) -> QuantizedTensor:
        """AutoAWQ's round-to-nearest (the module docstring gives the arithmetic) of w (N, K), a
        numpy array or torch tensor, to {qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales
        fp16 [K/G, N]} with params {"group_size": G}. group_size: 32, 64 or 128. ValueError for
        another group size, N not a multiple of 8 or K of G, a weight past fp16's +-65504 and
        what formats.as_float_matrix refuses (not 2-D, empty, NaN / inf, complex, meta). Warns
        (RuntimeWarning) for groups that do not straddle 0 or span less than 1e-5."""
        w = as_float_matrix(w)
        n, k = w.shape
        check_shape(n, k, group_size, "awq.quantize")
        group_size = int(group_size)
        qweight = np.empty((k, n // 8), np.int32)
        qzeros = np.empty((k // group_size, n // 8), np.int32)
        scales = np.empty((k // group_size, n), np.float16)
        # Output rows are quantized on their own, so 8-row slices give the same bytes with the
        # float32 temporaries (~10 bytes a weight) bounded by the slice, not the whole matrix.
        step = 8 * max(1, QUANTIZE_CHUNK // (8 * k))
        n_clipped, first = 0, None   # groups whose zero point was clipped (_quantize_rows)
        n_lost, first_lost = 0, None   # groups the scale's floor lost (_lost_groups)
        for r0 in range(0, n, step):
            q, z, s16, (count, where), (lcount, lwhere) = self._quantize_rows(w[r0:r0 + step], group_size, r0)
            if count and first is None:
                first = where
            if lcount and first_lost is None:
                first_lost = lwhere
            n_clipped += count
            n_lost += lcount
            c = slice(r0 // 8, (r0 + step) // 8)
            qweight[:, c], qzeros[:, c], scales[:, r0:r0 + step] = pack_int4(q), pack_int4(z), s16
        if n_clipped:
            col, grp, zr, lo, hi, err, s = first
            warn(f"awq.quantize: group {grp} (in_features {grp * group_size}..{(grp + 1) * group_size - 1}), "
                 f"column {col}: zero point round(-min/s) = {zr:g} clipped to 0..15, the group does not straddle "
                 f"0 (min {lo:.4g}, max {hi:.4g}), so its weights dequantize off by up to {err:.4g} "
                 f"({err / s:.3g} steps of s = {s:.4g}); {n_clipped} of {(k // group_size) * n} (group, column) pairs "
                 "are clipped like this (AutoAWQ's round to nearest writes the same)")
        if n_lost:
            col, grp, amax, err = first_lost
            warn(f"awq.quantize: group {grp} (in_features {grp * group_size}..{(grp + 1) * group_size - 1}), "
                 f"column {col}: its weights (max |w| {amax:.4g}) span less than AutoAWQ's floor on a group's "
                 f"range (1e-5: s = 1e-5 / 15), so they dequantize off by up to {err:.4g}; {n_lost} of "
                 f"{(k // group_size) * n} (group, column) pairs are off by over half their largest |w| "
                 "(scale the weight up or keep it in fp16)")
        return QuantizedTensor("awq", (n, k), {"qweight": qweight, "qzeros": qzeros, "scales": scales},
                               {"group_size": group_size})

    @staticmethod
    def _quantize_rows(w, group_size, r0=0):
        """w float32 [n, K] (rows r0.. of the weight) -> q [K, n], z [K/G, n] (0..15), fp16 s
        [K/G, n], (the count of clipped groups, (column, group, unclipped z, min, max, max error,
        s) of the first, by column then group) ((0, None) when none are), and _lost_groups'."""
        n, k = w.shape
        g = w.T.reshape(k // group_size, group_size, n)           # [groups, G, n]
        lo, hi = g.min(axis=1), g.max(axis=1)                     # [groups, n]
        if lo.min() < -65504 or hi.max() > 65504:   # the kernels' fp16 weight cannot hold it,
            r, c = (int(i) for i in np.argwhere(np.abs(w) > 65504)[0])   # whatever its group holds
            raise ValueError(f"awq.quantize: w[{r0 + r}, {c}] = {float(w[r, c]):.6g} is beyond fp16's +-65504 "
                             "(AWQ's dequantized weights are fp16)")
        s = np.maximum(hi - lo, np.float32(1e-5)) / np.float32(15)
        with np.errstate(over="ignore"):
            s16 = s.astype(np.float16)
        if not np.isfinite(s16).all():   # (unreachable past the check above: range <= 2 * 65504)
            raise ValueError("awq.quantize: a group's range exceeds what an fp16 scale can hold "
                             f"(max range {float((hi - lo).max()):.4g} > 15 * 65504)")
        s = s16.astype(np.float32)
        zr = np.round(-lo / s)
        z = np.clip(zr, 0, 15)
        # (in place from here: the slice-sized temporaries bound the memory, test_awq_codec)
        r = g / s[:, None, :]
        np.round(r, out=r)
        q = r + z[:, None, :]
        np.clip(q, 0, 15, out=q)
        lost = AWQ._lost_groups(g, q, z, s, (hi - lo < np.float32(1e-5)) & (zr == z), r0)
        # A group is reported as clipped when some weight's stored level q - z is more than one
        # level from round(w / s), its level on the stored scale without the clips. With z in
        # 0..15 that never happens: the group's minimum gets q = 0 exactly, and its maximum
        # round(max / s) + z <= 16, since (max - min) / s <= 15 give or take fp16's rounding of s,
        # so the clip to 15 moves a level by one at most (an ordinary half-step-and-a-bit error).
        # It can happen only where z itself was clipped, i.e. the group does not straddle 0 (all
        # its weights above s / 2, or all below -s / 2), and does where that clip is more than a
        # level: weights in [1, 2) all become 1, a constant group c > 1.1e-5 becomes 15 s = 9.8e-6.
        r -= q
        r += z[:, None, :]
        np.abs(r, out=r)                   # |round(w / s) - (q - z)|
        moved = (r > 1).any(axis=1)        # [groups, n]
        del r
        t = q - z[:, None, :]
        t *= s[:, None, :]
        np.abs(t, out=t)
        big = float(t.max())
        del t
        if big > 65504:   # the dequant (and the kernels' fp16 weight) would be inf
            raise ValueError(f"awq.quantize: a dequantized weight reaches {big:.6g}, beyond fp16's +-65504")
        count = int(moved.sum())
        if not count:
            return q.reshape(k, n), z, s16, (0, None), lost
        col, grp = (int(i) for i in np.argwhere(moved.T)[0])
        err = float(np.abs((q[grp, :, col] - z[grp, col]) * s[grp, col] - g[grp, :, col]).max())
        return q.reshape(k, n), z, s16, (count, (r0 + col, grp, float(zr[grp, col]), float(lo[grp, col]),
                                                  float(hi[grp, col]), err, float(s[grp, col]))), lost

    @staticmethod
    def _lost_groups(g, q, z, s, floored, r0):
        """(count, (column, group, max |w|, max error) of the first by group then column) of the
        groups whose weights AutoAWQ's floor on the scale loses ((0, None) if none): a group whose
        range is below 1e-5 still gets s = 1e-5 / 15, levels coarser than its weights, and is
        "lost" when a weight dequantizes off by more than half the group's largest |w| (the rule
        the GGUF formats use for an underflowing d). Only such tiny groups (`floored`: those whose
        zero point was not clipped, which the clip's warning names) are dequantized here."""
        grp, col = np.nonzero(floored)
        if not grp.size:
            return 0, None
        w = g[grp, :, col]                                            # [floored, G]
        err = np.abs((q[grp, :, col] - z[grp, col][:, None]) * s[grp, col][:, None] - w).max(axis=1)
        amax = np.abs(w).max(axis=1)
        lost = np.flatnonzero(err > amax / 2)
        if not lost.size:
            return 0, None
        i = lost[0]
        return int(lost.size), (r0 + int(col[i]), int(grp[i]), float(amax[i]), float(err[i]))

    def _nonfinite_rows(self, qt) -> np.ndarray:
        return ~np.isfinite(np.asarray(qt.numpy().data["scales"], np.float16)).all(axis=0)   # [K/G, N]

    def storage(self, shape, params: dict) -> dict:
        n, k = shape
        g = params.get("group_size")
        check_shape(n, k, g)
        return {"qweight": ((k, n // 8), np.int32), "qzeros": ((k // g, n // 8), np.int32),
                "scales": ((k // g, n), np.float16)}

    def from_arrays(self, qweight, qzeros, scales, group_size: int | None = None) -> QuantizedTensor:
        """Wrap HF-layout arrays (e.g. from a safetensors checkpoint), checking their shapes."""
        qweight, qzeros, scales = (np.asarray(a) for a in (qweight, qzeros, scales))
        if qweight.ndim != 2 or scales.ndim != 2 or 0 in qweight.shape + scales.shape:
            raise ValueError(f"awq: qweight {list(qweight.shape)} and scales {list(scales.shape)} must be "
                             "2-D and non-empty")
        k, n8 = qweight.shape
        if group_size is None:
            if k % scales.shape[0]:
                raise ValueError(f"awq: scales has {scales.shape[0]} group rows, which do not divide "
                                 f"qweight's K={k} rows")
            group_size = k // scales.shape[0]
        elif scales.shape[0] * group_size != k:
            raise ValueError(f"awq: group_size={group_size} disagrees with scales' {scales.shape[0]} "
                             f"group rows over qweight's K={k} rows")
        qt = QuantizedTensor("awq", (n8 * 8, k), {"qweight": qweight, "qzeros": qzeros, "scales": scales},
                             {"group_size": group_size})
        self.check(qt)
        return qt

    def fields(self, qt: QuantizedTensor) -> dict:
        """Integer fields: q uint8 [K, N], z uint8 [K/G, N], s fp16 [K/G, N]."""
        qt = qt.numpy()
        return {"q": unpack_int4(qt.data["qweight"]), "z": unpack_int4(qt.data["qzeros"]),
                "s": qt.data["scales"]}

    def _dequantize(self, qt: QuantizedTensor) -> np.ndarray:
        f = self.fields(qt)
        g = qt.group_size
        k, n = f["q"].shape
        w = (f["q"].reshape(k // g, g, n).astype(np.float32) - f["z"][:, None, :]) \
            * f["s"].astype(np.float32)[:, None, :]
        return np.ascontiguousarray(w.reshape(k, n).T)

    def emulate(self, x, qt, return_bound=False):
        from quantzoo.reference import awq_fp16

        self.check(qt)   # (awq_fp16 dequantizes by qt's own format: another one's weight ran fp16 math)
        return awq_fp16.emulate_matmul(x, qt, return_bound=return_bound)
