"""Benchmark of the GGUF kernels on one GPU (quantzoo/kernels/gguf.py), numbers for bench/notes-gguf.md.

Method (DESIGN.md §6): each measured call is captured many times into one CUDA graph, so the
~16 us eager CuPy launch from Python is not what we time; the graph is replayed with CUDA
events around it, warm-up excluded, and the median over replays is divided by the calls per
graph. Every matmul includes its activation quantization (fp16 x -> Q8_1) like llama.cpp's
figures. "rotated": the calls cycle over enough copies of the weight that the 50 MB L2 cannot
serve them; "reused": one copy, as llama.cpp's test-backend-ops runs do (partly L2-served).
Measured in the same run: device-to-device copy bandwidth (read + write bytes / time) and
cuBLAS fp16 (torch.mm on the fp16 weight, rotated the same way).

    python bench/gguf_bench.py [--formats q4_0,q8_0] [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

import quantzoo as qz
from quantzoo.bench import timing as T
from quantzoo.kernels import gguf as G

N, K = 4096, 14336   # llama.cpp's test shape (Qwen3-8B / Llama-3-8B ffn_down transposed)
# llama.cpp's CUDA kernels on this H100 (DESIGN.md §6), us per call, weights reused
LLAMA_CPP = {("q4_0", 1): 14.8, ("q4_1", 1): 12.6, ("q5_0", 1): 18.8, ("q5_1", 1): 19.7,
             ("q8_0", 1): 27.4, ("fp16", 1): 40.6, ("q4_0", 8): 34.3, ("q8_0", 8): 46.5,
             ("q4_0", 512): 325.0, ("q8_0", 512): 321.0, ("fp16", 512): 141.0}
L2_BYTES = 50 << 20



def write_results(folder: str, stem: str, text: str, data) -> None:
    """folder/stem.md (the table as text) and folder/stem.json (the raw numbers)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, stem + ".md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(folder, stem + ".json"), "w") as f:
        json.dump(data, f, indent=1, default=str)

def time_calls(calls, reps=15):
    """Median us per call of `calls` (callables) captured back to back in one CUDA graph."""
    g = T.capture_graph(lambda i: calls[i](), len(calls))
    return statistics.median(T.time_graph(g, inner=len(calls), reps=reps, warmup=1)) * 1e6


def copy_bandwidth():
    """Bytes/s (read + write) of a 1 GiB device-to-device copy: quantzoo.bench.timing's method, so the
    GGUF bench and `quantzoo bench` quote the same ceiling. Not timed inside a CUDA graph: a graph's
    memcpy node of >= 1 GiB ran at 2.71 TB/s on the H200 where the same copy launched eagerly (or
    an elementwise kernel, in a graph or not) ran at 4.18-4.23 (copy_study); this bench's earlier
    2.43 TB/s on the H100 (vs DESIGN.md's 2.99) came from that graph-captured copy."""

    return T.copy_bandwidth(1 << 30)["copy_tbps"] * 1e12


