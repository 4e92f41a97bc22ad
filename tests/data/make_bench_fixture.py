"""Writes tests/data/bench_kernels_fixture.json: a FIXTURE shaped like `quantzoo bench kernels`
output, with synthetic times (a simple roofline model with made-up efficiencies), NOT a
measurement. The report tests read it so they run without a GPU.

    python tests/data/make_bench_fixture.py
"""
import json
import os

from quantzoo.bench import kernels

CEIL = {"copy_tbps": 2.99, "copy_bytes": 1 << 30, "copy_median_us": 359.1, "copy_reps": 20,
        "cublas_fp16_tflops": 729.0, "cublas_size": 8192, "cublas_median_us": 1508.2, "cublas_reps": 20}
# made-up (bandwidth efficiency, compute ceiling TFLOP/s, small-M path, large-M path, switch M)
MODEL = {"awq": (0.80, 300.0, "gemv", "dequant+cublas", 64),
         "q4_0": (0.75, 180.0, "mmvq", "mmq", 16), "q4_1": (0.75, 175.0, "mmvq", "mmq", 16),
         "q5_0": (0.70, 170.0, "mmvq", "mmq", 16), "q5_1": (0.70, 165.0, "mmvq", "mmq", 16),
         "q8_0": (0.80, 190.0, "mmvq", "mmq", 16), "fp16": (0.85, 620.0, "cublas", "cublas", 1)}
NEW = (0.70, 170.0, "small", "large", 16)   # a registry format newer than this table: made up alike


def main():
    from quantzoo import formats

    rows = []
    for k, n, _, _ in kernels.QWEN3_8B_SHAPES:
        for name in kernels.bench_formats():
            eff, tf, small, large, switch = MODEL.get(name, NEW)
            wb = formats.get(name).nbytes((n, k))
            for m in kernels.M_VALUES:
                flops = 2.0 * m * n * k
                by = wb + 2 * m * k + 2 * m * n
                t = max(by / (eff * CEIL["copy_tbps"] * 1e12), flops / (tf * 1e12)) + 2.5e-6
                rec = {"format": name, "k": k, "n": n, "m": m, "weight_bytes": wb,
                       "path": small if m < switch else large, "status": "ok",
                       "nmse": formats.get(name).nmse_ceiling * 0.8,
                       "median_us": t * 1e6, "p10_us": t * 0.98e6, "p90_us": t * 1.03e6, "samples": 20,
                       "timing": "graph", "inner": 16, "reps": 20, "copies": 8}
                if m == 1:   # the one-launch read of the weight: made up too, faster than any kernel
                    rec["read_us"] = (wb / (0.95 * CEIL["copy_tbps"] * 1e12) + 2.0e-6) * 1e6
                if (k, n) == (4096, 12288) and m in kernels.POWER_M:   # the power probe: made up
                    capped = m > 1
                    rec.update(sustained_us=t * 1.02e6, sm_clock_mhz=1400.0 if capped else 1980.0,
                               power_w=700.0 if capped else 350.0, power_capped=1.0 if capped else 0.0,
                               clock_reasons=["sw power cap"] if capped else [], clock_reason_bits=4 * capped,
                               power_limit_w=700.0)
                    rec["mj_per_call"] = rec["power_w"] * rec["sustained_us"] * 1e-3
                rec.update(kernels.metrics(rec, CEIL))
                rows.append(rec)
    kernels.add_x_cublas(rows)
    res = {"kind": "quantzoo-bench-kernels", "version": 1,
           "FIXTURE": "synthetic numbers from a roofline model with made-up efficiencies, written by "
                      "tests/data/make_bench_fixture.py for the report tests; not a measurement",
           "machine": {"time_utc": "2026-11-22T05:00:00Z", "host": "fixture", "python": "3.12.3",
                       "numpy": "2.1.0", "torch": "2.11.0+cu130", "quantzoo": "0.1.0",
                       "git_commit": "fixture", "cuda_available": True, "cupy": "14.2.0",
                       "gpu": "NVIDIA H100 80GB HBM3 (fixture)", "compute_capability": "9.0", "sms": 132,
                       "gpu_memory_gib": 79.2, "l2_bytes": 52428800, "torch_cuda": "13.0",
                       "driver": "580.00", "sm_clock": "1980 MHz", "mem_clock": "2619 MHz",
                       "power_limit": "700.00 W"},
           "ceilings": CEIL, "ceilings_end": dict(CEIL, copy_tbps=2.98, cublas_fp16_tflops=725.0),
           "settings": {"shapes": [[k, n] for k, n, _, _ in kernels.QWEN3_8B_SHAPES], "m": kernels.M_VALUES,
                        "formats": kernels.bench_formats(), "seed": 0, "sigma": 0.02, "target_s": 0.03,
                        "graph": True, "l2_bytes": 52428800, "rotation": "copies x weight bytes >= 4 x L2",
                        "qwen3_8b_layer": [list(s) for s in kernels.QWEN3_8B_SHAPES], "wall_s": 0.0,
                        "power": {"shape": [4096, 12288], "m": list(kernels.POWER_M), "seconds": 1.5,
                                  "interval_ms": 50}},
           "results": rows}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_kernels_fixture.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=0, allow_nan=False)
    print(path)


if __name__ == "__main__":
    main()
