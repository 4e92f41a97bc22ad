"""Decode-sized (M = 1) matmuls back to back: what programmatic dependent launch (PDL, cuda/pdl.cuh)
changes. Run on the GPU:

    python bench/overlap_bench.py [--formats fp16,q4_0,q8_0,awq] [--shapes 4096x4096,...] [--json F]

Each case is one weight shape (K -> N, Qwen3-8B's, plus llama.cpp's 14336 -> 4096) in one format,
called at M = 1 through the path the runner uses (fp16: kernels.fp16.linear, the streaming GEMV;
others: ops.matmul, i.e. the format's dispatch, activation quantization included for GGUF).
Timing as the other benches (quantzoo/bench/timing.py): a CUDA graph of back-to-back calls
rotating over weight copies that together exceed 4x the L2, event-timed replays, median per
call. Settings per case (SETTINGS): plain launches or PDL. (Session 3 also swept an L2 prefetch of
each block's weight slice before the wait; it lost and was removed, bench/NOTES.md.) cuBLAS
(F.linear on an fp16 weight of the same shape, rotated) and the copy bandwidth are measured in the same run;
"% copy" = weight bytes / time / copy bandwidth.
"""
from __future__ import annotations

import argparse
import json

import torch

from quantzoo import cuda_launch, ops
from quantzoo.bench import timing
from quantzoo.bench.model import random_weight
from quantzoo.kernels import fp16 as fp16_kernels

SHAPES = ((4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (14336, 4096))  # (K, N)
FORMATS = ("fp16", "q4_0", "q8_0", "awq")
# (name, PDL)
SETTINGS = (("plain", False), ("pdl", True))


def case(fmt: str, k: int, n: int, bw: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    first = random_weight(fmt, n, k, "cuda", gen)
    nbytes = first.nbytes
    copies = timing.rotation_copies(nbytes)
    ws = [first] + [random_weight(fmt, n, k, "cuda", gen) for _ in range(copies - 1)]
    x = torch.randn(1, k, device="cuda", generator=gen).half()
    if fmt == "fp16":
        ws = [w.data for w in ws]
        call = lambda i: fp16_kernels.linear(x, ws[i])   # noqa: E731
    else:
        call = lambda i: ops.matmul(x, ws[i])            # noqa: E731
    rec = {"format": fmt, "K": k, "N": n, "weight_bytes": nbytes, "copies": copies}
    for name, pdl in SETTINGS:
        with cuda_launch.programmatic_launches(pdl):
            r = timing.benchmark(call, copies=copies)
        rec[name] = {"us": r["median_us"], "p10_us": r["p10_us"], "p90_us": r["p90_us"], "timing": r["timing"],
                     "copy_fraction": nbytes / (r["median_us"] * 1e-6) / bw}
    del ws
    torch.cuda.empty_cache()
    return rec


def cublas_case(k: int, n: int, bw: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = timing.rotation_copies(2 * n * k)
    ws = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).half() for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", generator=gen).half()
    r = timing.benchmark(lambda i: torch.nn.functional.linear(x, ws[i]), copies=copies)
    del ws
    torch.cuda.empty_cache()
    return {"us": r["median_us"], "copy_fraction": 2 * n * k / (r["median_us"] * 1e-6) / bw}


def main(argv=None) -> int:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,...")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    cb = timing.copy_bandwidth()
    bw = cb["copy_tbps"] * 1e12
    recs, rows = [], []
    for k, n in shapes:
        cub = cublas_case(k, n, bw)
        for fmt in a.formats.split(","):
            r = case(fmt, k, n, bw)
            r["cublas_fp16"] = cub
            recs.append(r)
            rows.append([fmt, f"{k}->{n}", f"{r['weight_bytes'] / 1e6:.1f}"]
                        + [f"{r[s]['us']:.1f} ({100 * r[s]['copy_fraction']:.0f}%)" for s, _ in SETTINGS]
                        + [f"{cub['us']:.1f}"])
            print(rows[-1], flush=True)
    print(tabulate(rows, headers=["format", "K->N", "MB"] + [f"{s}: us (% copy)" for s, _ in SETTINGS]
                   + ["cuBLAS fp16 us"], tablefmt="github", disable_numparse=True))
    print(f"copy bandwidth {cb['copy_tbps']:.2f} TB/s; M = 1, rotated weights, graph of back-to-back calls")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy": cb, "machine": timing.machine_info(), "cases": recs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
