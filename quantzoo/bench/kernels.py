"""`quantzoo bench kernels`: every weight format's matmul against cuBLAS fp16 and the GPU's limits.

For each format in the registry with kind "weight" (plus the fp16 baseline, cuBLAS through
torch) x each Qwen3-8B linear shape K->N (in -> out features) x each M (rows of activations):

    y = quantzoo.ops.matmul(x, qt)       x: (M, K) fp16 on CUDA, qt: (N, K) weight on CUDA

timed as in quantzoo.bench.timing (CUDA graph of back-to-back launches over rotated weight
copies, median of the replays, warm-up excluded). Per row:

    median_us           median time of one launch
    tflops              2*M*N*K / time
    weight_tbps         bytes of the stored weight (scales, zeros, mins counted) / time
    pct_copy_bw         (weight + x + y bytes) / time as % of the copy bandwidth measured here
    pct_cublas_tflops   tflops as % of cuBLAS fp16 on a large square product measured here
    pct_roofline        the time the two ceilings allow, max(bytes / copy_bw, flops / cuBLAS),
                        as % of the measured time (100 % = at the roofline)
    x_cublas            cuBLAS fp16's time on the same shape and M / this time (>1 = faster)
    path                what the format's dispatch chose (kernels.<mod>.choose_path(m, qt))
    nmse                ||y - x @ W.T||^2 / ||x @ W.T||^2 against the unquantized fp32 W: a
                        sanity check that the kernel timed is computing the right thing
                        (null, with nmse_error, where the kernel wrote NaN or inf)

and on the largest shape at M in POWER_M, the same launches replayed for --power-s seconds while
nvidia-smi samples (quantzoo.bench.power): sustained_us, sm_clock_mhz, power_w, power_capped
(share of samples at the driver's power cap), power_limit_w, mj_per_call (mean power x
sustained_us: the energy of one launch); power_error where the probe failed.

Weights are seeded Gaussian (sigma 0.02, never zeros, which can run faster than real data).
A format whose kernel module is missing or fails is recorded with status "missing"/"error"
and the bench goes on. Output: JSON (machine info, ceilings, settings, rows) and CSV (rows).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
import time

# (K, N, which Qwen3-8B linears have this shape, how many per decoder layer)
QWEN3_8B_SHAPES = [
    (4096, 4096, "q_proj, o_proj", 2),
    (4096, 1024, "k_proj, v_proj", 2),
    (4096, 12288, "gate_proj, up_proj", 2),
    (12288, 4096, "down_proj", 1),
]
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
QUICK_M = [1, 16, 512]
BASELINE = "fp16"
SIGMA = 0.02
POWER_M = (1, 512)   # decode, and the issues' large-M target
POWER_S = 1.5

CSV_FIELDS = ["format", "k", "n", "m", "status", "path", "median_us", "p10_us", "p90_us",
              "median_us_pdl", "read_us", "read_us_pdl", "sustained_us", "sm_clock_mhz", "power_w",
              "power_capped", "power_limit_w", "mj_per_call", "power_error",
              "tflops", "weight_bytes", "weight_tbps", "pct_copy_bw", "pct_cublas_tflops",
              "pct_roofline", "roofline_us", "x_cublas", "nmse", "nmse_error", "timing", "copies", "inner",
              "reps", "error"]


def shape_key(k: int, n: int) -> str:
    return f"{k}->{n}"


def parse_shape(s: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in s.replace("x", ",").split(","))
    except ValueError:
        raise ValueError(f"--shape {s!r}: expected K,N (in_features,out_features), e.g. 4096,11008") from None
    if k <= 0 or n <= 0:
        raise ValueError(f"--shape {s!r}: K and N must be positive")
    return k, n


def parse_m(s: str) -> list[int]:
    try:
        ms = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--m {s!r}: expected comma-separated positive integers, e.g. 1,16,512") from None
    if not ms or min(ms) <= 0:
        raise ValueError(f"--m {s!r}: expected comma-separated positive integers")
    return ms


def bench_formats(only: list[str] | None = None) -> list[str]:
    """Registry weight formats (kind == "weight") and the fp16 baseline, or the chosen subset."""
    from quantzoo import formats

    names = [f.name for f in formats.weight_formats()] + [BASELINE]
    if only:
        for o in only:
            formats.get_stored(o, "--formats")  # (an unknown name: a KeyError listing the known ones)
        names = [n for n in names if n in only]
    return names


def gaussian_weight(k: int, n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng([seed, k, n])
    return (rng.standard_normal((n, k), dtype=np.float32) * SIGMA).astype(np.float32)


def _quantize_job(args):
    name, k, n, seed = args
    from quantzoo import formats

    t0 = time.time()
    try:
        qt = formats.get(name).quantize(gaussian_weight(k, n, seed))
        return name, k, n, qt, None, time.time() - t0
    except Exception as e:  # noqa: BLE001 - a format that cannot store this shape is reported
        return name, k, n, None, f"{type(e).__name__}: {e}", time.time() - t0


def quantize_all(names, shapes, seed: int, workers: int | None = None) -> dict:
    """{(name, k, n): (qt or None, error or None)}; in parallel processes (numpy codecs are
    single-threaded and a full bench quantizes ~0.8 G weights)."""
    jobs = [(name, k, n, seed) for (k, n) in shapes for name in names]
    workers = workers if workers is not None else min(len(jobs), os.cpu_count() or 1, 16)
    results = []
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        import torch

        # fork is cheap, but not after CUDA has been initialised in this process
        ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
        # the biggest jobs first so the pool finishes together
        jobs.sort(key=lambda j: -j[1] * j[2])
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
            results = list(ex.map(_quantize_job, jobs))
    else:
        results = [_quantize_job(j) for j in jobs]
    return {(name, k, n): (qt, err) for name, k, n, qt, err, _ in results}


def clone_qt(qt):
    """A second copy of a CUDA QuantizedTensor's storage (same layout, new memory)."""
    data = {k: v.clone() for k, v in qt.data.items()} if isinstance(qt.data, dict) else qt.data.clone()
    return dataclasses.replace(qt, data=data)