def copy_study():
    """Copy / read bandwidth by several methods and sizes (bytes moved / median time), to settle
    which copy figure is right: cudaMemcpy D2D (torch copy_ of uint8) eager and in a graph,
    an elementwise fp32 kernel (torch.mul by 1: 16-byte vector loads/stores), and read-only
    (torch.sum of fp32, bytes read only). Each warmed with >= 100 ms of the same work first."""
    res = {}
    for mb in (256, 1024, 2048):
        n = mb << 20
        a = torch.ones(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        af, bf = a.view(torch.float32), b.view(torch.float32)
        for name, fn, moved in (("memcpy", lambda: b.copy_(a), 2 * n), ("mul1", lambda: torch.mul(af, 1.0, out=bf), 2 * n),
                                ("sum-read", lambda: af.sum(), n)):
            t_end = time.time() + 0.15
            while time.time() < t_end:
                fn()
                torch.cuda.synchronize()
            ts = []
            for _ in range(30):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
            res[f"{name} {mb} MiB eager"] = moved / statistics.median(ts) / 1e12
            if name != "sum-read":
                res[f"{name} {mb} MiB graph x4"] = moved / (time_calls([fn] * 4, reps=15) * 1e-6) / 1e12
        del a, b, af, bf
        torch.cuda.empty_cache()
    return res


def mmvq_launch(fmt, qt, xq, y, m, rows):
    """The mmvq kernel alone on an already quantized activation (what G.matmul launches after Q8_1)."""
    n, k = qt.shape
    G.launch_mmvq(fmt, qt.data, xq.data_ptr(), y.data_ptr(), n, k // G.QK, m, rows)


def bench_mmvq_split(fmt, ms=(1, 2, 4, 8), detail=True):
    """us per call (Q8_1 quantization included) of mmvq x rows per CTA, rotated weights; with
    `detail` also reused weights (M = 1, 8) and at M = 1 the split: quantize alone, kernel alone."""
    qts = make_weights(fmt, n_copies(qz.formats.get(fmt).nbytes((N, K))))
    res = {}
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        for r in G.MMVQ_ROW_CHOICES:
            calls = [lambda qt=qts[i % len(qts)], r=r: G.matmul(x, qt, out=y, path="mmvq", mmvq_rows=r)
                     for i in range(max(12, len(qts)))]
            res[(m, "mmvq", r, "rotated")] = time_calls(calls)
            if detail and m in (1, 8):
                res[(m, "mmvq", r, "reused")] = time_calls(
                    [lambda r=r: G.matmul(x, qts[0], out=y, path="mmvq", mmvq_rows=r)] * 12)
        if detail and m == 1:
            xq = G.quantize_q8_1(x)
            res[(m, "quantize only", 0, "-")] = time_calls([lambda: G.quantize_q8_1(x, out=xq)] * 12)
            for r in G.MMVQ_ROW_CHOICES:
                res[(m, "kernel only", r, "rotated")] = time_calls(
                    [lambda qt=qts[i % len(qts)], r=r: mmvq_launch(fmt, qt, xq, y, m, r) for i in range(max(12, len(qts)))])
    del qts
    torch.cuda.empty_cache()
    return res


# L1::no_allocate on the weight stream or not (16-byte loads; 8-byte ones lost in round 3)
MMVQ16_NOALLOC_VARIANTS = (True, False)


def bench_mmvq16_variants(fmt, ms=(1, 8), detail=True):
    """us per call (Q8_1 quantization included, rotated weights) of the vector-load mmvq for
    each no_allocate variant x rows per warp, against the scalar-load mmvq; each
    variant's output is checked against the scalar kernel's (flag 'BAD' in the table if off)."""
    nbytes = qz.formats.get(fmt).nbytes((N, K))
    qts = make_weights(fmt, n_copies(nbytes))
    exprs = tuple(G.mmvq16_name(fmt, m, r, na) for m in ms for r in G.MMVQ_ROW_CHOICES
                  for na in MMVQ16_NOALLOC_VARIANTS)
    nb = K // G.QK
    res, bad = {}, set()
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        xq = torch.empty(m * nb * 36, device="cuda", dtype=torch.uint8)
        ref = G.matmul(x, qts[0], path="mmvq", mmvq_kernel="scalar").float()
        for r in G.MMVQ_ROW_CHOICES:
            calls = [lambda qt=qts[i % len(qts)], r=r: G.matmul(x, qt, out=y, path="mmvq", mmvq_rows=r, mmvq_kernel="scalar")
                     for i in range(max(12, len(qts)))]
            res[(m, "scalar", r)] = time_calls(calls)

        def vcall(qt, r, na, quant=True):
            if quant:
                G._launch_quantize(x, xq, m * nb, split=True)
            G.launch_mmvq16(fmt, qt.data, xq.data_ptr(), xq.data_ptr() + m * nb * 32, y.data_ptr(), N, nb, m, r,
                            noalloc=na, name_expressions=exprs)

        for na in MMVQ16_NOALLOC_VARIANTS:
            for r in G.MMVQ_ROW_CHOICES:
                y.fill_(float("nan"))
                vcall(qts[0], r, na)
                err = (y.float() - ref).abs()
                if not bool(torch.all(err <= ref.abs() * 2.0 ** -9 + 1e-3)):
                    bad.add((m, f"vec16{'na' if na else ''}", r))
                calls = [lambda qt=qts[i % len(qts)], r=r, na=na: vcall(qt, r, na) for i in range(max(12, len(qts)))]
                key = f"vec16{'na' if na else ''}"
                res[(m, key, r)] = time_calls(calls)
                if detail and m == 1:
                    res[(m, key + " reused", r)] = time_calls([lambda r=r, na=na: vcall(qts[0], r, na)] * 12)
                    res[(m, key + " kernel only", r)] = time_calls(
                        [lambda qt=qts[i % len(qts)], r=r, na=na: vcall(qt, r, na, False) for i in range(max(12, len(qts)))])
        if detail and m == 1:
            for r in G.MMVQ_ROW_CHOICES:
                res[(m, "scalar reused", r)] = time_calls(
                    [lambda r=r: G.matmul(x, qts[0], out=y, path="mmvq", mmvq_rows=r, mmvq_kernel="scalar")] * 12)
            res[(m, "quantize split only", 0)] = time_calls([lambda: G._launch_quantize(x, xq, m * nb, split=True)] * 12)
    del qts
    torch.cuda.empty_cache()
    return res, bad, nbytes


def mmvq16_main(a):
    dev = torch.cuda.get_device_name()
    bw = T.copy_bandwidth(1 << 30)["copy_tbps"] * 1e12
    print(f"# {dev}; copy bandwidth {bw / 1e12:.3f} TB/s; N={N} K={K}", flush=True)
    ms = tuple(int(v) for v in a.ms.split(","))
    out = {"device": dev, "copy_Bps": bw}
    # The same bytes as a q4_0 4096 x 14336 weight (33 MB) read by tuned library kernels, rotated:
    # cuBLAS fp16 GEMV (M = 1) on a 4096 x 4032 fp16 weight, and torch.sum of a 33 MB fp16 buffer.
    kq = 4032
    ws = [torch.randn((N, kq), device="cuda", dtype=torch.float16) for _ in range(n_copies(N * kq * 2))]
    x1 = torch.randn((1, kq), device="cuda", dtype=torch.float16)
    y1 = torch.empty((1, N), device="cuda", dtype=torch.float16)
    t_gemv = time_calls([lambda w=ws[i % len(ws)]: torch.mm(x1, w.t(), out=y1) for i in range(max(12, len(ws)))])
    t_sum = time_calls([lambda w=ws[i % len(ws)]: w.sum() for i in range(max(12, len(ws)))])
    nbq = N * kq * 2
    out["same_bytes_ceiling"] = {"bytes": nbq, "cublas_gemv_us": t_gemv, "sum_us": t_sum}
    print(f"same bytes as q4_0 ({nbq / 1e6:.1f} MB) rotated: cuBLAS fp16 GEMV {t_gemv:.2f} us "
          f"({nbq / t_gemv / 1e6:.2f} TB/s), torch.sum {t_sum:.2f} us ({nbq / t_sum / 1e6:.2f} TB/s)", flush=True)
    del ws
    lines = ["| fmt | M | kernel | R=1 us | R=2 us | R=4 us | best % of copy |", "|---|---|---|---|---|---|---|"]
    for fmt in a.formats.split(","):
        res, bad, nbytes = bench_mmvq16_variants(fmt, ms)
        out[fmt] = {"/".join(map(str, kk)): v for kk, v in res.items()}
        out[fmt + "_bad"] = sorted(map(str, bad))
        for m in ms:
            for kern in dict.fromkeys(k for (mm, k, _) in res if mm == m):
                vals = {r: res[(m, kern, r)] for (mm, k, r) in res if mm == m and k == kern}
                best = min(vals.values())
                cells = [f"{vals[r]:.2f}" + (" BAD" if (m, kern, r) in bad else "") if r in vals else ""
                         for r in G.MMVQ_ROW_CHOICES]
                lines.append(f"| {fmt} | {m} | {kern} | " + " | ".join(cells) +
                             f" | {100 * nbytes / (best * 1e-6) / bw:.0f} |")
                print(lines[-1], flush=True)
    write_results(a.out, "gguf_mmvq16_bench", "\n".join(lines), out)
    return 0


def bench_mma_splits(fmt, ms=(16, 32, 64, 128, 256, 512), splits=(None, 1, 2, 4, 8)):
    """us per call of the mma path (Q8_1 quantization and the split-K reduce included) by forced
    K splits (None = mma_plan's choice), rotated weights."""
    qts = make_weights(fmt, n_copies(qz.formats.get(fmt).nbytes((N, K))))
    res = {}
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        for sp in splits:
            calls = [lambda qt=qts[i % len(qts)], sp=sp: G.matmul(x, qt, out=y, path="mma", mma_split=sp)
                     for i in range(max(8, len(qts)))]
            res[(m, sp)] = time_calls(calls, reps=8)
    del qts
    torch.cuda.empty_cache()
    return res


def n_copies(nbytes):
    return max(3, math.ceil(3 * L2_BYTES / nbytes))


def bench_fp16(ms, rotate=True):
    rng = torch.Generator(device="cuda").manual_seed(0)
    w = [torch.randn((N, K), device="cuda", dtype=torch.float16, generator=rng) * 0.02
         for _ in range(n_copies(N * K * 2) if rotate else 1)]
    out = {}
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        calls = [lambda wi=w[i % len(w)]: torch.mm(x, wi.t(), out=y) for i in range(max(len(w), 8))]
        out[m] = time_calls(calls)
    del w
    return out


_BASE = {}


def make_weights(fmt, copies):
    if fmt not in _BASE:
        rng = np.random.default_rng(0)
        wf = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        _BASE[fmt] = qz.formats.get(fmt).quantize(wf).to("cuda")
    base = _BASE[fmt]
    qts = [base] + [type(base)(base.format, base.shape, base.data.clone()) for _ in range(copies - 1)]
    return qts


def bench_gguf(fmt, ms, paths, rotate=True):
    nbytes = qz.formats.get(fmt).nbytes((N, K))
    qts = make_weights(fmt, n_copies(nbytes) if rotate else 1)
    res = {}
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        for path in paths:
            if (path == "mmvq" and m > 64) or (path == "mma" and m > 512):
                continue
            if path == "wgmma" and (m > 1024 or not G.wgmma_ok(qts[0])):   # Hopper, K % 256 == 0 only
                continue
            reps = max(len(qts), 12 if m <= 64 else 4)
            calls = [lambda qt=qts[i % len(qts)], p=path: G.matmul(x, qt, out=y, path=p) for i in range(reps)]
            res[(m, path)] = time_calls(calls, reps=10 if m <= 64 else 5)
    dispatch = {m: G.choose_path(m, qts[0]) for m in ms}   # (on the weight: wgmma needs one on a Hopper GPU)
    del qts
    torch.cuda.empty_cache()
    return res, nbytes, dispatch


def bench_dequant_buffer(fmt, ms=(512, 2048), sizes_mb=(8, 16, 32, 128)):
    qts = make_weights(fmt, n_copies(qz.formats.get(fmt).nbytes((N, K))))
    res = {}
    for m in ms:
        x = torch.randn((m, K), device="cuda", dtype=torch.float16)
        y = torch.empty((m, N), device="cuda", dtype=torch.float16)
        for mb in sizes_mb:
            calls = [lambda qt=qts[i % len(qts)], mb=mb: G._dequant_matmul(fmt, x, qt.data, y, N, K, mb << 20)
                     for i in range(len(qts))]
            res[(m, mb)] = time_calls(calls, reps=5)
    del qts
    return res


def sanitize_run():
    """Tail shapes through every path once, for `compute-sanitizer --tool memcheck` (no timing)."""
    rng = np.random.default_rng()
    shapes = [(1, 67, 96), (3, 1, 32), (5, 130, 160), (8, 33, 544), (9, 65, 32), (70, 129, 96), (130, 7, 64),
              (2, 37, 9600),  # several mmvq passes with a tail
              (1, 72, 96), (7, 8, 4160), (40, 200, 4160), (130, 72, 96),  # 16-byte aligned: mmvq16 and mma
              (33, 130, 512), (300, 72, 2816)]  # K % 256 == 0: wgmma (on Hopper)
    for fmt in G.BLOCKS:
        for m, n, k in shapes:
            qt = qz.formats.get(fmt).quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32)).to("cuda")
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).cuda()
            for p in G.PATHS:
                if (p == "mma" and not G._aligned16(qt)) or (p == "wgmma" and not G.wgmma_ok(qt)):
                    continue
                for rows in (G.MMVQ_ROW_CHOICES if p == "mmvq" else (None,)):
                    for kern in (G.MMVQ_KERNELS if p == "mmvq" and G.mmvq16_ok(qt) else (None,)):
                        y = G.matmul(x, qt, path=p, mmvq_rows=rows, mmvq_kernel=kern)
                        assert torch.isfinite(y).all(), (fmt, m, n, k, p, rows, kern)
            G.dequantize(qt)
            G.quantize_q8_1(x.float())
    torch.cuda.synchronize()
    print(f"sanitize run: {len(G.BLOCKS)} formats x {len(shapes)} tail shapes x all paths done")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(G.BLOCKS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="M = 1 and 8 only")
    ap.add_argument("--no-tuning", action="store_true", help="skip the rows-per-CTA and buffer sweeps")
    ap.add_argument("--sanitize", action="store_true", help="tail shapes once, no timing (for compute-sanitizer)")
    ap.add_argument("--mma", action="store_true", help="mma path by forced K splits (M = 16..512)")
    ap.add_argument("--with-mmq", action="store_true", help="also time the DP4A tiled GEMM (slow: 0.3-5 ms per call)")
    ap.add_argument("--mmvq16", action="store_true", help="vector-load mmvq variants x rows per warp vs the scalar mmvq")
    ap.add_argument("--ms", default="1,8", help="activation rows for --mmvq16")
    ap.add_argument("--mmvq", action="store_true", help="copy-bandwidth study + mmvq x rows per CTA (M=1,2,4,8) with the M=1 time split")
    a = ap.parse_args(argv)
    if a.sanitize:
        sanitize_run()
        return 0
    if a.mmvq:
        return mmvq_main(a)
    if a.mmvq16:
        return mmvq16_main(a)
    if a.mma:
        for fmt in a.formats.split(","):
            res = bench_mma_splits(fmt)
            print(f"mma {fmt} us by K splits (auto = mma_plan): " + "; ".join(
                f"M={m} " + ",".join(f"{'auto' if sp is None else sp}:{v:.1f}" for (mm, sp), v in res.items() if mm == m)
                for m in dict.fromkeys(mm for mm, _ in res)), flush=True)
        return 0
    fmts = a.formats.split(",")
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"# {dev}; copy bandwidth {bw / 1e12:.3f} TB/s (read+write; DESIGN.md's figure: 2.99); "
          f"shape N={N} K={K}", flush=True)

    sweep = [1, 8] if a.quick else [1, 8, 16, 32, 64, 128, 256, 512, 2048]
    if not (a.quick or a.no_tuning):
        for fmt in fmts:
            rr = {(m, r): v for (m, _, r, _), v in bench_mmvq_split(fmt, detail=False).items()}
            print(f"mmvq rows-per-CTA sweep {fmt} (us, rotated): " +
                  ", ".join(f"M={m} R={r}: {v:.1f}" for (m, r), v in rr.items()), flush=True)
        db = bench_dequant_buffer("q4_0")
        print("dequant buffer sweep q4_0 (us): " + ", ".join(f"M={m} {mb}MB: {v:.1f}" for (m, mb), v in db.items()),
              flush=True)
    cub = bench_fp16(sweep)
    cub_reused = bench_fp16([1, 8], rotate=False)
    print("cuBLAS fp16 (rotated) us:", {m: round(v, 1) for m, v in cub.items()},
          "reused:", {m: round(v, 1) for m, v in cub_reused.items()}, flush=True)

    rows, raw = [], {"device": dev, "copy_Bps": bw, "cublas_fp16_us": cub, "cublas_fp16_reused_us": cub_reused}
    for fmt in fmts:
        paths = ["mmvq", "mma", "dequant", "wgmma"] + (["mmq"] if a.with_mmq else [])
        rot, nbytes, dispatch = bench_gguf(fmt, sweep, paths)
        reu, _, _ = bench_gguf(fmt, [1, 8], ["mmvq"], rotate=False)
        raw[fmt] = {"bytes": nbytes, "rotated": {f"{m}/{p}": v for (m, p), v in rot.items()},
                    "reused": {f"{m}/{p}": v for (m, p), v in reu.items()}}
        for m in sweep:
            cands = {p: v for (mm, p), v in rot.items() if mm == m}
            best = min(cands, key=cands.get)
            for p, us in sorted(cands.items(), key=lambda kv: kv[1]):
                flops = 2.0 * m * N * K
                rows.append(dict(fmt=fmt, M=m, weights="rotated", path=p + (" *" if p == best else ""),
                                 us=us, TBps=nbytes / (us * 1e-6) / 1e12, pct_copy=100 * nbytes / (us * 1e-6) / bw,
                                 TFLOPs=flops / (us * 1e-6) / 1e12, x_cublas=cub[m] / us,
                                 dispatch=dispatch[m], llama=LLAMA_CPP.get((fmt, m), "")))
        for (m, p), us in reu.items():
            rows.append(dict(fmt=fmt, M=m, weights="reused", path=p, us=us, TBps=nbytes / (us * 1e-6) / 1e12,
                             pct_copy=100 * nbytes / (us * 1e-6) / bw, TFLOPs=2.0 * m * N * K / (us * 1e-6) / 1e12,
                             x_cublas=cub_reused[m] / us, dispatch=dispatch[m],
                             llama=LLAMA_CPP.get((fmt, m), "")))
        print(f"{fmt} done ({time.time() - t0:.0f} s)", flush=True)

    hdr = "| fmt | M | weights | path (* fastest) | us | TB/s blocks | % copy BW | TFLOP/s | x cuBLAS fp16 | dispatch | llama.cpp us |"
    lines = [hdr, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['fmt']} | {r['M']} | {r['weights']} | {r['path']} | {r['us']:.1f} | {r['TBps']:.2f} | "
                     f"{r['pct_copy']:.0f} | {r['TFLOPs']:.1f} | {r['x_cublas']:.2f} | {r['dispatch']} | {r['llama']} |")
    table = "\n".join(lines)
    write_results(a.out, "gguf_bench", f"{dev}; copy {bw / 1e12:.3f} TB/s; cuBLAS fp16 rotated us {cub}; "
                  f"reused {cub_reused}\n\n{table}", raw)
    print(table)
    return 0


