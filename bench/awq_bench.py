"""AWQ W4A16 kernels vs cuBLAS fp16 and copy bandwidth on Qwen3-8B shapes (run on the GPU).

    python bench/awq_bench.py [--ms 1,2,4,...] [--shapes 4096x12288,...] [--out log.json]

Method (DESIGN.md §6, helpers in quantzoo/bench/timing.py): each measured call is captured R times in a CUDA graph, the R calls
rotating over enough weight copies (>= 150 MB together) that the 50 MB L2 cannot serve them;
the graph is replayed many times, timed with CUDA events, and the median replay / R is the
time per call. Weights are random bit patterns made on the GPU (the kernels' speed does not
depend on the values). Copy bandwidth (read + write) and cuBLAS fp16 (F.linear on an fp16
[N, K] weight, also rotated) are measured in the same run.
Columns: t = µs per call of the path dispatch picks; TB/s and %copy count qweight + qzeros +
scales bytes (what a decode step must stream); x cuBLAS = cuBLAS time / AWQ time.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from quantzoo.bench import timing
from quantzoo.kernels import awq

SHAPES = ((4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096))   # (K, N) Qwen3-8B
MS = (1, 2, 3, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ROT_BYTES = 150e6
G = 128


def time_graph(fn_list, reps=20, replays=15):
    """Median µs per call of fn_list[i % len] captured max(reps, len(fn_list)) times in one graph:
    every copy once at least, or the calls would cycle over the first `reps` copies only (at
    4096->1024, 20 of 69 AWQ copies: 42 MiB, inside the 50 MB L2)."""
    reps = max(reps, len(fn_list))
    g = timing.capture_graph(lambda i: fn_list[i % len(fn_list)](), reps)
    return statistics.median(timing.time_graph(g, inner=reps, reps=replays, warmup=3)) * 1e6


def copy_bandwidth():
    # timed eagerly (timing.copy_bandwidth): a graph-captured 1 GiB copy under-reads (2.43 TB/s)
    return timing.copy_bandwidth()["copy_tbps"]


def make_weights(k, n, copies):
    out = []
    for _ in range(copies):
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device="cuda")
        sc = (torch.rand(k // G, n, device="cuda") * 0.004 + 0.001).half()
        out.append((qw, sc, qz))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--paths", default="all", choices=("all", "dispatch"),
                    help="'all' (every path) or 'dispatch' (only the path dispatch picks)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--slabs", action="store_true", help="also time dequant+cublas in L2-sized slabs")
    ap.add_argument("--small-sweep", action="store_true",
                    help="M <= 16: time every small-kernel config (SMALL_CFGS) and split counts")
    ap.add_argument("--no-mma-sweep", action="store_true", help="skip the mma tile-config sweep")
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    tiny = torch.zeros(8, device="cuda")
    floor = time_graph([lambda: tiny.add_(1.0)], reps=20)
    print(f"# {dev}; copy bandwidth (read+write) {bw:.3f} TB/s; an empty graph node {floor:.2f} us",
          flush=True)
    rows, raw = [], []
    for k, n in shapes:
        qbytes = k * n // 2 + (k // G) * (n // 8) * 4 + (k // G) * n * 2
        copies = max(2, math.ceil(ROT_BYTES / qbytes))
        ws = make_weights(k, n, copies)
        fcopies = max(2, math.ceil(ROT_BYTES / (2 * k * n)))
        fw = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(fcopies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            t_cublas = time_graph([lambda w=w: torch.nn.functional.linear(x, w, out=None) for w in fw])
            m1 = ["gemv", "strip"] + (["strip-cluster"] if awq.clusters_available(x.device) else [])
            paths = ((m1 if m == 1 else []) + (["small"] if m <= awq.SMALL_MAX_M else [])
                     + ["mma"] + (["dequant+cublas"] if m >= 16 else [])
                     + (["wgmma"] if m >= awq.WGMMA_MIN_M and awq.wgmma_available(x.device) else []))
            if a.paths == "dispatch":
                paths = [awq.choose_path(m, awq._Shape(n, k), x.device)]
            times = {}
            for p in paths:
                fns = [lambda w=w, p=p: awq.gemm(x, *w, G, out=y, path=p) for w in ws]
                try:
                    times[p] = time_graph(fns)
                except Exception as e:  # report and go on
                    print(f"  {k}->{n} M={m} {p}: {type(e).__name__}: {e}", file=sys.stderr)
            if a.slabs and m >= 128:  # dequant slabs small enough to stay in L2 for cuBLAS
                for mb in (8, 16, 32):
                    fns = [lambda w=w, mb=mb: awq._dequant_cublas(x, w[0], w[1], w[2], y, m, k, n, G,
                                                                  slab_bytes=mb * 2**20) for w in ws]
                    times[f"slab{mb}MB"] = time_graph(fns)
            if a.small_sweep and m <= awq.SMALL_MAX_M:
                for cfg in awq.SMALL_CFGS:
                    if m > 8 * cfg[0]:
                        continue
                    tiles = -(-(n // 8) // (8 * cfg[1] * cfg[3]))
                    s_plan = awq.small_plan(tiles, k, cfg[2] // cfg[3], torch.cuda.get_device_properties(0)
                                            .multi_processor_count)[0]
                    for sp in sorted({s_plan, max(1, s_plan // 2), 2 * s_plan, 4 * s_plan}):
                        fns = [lambda w=w, c=cfg, sp=sp: awq._small(x, w[0], w[1], w[2], y, m, k, n, G,
                                                                    cfg=c, splits=sp) for w in ws]
                        try:
                            times["small" + "".join(map(str, cfg)) + f"S{sp}"] = time_graph(fns)
                        except Exception as e:  # report and go on
                            print(f"  {k}->{n} M={m} small {cfg} S={sp}: {type(e).__name__}: {e}",
                                  file=sys.stderr)
            if m <= 256 and not a.no_mma_sweep:   # which mma tile shape is best
                cfgs = (((1, 1, 1), (1, 2, 1), (1, 2, 4)) if m <= 16 else
                        ((2, 1, 1), (2, 2, 1), (4, 1, 1)) if m <= 128 else ((4, 1, 1),))
                for cfg in cfgs:
                    fns = [lambda w=w, c=cfg: awq._mma(x, w[0], w[1], w[2], y, m, k, n, G, cfg=c) for w in ws]
                    times["mma{}x{}o{}".format(*cfg)] = time_graph(fns)
            chosen = awq.choose_path(m, awq._Shape(n, k), x.device)
            best = min((t, p) for p, t in times.items())
            t = times.get(chosen, float("nan"))
            tbs = qbytes / (t * 1e-6) / 1e12
            rec = {"k": k, "n": n, "m": m, "cublas_us": t_cublas, "paths_us": times, "chosen": chosen,
                   "best": best[1], "tbs": tbs, "pct_copy": 100 * tbs / bw, "x_cublas": t_cublas / t}
            raw.append(rec)
            extra = " ".join(f"{p}={v:.1f}" for p, v in times.items())
            print(f"{k:>5}->{n:<5} M={m:<5} {chosen:>14} {t:9.1f}us {tbs:6.3f}TB/s {rec['pct_copy']:5.1f}% "
                  f"x{rec['x_cublas']:.2f} cublas={t_cublas:.1f} | {extra}", flush=True)
            rows.append((f"{k}->{n}", m, chosen, f"{t:.1f}", f"{tbs:.2f}", f"{rec['pct_copy']:.0f}",
                         f"{rec['x_cublas']:.2f}", f"{t_cublas:.1f}", best[1]))
        del ws, fw
        torch.cuda.empty_cache()
    hdr = ("shape", "M", "path", "t µs", "TB/s", "%copy", "x cuBLAS", "cuBLAS µs", "best path")
    try:
        from tabulate import tabulate

        print(tabulate(rows, headers=hdr))
    except ImportError:
        print("\t".join(hdr))
        for r in rows:
            print("\t".join(map(str, r)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": dev, "copy_tbs": bw, "node_floor_us": floor, "rows": raw}, f, indent=1)


if __name__ == "__main__":
    main()