def kernel_module(name: str):
    """(module, None) or (None, why it is missing)."""
    from quantzoo import formats, ops

    try:
        return ops.kernels_for(formats.get(name)), None
    except (ImportError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}"


def choose_path(mod, m: int, qt) -> str | None:
    if mod is None:
        return None
    f = getattr(mod, "choose_path", None)
    if f is None:
        return "cublas" if qt.format == BASELINE else None
    try:
        return str(f(m, qt))
    except Exception as e:  # noqa: BLE001
        return f"? ({type(e).__name__})"


def metrics(rec: dict, ceil: dict) -> dict:
    """Derived columns of a timed row (pure arithmetic; tested on CPU)."""
    m, k, n = rec["m"], rec["k"], rec["n"]
    t = rec["median_us"] * 1e-6
    flops = 2.0 * m * n * k
    min_bytes = rec["weight_bytes"] + 2 * m * k + 2 * m * n  # fp16 x in, fp16 y out
    copy_bps = ceil["copy_tbps"] * 1e12
    peak = ceil["cublas_fp16_tflops"] * 1e12
    roof = max(min_bytes / copy_bps, flops / peak)
    return {"tflops": flops / t / 1e12, "weight_tbps": rec["weight_bytes"] / t / 1e12,
            "pct_copy_bw": 100.0 * min_bytes / t / copy_bps,
            "pct_cublas_tflops": 100.0 * flops / t / peak,
            "roofline_us": roof * 1e6, "pct_roofline": 100.0 * roof / t}


def nmse_fields(y, y_ref) -> dict:
    """{"nmse": ||y - y_ref||^2 / ||y_ref||^2} or, where that is not a finite number (the kernel
    wrote NaN/inf: what the check is there to catch), {"nmse": None, "nmse_error": why}: a NaN
    in the row would make the JSON writer (allow_nan=False) throw the whole run away."""
    import torch

    v = float(((y.float() - y_ref) ** 2).sum() / (y_ref ** 2).sum())
    if math.isfinite(v):
        return {"nmse": v}
    bad = int((~torch.isfinite(y.float())).sum())
    return {"nmse": None, "nmse_error": f"NMSE is {v} ({bad} non-finite outputs)"}


