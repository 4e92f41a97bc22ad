"""`quantzoo bench kernels` (every weight format x Qwen3-8B shapes x M, vs cuBLAS fp16) and
`quantzoo bench model` (the runner on a Qwen3-8B-shaped model; quantzoo.bench.model)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks: kernels (per format and shape) and model")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="WHAT")

    from quantzoo.bench import kernels, model

    pk = bsub.add_parser("kernels", help="every weight format's matmul vs cuBLAS fp16, copy "
                                         "bandwidth and cuBLAS TFLOP/s measured in the same run",
                         description="Time every weight format's matmul (and fp16 cuBLAS) on Qwen3-8B "
                                     "linear shapes and each M; writes bench-kernels.json and .csv to "
                                     "--out. Needs a CUDA GPU with CuPy.")
    kernels.add_arguments(pk)
    pk.set_defaults(func=kernels.run)

    pm = bsub.add_parser("model", help="the runner on a Qwen3-8B-shaped model: prefill/decode tok/s",
                         description="The runner on a Qwen3-8B-shaped model with random weights, per "
                                     "format: decode and prefill tok/s, peak memory, roofline, per-kernel "
                                     "breakdowns. Needs a CUDA GPU; --tiny --device cpu is a CPU smoke test.")
    model.add_arguments(pm)
    pm.set_defaults(func=model.run)
