"""A compute-sanitizer target: every matmul path of every kernel family once, on small tail shapes.

    compute-sanitizer --tool {memcheck,racecheck,synccheck} python3 bench/sanitize_paths.py [seed] [formats]

Each forced path (awq: gemv / small / mma / dequant+cublas / wgmma; the GGUF formats: every one of
kernels.gguf.PATHS) runs at M = 1, 3, 9, 40 on N x K = 576 x 384 and 608 x 512 (tails of every tile;
K % 256 == 0 for GGUF's wgmma), and with glu=True on 640 x 512. Each product is compared with
the CPU emulation (ops.matmul, mode "emulate"; for GGUF's fp16-input paths, dequant and wgmma,
mode "dequant"; GLU as silu(gate) * up of it) to 2 % of its largest value, so that a wrong answer
shows as well as a sanitizer report; the exit status is 1 if any is wrong. Paths that refuse a
case (M past their range, K for wgmma) are skipped, saying so. Then the runner's layer ops
(cuda/layer_ops.cu: add_rms_norm, silu_mul, attn_decode at one run and at several) against
torch in float32 / float64, to 1 %.
A run over the whole GPU test tier under racecheck instruments torch's kernels too and runs for
tens of minutes; this covers quantzoo's own kernels in about a minute (bench/NOTES.md, session 45,
where synccheck found divergent barriers in the AWQ wgmma GLU epilogue).
"""
import sys

import numpy as np
import torch

from quantzoo import ops
from quantzoo.formats import get
from quantzoo.kernels import awq, gguf

PATHS = {"awq": ("gemv", "small", "mma", "dequant+cublas", "wgmma"),
         "q4_0": gguf.PATHS, "q5_1": gguf.PATHS, "q8_0": gguf.PATHS}


def main(seed: int, formats) -> int:
    rng = np.random.default_rng(seed)
    bad = 0
    for fmt in formats:
        for n, k, glu in ((576, 384, False), (608, 512, False), (640, 512, True)):
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            qt = get(fmt).quantize(w, group_size=64) if fmt == "awq" else get(fmt).quantize(w)
            qg = qt.to("cuda")
            for path in PATHS[fmt]:
                for m in (1, 3, 9, 40):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    name = f"{fmt} {path} {n}x{k}{' glu' if glu else ''} M={m}"
                    try:
                        y = (awq.matmul if fmt == "awq" else gguf.matmul)(x, qg, path=path, glu=glu)
                    except ValueError as e:
                        print(f"skip {name}: {e}")
                        continue
                    torch.cuda.synchronize()
                    # GGUF's dequant and wgmma paths take x in fp16, not Q8_1: a float32 product
                    # on the dequantized weight is their reference (the Q8_1 emulation is ~2 % off
                    # it at a GLU's M = 1)
                    fp16_x = fmt != "awq" and path in ("dequant", "wgmma")
                    want = ops.matmul(x.cpu().float(), qt, mode="dequant" if fp16_x else "emulate").double()
                    if glu:
                        want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2:]
                    got = y.double().cpu()
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    ok = bool(torch.isfinite(got).all()) and err < 2e-2
                    bad += not ok
                    print(f"{'ok ' if ok else 'BAD'} {name}: max error {err:.2e} of the largest value", flush=True)
    bad += layer_ops(seed)
    print(f"{bad} wrong")
    return 1 if bad else 0


def _report(name, got, want, tol=1e-2) -> int:
    got, want = got.double().cpu(), want.double().cpu()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    ok = bool(torch.isfinite(got).all()) and err < tol
    print(f"{'ok ' if ok else 'BAD'} {name}: max error {err:.2e} of the largest value", flush=True)
    return int(not ok)


def layer_ops(seed: int) -> int:
    from quantzoo.kernels import layer_ops as lo

    g = torch.Generator(device="cuda").manual_seed(seed)
    bad = 0
    for T, D in ((1, 4096), (7, 576), (3, 12296)):
        h, d = (torch.randn(T, D, device="cuda", generator=g).half() for _ in range(2))
        w = torch.rand(D, device="cuda", generator=g).half() + 0.5
        s = (h.float() + d.float()).half().float()
        want = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float() * w.float()
        bad += _report(f"add_rms_norm T={T} D={D}", lo.add_rms_norm(h, d, w, 1e-6), want)
    for T, F in ((1, 1536), (5, 96)):
        gu = torch.randn(T, 2 * F, device="cuda", generator=g).half()
        want = torch.nn.functional.silu(gu[:, :F].float()) * gu[:, F:].float()
        bad += _report(f"silu_mul T={T} F={F}", lo.silu_mul(gu), want)
    S = 256
    for H, KV, hd in ((16, 2, 128), (9, 3, 64)):
        kc, vc = (torch.randn(KV, S, hd, device="cuda", generator=g).half() for _ in range(2))
        work = lo.DecodeWork(H, KV, hd, S, "cuda")
        for p in (0, 127, 128, S - 1):   # 127: one run of the cache, 128 on: several, merged
            q = torch.randn(1, H, hd, device="cuda", generator=g).half()
            out = lo.attn_decode(q, kc, vc, torch.tensor([p], device="cuda"), work).view(H, hd)
            k = kc[:, : p + 1].double().repeat_interleave(H // KV, 0)
            v = vc[:, : p + 1].double().repeat_interleave(H // KV, 0)
            att = torch.softmax(q[0].double()[:, None] @ k.transpose(1, 2) / hd ** 0.5, -1)
            bad += _report(f"attn_decode H={H} KV={KV} hd={hd} pos={p}", out, (att @ v)[:, 0])
    return bad


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0,
                  sys.argv[2].split(",") if len(sys.argv) > 2 else list(PATHS)))