def finite_or_none(o):
    """o with every float that is NaN or infinite replaced by None (JSON has no such numbers)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite_or_none(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite_or_none(v) for v in o]
    return o


def add_x_cublas(rows: list[dict]) -> None:
    base = {(r["k"], r["n"], r["m"]): r["median_us"] for r in rows
            if r["format"] == BASELINE and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["k"], r["n"], r["m"]))
        r["x_cublas"] = (b / r["median_us"]) if (b and r["status"] == "ok") else None


def run_bench(*, shapes, ms, names, seed: int = 0, target_s: float = 0.03, use_graph: bool = True,
              workers: int | None = None, power_s: float = POWER_S, log=print) -> dict:
    import torch

    from quantzoo import ops
    from quantzoo.cuda_launch import programmatic_launches

    from . import power, timing

    if not torch.cuda.is_available():
        raise ValueError("quantzoo bench kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    t_start = time.time()
    log(f"quantizing {len(names)} formats x {len(shapes)} shapes (seeded Gaussian, sigma {SIGMA}) ...")
    qts = quantize_all(names, shapes, seed, workers)
    log(f"  done in {time.time() - t_start:.1f} s")

    machine = timing.machine_info()
    log(f"measuring ceilings on {machine.get('gpu')} ...")
    ceil = timing.ceilings()
    log(f"  copy {ceil['copy_tbps']:.3f} TB/s (read+write), cuBLAS fp16 {ceil['cublas_size']}^3 "
        f"{ceil['cublas_fp16_tflops']:.1f} TFLOP/s")
    l2 = timing.l2_cache_bytes()
    mods = {name: kernel_module(name) for name in names}
    power_shape = max(shapes, key=lambda s: s[0] * s[1])   # the first of the largest
    probe = power_s > 0 and use_graph and any(m in POWER_M for m in ms)
    rows = []
    reads: dict = {}   # weight bytes -> one_launch_read's fields (every format of a size shares them)
    gen = torch.Generator(device="cuda")
    for (k, n) in shapes:
        w_ref = torch.from_numpy(gaussian_weight(k, n, seed)).cuda()
        xs = {}
        for m in ms:
            gen.manual_seed((seed * 1000003 + m) % 2**64)   # (torch takes seeds below 2^64)
            xs[m] = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        for name in names:
            mod, missing = mods[name]
            qt_cpu, qerr = qts[(name, k, n)]
            base = {"format": name, "k": k, "n": n}
            if missing or qerr:
                for m in ms:
                    rows.append(dict(base, m=m, status="missing" if missing else "error",
                                     error=missing or f"quantize: {qerr}"))
                log(f"  {name:6s} {shape_key(k, n):>11s}: {'missing' if missing else 'error'} "
                    f"({missing or qerr})")
                continue
            copies = []
            try:
                first = qt_cpu.to("cuda")
                ncopy = timing.rotation_copies(first.nbytes, l2_bytes=l2)
                copies = [first] + [clone_qt(first) for _ in range(ncopy - 1)]
            except Exception as e:  # noqa: BLE001
                for m in ms:
                    rows.append(dict(base, m=m, status="error", error=f"to(cuda): {type(e).__name__}: {e}"))
                continue
            line = []
            for m in ms:
                x = xs[m]
                rec = dict(base, m=m, weight_bytes=first.nbytes, path=choose_path(mod, m, first))
                try:
                    y = ops.matmul(x, first)
                    torch.cuda.synchronize()
                    y_ref = x.float() @ w_ref.T
                    rec.update(nmse_fields(y, y_ref))
                    del y, y_ref
                    def timed():
                        return timing.benchmark(lambda i: ops.matmul(x, copies[i]), copies=len(copies),
                                                target_s=target_s, use_graph=use_graph)
                    rec.update(timed())
                    if m == 1 and use_graph:   # also as the decode graph launches: under PDL
                        with programmatic_launches(True):
                            pdl = timed()
                        if pdl["timing"] == "graph":
                            rec["median_us_pdl"] = pdl["median_us"]
                        try:   # the floor is a nicety: a failure here must not cost the kernel's row
                            rec.update(one_launch_read(first.nbytes, reads, target_s))
                        except Exception as e:  # noqa: BLE001
                            torch.cuda.synchronize()
                            rec["read_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if probe and (k, n) == power_shape and m in POWER_M:
                        try:   # as the read: a failure costs only these fields
                            rec.update(power.of_launches(lambda i: ops.matmul(x, copies[i % len(copies)]),
                                                         rec["inner"], power_s))
                        except Exception as e:  # noqa: BLE001
                            torch.cuda.synchronize()
                            rec["power_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            log(f"  {name} {shape_key(k, n)} M={m}: power probe failed ({rec['power_error']})")
                    rec["status"] = "ok"
                    rec.update(metrics(rec, ceil))
                    line.append(f"M={m}:{rec['median_us']:.1f}us")
                except Exception as e:  # noqa: BLE001 - record and go on
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
                    rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                    line.append(f"M={m}:error")
                rows.append(rec)
            log(f"  {name:6s} {shape_key(k, n):>11s} x{len(copies):<3d} " + " ".join(line))
            copies = first = None   # free the rotated weights before the next format
            torch.cuda.empty_cache()
        del w_ref, xs
        torch.cuda.empty_cache()
    add_x_cublas(rows)
    ceil_end = timing.ceilings(reps=10)
    return {
        "kind": "quantzoo-bench-kernels", "version": 1,
        "machine": machine,
        "ceilings": ceil, "ceilings_end": ceil_end,
        "settings": {"shapes": [list(s) for s in shapes], "m": list(ms), "formats": list(names),
                     "seed": seed, "sigma": SIGMA, "target_s": target_s, "graph": use_graph,
                     "l2_bytes": l2, "rotation": "copies x weight bytes >= 4 x L2 (at most 4096 copies)",
                     "power": {"shape": list(power_shape), "m": [m for m in POWER_M if m in ms], "seconds": power_s,
                               "interval_ms": power.INTERVAL_MS} if probe else None,
                     "qwen3_8b_layer": [[k, n, what, c] for k, n, what, c in QWEN3_8B_SHAPES],
                     "wall_s": round(time.time() - t_start, 1)},
        "results": rows,
    }


def one_launch_read(nbytes: int, cache: dict, target_s: float) -> dict:
    """read_us / read_us_pdl: the fastest one-launch read of nbytes found (kernels.stream, plain
    and under PDL), a measured floor for M = 1 kernels on a weight of that size; once per size."""
    if nbytes not in cache:
        from quantzoo.kernels import stream

        plain = stream.best_read_us(nbytes, target_s=target_s)
        pdl = stream.best_read_us(nbytes, pdl=True, target_s=target_s)
        cache[nbytes] = {"read_us": plain["us"], "read_us_pdl": pdl["us"],
                         "read_config": plain["config"], "read_config_pdl": pdl["config"]}
    return cache[nbytes]


OUT_STEM = "bench-kernels"   # write_outputs' file names: OUT_STEM.json and OUT_STEM.csv


def write_outputs(res: dict, out_dir: str, stem: str = OUT_STEM) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, f"{stem}.json")
    cpath = os.path.join(out_dir, f"{stem}.csv")
    text = json.dumps(finite_or_none(res), indent=1, allow_nan=False, default=_json_default)
    with open(jpath, "w") as f:   # serialised first: an unstorable value leaves no half-written file
        f.write(text)
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in res["results"]:
            w.writerow({k: _fmt_csv(r.get(k)) for k in CSV_FIELDS})
    return jpath, cpath


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot store {type(o).__name__} in JSON")


def _fmt_csv(v):
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else ""
    return "" if v is None else v


def summary_table(res: dict, tablefmt: str = "github") -> str:
    from tabulate import tabulate

    rows = []
    for r in res["results"]:
        if r["status"] != "ok":
            rows.append([r["format"], shape_key(r["k"], r["n"]), r["m"], r["status"], "", "", "", "",
                         "", "", (r.get("error") or "")[:60]])
            continue
        rows.append([r["format"], shape_key(r["k"], r["n"]), r["m"], r.get("path") or "",
                     f"{r['median_us']:.2f}", f"{r['tflops']:.1f}", f"{r['weight_tbps']:.2f}",
                     f"{r['pct_copy_bw']:.0f}", f"{r['pct_cublas_tflops']:.1f}",
                     "" if r.get("x_cublas") is None else f"{r['x_cublas']:.2f}",
                     f"{r['nmse']:.2e}" if r.get("nmse") is not None else
                     "NON-FINITE" if r.get("nmse_error") else ""])
    return tabulate(rows, headers=["format", "K->N", "M", "path", "median us", "TFLOP/s",
                                   "weight TB/s", "% copy BW", "% cuBLAS", "x cuBLAS", "NMSE"],
                    tablefmt=tablefmt, disable_numparse=True)


def add_arguments(p) -> None:
    p.add_argument("--shape", action="append", default=[], metavar="K,N",
                   help="extra linear shape in_features,out_features (repeatable)")
    p.add_argument("--only-shapes", action="store_true",
                   help="bench only the --shape shapes, not the Qwen3-8B ones")
    p.add_argument("--m", default=None, metavar="M1,M2,...",
                   help=f"activation rows to bench (default {','.join(map(str, M_VALUES))})")
    p.add_argument("--quick", action="store_true",
                   help=f"M in {QUICK_M} and a shorter timing target (a few dozen rows)")
    p.add_argument("--formats", default=None, metavar="A,B",
                   help="subset of weight formats (default: every registry weight format + fp16)")
    p.add_argument("--out", default=".", metavar="DIR",
                   help="where bench-kernels.json and bench-kernels.csv go (default: .)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="GPU time spent timing each row, ms (default 30, 10 with --quick)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches, not graph replays")
    p.add_argument("--power-s", type=float, default=POWER_S, metavar="S",
                   help=f"seconds each format runs on the largest shape at M in {POWER_M} while nvidia-smi "
                        f"samples clock and power (default {POWER_S}; 0: skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and activations (default 0)")
    p.add_argument("--workers", type=int, default=None, help="processes for quantizing (default: cores)")


def run(args) -> int:
    shapes = [] if args.only_shapes else [(k, n) for k, n, _, _ in QWEN3_8B_SHAPES]
    for s in args.shape:
        ks = parse_shape(s)
        if ks not in shapes:
            shapes.append(ks)
    if not shapes:
        raise ValueError("--only-shapes given without any --shape K,N")
    ms = parse_m(args.m) if args.m is not None else QUICK_M if args.quick else M_VALUES
    only = None
    if args.formats is not None:   # (as report's --accuracy-formats and bench model's --formats read theirs)
        only = [s.strip() for s in args.formats.split(",") if s.strip()]
        if not only:   # (it meant every format)
            raise ValueError(f"--formats {args.formats!r}: no format named")
    names = bench_formats(only)
    if args.target_ms is not None and not args.target_ms > 0:
        raise ValueError(f"--target-ms: milliseconds must be > 0, got {args.target_ms}")
    if not 0 <= args.seed < 2**63:   # (numpy's generator takes no negative seed: every row failed)
        raise ValueError(f"--seed {args.seed}: an integer in [0, 2^63)")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: at least 1, got {args.workers}")
    target = (args.target_ms or (10.0 if args.quick else 30.0)) * 1e-3
    if not 0 <= args.power_s < math.inf:   # (inf: the probe ran for ever)
        raise ValueError(f"--power-s: seconds must be >= 0 and finite, got {args.power_s}")
    from quantzoo.paths import check_out_dir

    check_out_dir(args.out, f"--out {args.out}", files=(f"{OUT_STEM}.json", f"{OUT_STEM}.csv"))

    def log(s):
        print(s, flush=True)

    res = run_bench(shapes=shapes, ms=ms, names=names, seed=args.seed, target_s=target,
                    use_graph=not args.no_graph, workers=args.workers, power_s=args.power_s, log=log)
    res["settings"]["quick"] = bool(args.quick)
    jpath, cpath = write_outputs(res, args.out)
    print(summary_table(res))
    c = res["ceilings"]
    print(f"\nceilings: copy {c['copy_tbps']:.3f} TB/s, cuBLAS fp16 {c['cublas_fp16_tflops']:.1f} TFLOP/s; "
          f"wrote {jpath} and {cpath}", file=sys.stderr)
    bad = [r for r in res["results"] if r["status"] == "error"]
    if bad:
        print(f"{len(bad)} rows failed (status 'error' in the JSON)", file=sys.stderr)
    return 0