def mmvq_main(a):

    dev = torch.cuda.get_device_name()
    out = {"device": dev}
    cs = copy_study()
    out["copy_study_TBps"] = cs
    print(f"# {dev}; copy study (TB/s; memcpy/mul1 count read+write, sum-read counts reads):", flush=True)
    for kk, v in cs.items():
        print(f"  {kk}: {v:.3f}", flush=True)
    tb = T.copy_bandwidth()
    out["timing_py_copy"] = tb
    bw = tb["copy_tbps"] * 1e12
    print(f"copy bandwidth (quantzoo.bench.timing.copy_bandwidth, used for the % column): "
          f"{tb['copy_tbps']:.3f} TB/s", flush=True)
    lines = ["| fmt | M | what | R | weights | us | TB/s blocks | % of copy |", "|---|---|---|---|---|---|---|---|"]
    for fmt in a.formats.split(","):
        nbytes = qz.formats.get(fmt).nbytes((N, K))
        res = bench_mmvq_split(fmt)
        out[fmt] = {"/".join(map(str, kk)): v for kk, v in res.items()}
        for (m, kern, r, wts), us in res.items():
            tbps = nbytes / (us * 1e-6) / 1e12
            lines.append(f"| {fmt} | {m} | {kern} | {r} | {wts} | {us:.2f} | {tbps:.2f} | {100 * tbps * 1e12 / bw:.0f} |")
            print(lines[-1], flush=True)
    write_results(a.out, "gguf_mmvq_bench", "\n".join(lines), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
