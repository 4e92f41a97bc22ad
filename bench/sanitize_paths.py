"""A compute-sanitizer target: every matmul path of every kernel family once, on small tail shapes.

    compute-sanitizer --tool {memcheck,racecheck,synccheck} python3 bench/sanitize_paths.py [seed] [formats] [parts]

(formats and parts: comma lists; parts of matmul, layer_ops, runner, all by default.)

Each forced path of every weight format in the registry (awq: every one of kernels.awq.PATHS; each
GGUF format: every one of kernels.gguf.PATHS; fp16: its M = 1 GEMV and cuBLAS) runs at M = 1, 3,
9, 20, 40, 80, 100 (every wgmma token tile up to 128; at 80 and 100 two 64-token tiles, the
wgmma configs of the mid-size rule) on N x K = 576 x 384 and 608 x 512 (tails of
every tile; K % 256 == 0 for GGUF's wgmma), and with glu=True on 640 x 512. Each product is compared with
the CPU emulation (ops.matmul, mode "emulate"; for GGUF's fp16-input paths, dequant and wgmma,
mode "dequant"; GLU as silu(gate) * up of it) to 2 % of its largest value, so that a wrong answer
shows as well as a sanitizer report; the exit status is 1 if any is wrong. Paths that refuse a
case (M past their range, K for wgmma) are skipped, saying so. The dequant kernels (AWQ's, each
GGUF format's) must equal the numpy codec bit for bit. Then the runner's layer ops
(cuda/layer_ops.cu: add_rms_norm with and without Q8_1 output, silu_mul, attn_decode at one run and
at several) against torch in float32 / float64, to 1 %. Last, small random models of every
format through the runner (fused ops, eager): a Qwen3 (head_dim 128, q/k norms) and a llama
(head_dim 64), a 40-token prefill (qk_rope_store, the GLU epilogues) against the same weights on
the CPU emulation (to 25 %: these random weights are that sensitive to Q8_1's rounding, see
runner()), then 3 decode steps, the GGUF ones also through the persistent decode kernel, which
must equal the per-op steps bit for bit. cuDNN's SDPA (the prefill's attention) is switched off
here: racecheck reports hazards inside it, torch's kernel, not quantzoo's.
A run over the whole GPU test tier under racecheck instruments torch's kernels too and runs for
tens of minutes; this covers quantzoo's own kernels in about a minute (bench/NOTES.md, session 45,
where synccheck found divergent barriers in the AWQ wgmma GLU epilogue).
"""
import sys

import numpy as np
import torch

from quantzoo import ops
from quantzoo.formats import get, stored_names
from quantzoo.kernels import awq, fp16, gguf

KERNELS = {"awq": (awq.matmul, awq.PATHS),
           "gguf": (gguf.matmul, gguf.PATHS),
           "fp16": (lambda x, qt, path, glu: fp16.linear(x, qt.data), ("linear",))}
PATHS = {f: KERNELS[get(f).kernels] for f in stored_names()}


PARTS = ("matmul", "layer_ops", "runner")


def check_args(formats, parts) -> None:
    """Every format and part by name, and at least one check to run: a typo ("runners") or a
    runner-only run of fp16 (which has no runner check here) ran nothing and said "0 wrong",
    exit 0 -- a clean sanitizer run of nothing."""
    for what, names, known in (("format", formats, list(PATHS)), ("part", parts, list(PARTS))):
        for n in names:
            if n not in known:
                raise ValueError(f"{what} {n!r}: expected one of {known}")
    if not ("layer_ops" in parts or "matmul" in parts and formats
            or "runner" in parts and any(f != "fp16" for f in formats)):
        raise ValueError(f"formats {list(formats)} with parts {list(parts)} check nothing "
                         "(the runner part takes the formats other than fp16)")


def main(seed: int, formats, parts=PARTS) -> int:
    check_args(formats, parts)
    rng = np.random.default_rng(seed)
    bad = 0
    for fmt in formats if "matmul" in parts else ():
        for n, k, glu in ((576, 384, False), (608, 512, False), (640, 512, True)):
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            qt = get(fmt).quantize(w, group_size=64) if fmt == "awq" else get(fmt).quantize(w)
            qg = qt.to("cuda")
            kernel, paths = PATHS[fmt]
            if glu and fmt == "fp16":
                continue
            if not glu:
                bad += dequant(fmt, qt, qg, f"{fmt} dequant {n}x{k}")
            for path in paths:
                for m in (1, 3, 9, 20, 40, 80, 100):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    name = f"{fmt} {path} {n}x{k}{' glu' if glu else ''} M={m}"
                    try:
                        y = kernel(x, qg, path=path, glu=glu)
                    except ValueError as e:
                        print(f"skip {name}: {e}")
                        continue
                    torch.cuda.synchronize()
                    # GGUF's dequant and wgmma paths take x in fp16, not Q8_1: a float32 product
                    # on the dequantized weight is their reference (the Q8_1 emulation is ~2 % off
                    # it at a GLU's M = 1)
                    fp16_x = fmt == "fp16" or (fmt != "awq" and path in ("dequant", "wgmma"))
                    want = ops.matmul(x.cpu().float(), qt, mode="dequant" if fp16_x else "emulate").double()
                    if glu:
                        want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2:]
                    got = y.double().cpu()
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    ok = bool(torch.isfinite(got).all()) and err < 2e-2
                    bad += not ok
                    print(f"{'ok ' if ok else 'BAD'} {name}: max error {err:.2e} of the largest value", flush=True)
    if "matmul" in parts and "awq" in formats:
        bad += awq_split_k(rng)
    if "layer_ops" in parts:
        bad += layer_ops(seed)
    if "runner" in parts:
        bad += runner(seed, [f for f in formats if f != "fp16"])
    print(f"{bad} wrong")
    return 1 if bad else 0


def awq_split_k(rng) -> int:
    """The AWQ wgmma kernel's split-K sums, forced (on the shapes above dispatch splits no K): at
    2 splits wg::hand_over, past 2 wg::meet at T = 16 (M = 3, 9; awq.WGMMA_MEET_MAX_T) and
    wgmma_reduce at T = 32 (M = 20); plain and GLU, against the emulation to 2 %."""
    if not awq.wgmma_available(torch.device("cuda")):
        return 0
    bad = 0
    for n, k, glu in ((576, 384, False), (640, 512, True)):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        qt = get("awq").quantize(w, group_size=64)
        d = qt.to("cuda").data
        for m in (3, 9, 20):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            want = ops.matmul(x.cpu().float(), qt, mode="emulate").double()
            if glu:
                want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2:]
            for splits in (2, 3, 5):
                y = torch.empty(m, n // 2 if glu else n, device="cuda", dtype=torch.float16)
                awq._wgmma(x, d["qweight"], d["scales"], d["qzeros"], y, m, k, n, 64, splits=splits, glu=glu)
                torch.cuda.synchronize()
                bad += _report(f"awq wgmma {n}x{k}{' glu' if glu else ''} M={m} {splits} splits", y, want, tol=2e-2)
    return bad


def dequant(fmt, qt, qg, name) -> int:
    """The format's dequant kernel against the numpy codec, bit for bit (fp16 has none)."""
    if fmt == "fp16":
        return 0
    if fmt == "awq":
        got = ops.awq_dequantize(*(qg.data[a] for a in ("qweight", "scales", "qzeros"))).t()
    else:
        got = gguf.dequantize(qg)
    torch.cuda.synchronize()
    want = torch.from_numpy(np.ascontiguousarray(get(fmt).dequantize(qt), dtype=np.float32))
    ok = torch.equal(got.float().cpu().reshape(want.shape), want.half().float())
    print(f"{'ok ' if ok else 'BAD'} {name}: {'bit-equal to' if ok else 'differs from'} the numpy codec",
          flush=True)
    return int(not ok)


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
        if D % 32 == 0:   # the Q8_1 copy of the output, both layouts, against the quantize kernel
            for layout, quant in (("split", gguf.quantize_q8_1_split), ("interleaved", gguf.quantize_q8_1)):
                h2 = h.clone()
                q8 = torch.empty(T * D // 32 * 36, dtype=torch.uint8, device="cuda")
                out = lo.add_rms_norm(h2, d, w, 1e-6, q8_1=q8, layout=layout)
                ok = torch.equal(q8.view(-1), quant(out).view(-1))
                print(f"{'ok ' if ok else 'BAD'} add_rms_norm T={T} D={D} Q8_1 {layout}: "
                      f"{'equal to' if ok else 'differs from'} quantize_q8_1 of its output", flush=True)
                bad += int(not ok)
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


def runner(seed: int, formats) -> int:
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model
    from quantzoo.model.config import ModelConfig

    torch.backends.cuda.enable_cudnn_sdp(False)
    bad = 0
    shapes = {"qwen3 hd128": ("qwen3", 512, 1024, 4, 1, 128, True), "llama hd64": ("llama", 512, 1024, 12, 4, 64, False)}
    for fmt in formats:
        for label, (arch, D, F, H, KV, hd, qk) in shapes.items():
            cfg = ModelConfig(arch=arch, vocab_size=512, hidden_size=D, intermediate_size=F, num_layers=2,
                              num_heads=H, num_kv_heads=KV, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                              max_position=512, tie_word_embeddings=False, qk_norm=qk)
            w = synthetic_weights(fmt, cfg, "cuda", seed=seed)
            cpu = build_model(cfg, {k: v.cpu().float() if isinstance(v, torch.Tensor) else v.to("cpu")
                                    for k, v in w.items()}, None, device="cpu", matmul_mode="emulate")
            gguf_fmt = get(fmt).kernels == "gguf"
            models = {p: build_model(cfg, w, None, device="cuda", cuda_graph=False, persistent=p)
                      for p in ((False, True) if gguf_fmt else (False,))}
            prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
            name = f"runner {fmt} {label}"
            assert models[False].fused_ops, name
            # These random block weights make the logits sensitive to Q8_1's rounding: on the CPU,
            # rounding only the emulated matmuls' inputs to fp16 moves the logits by 5 % (q4_0)
            # to 11 % (q5_0) of the largest; a wrong position or kernel moves them by ~1.
            bad += _report(f"{name} prefill", models[False].logits(prompt), cpu.logits(prompt), tol=0.25)
            for m in models.values():
                m.setup_cache(128)
            last = {p: m.prefill(prompt) for p, m in models.items()}
            tok = int(last[False].argmax())
            for step in range(3):
                got = {p: m.decode_step(tok, len(prompt) + step).float().clone() for p, m in models.items()}
                if True in got:
                    ok = torch.equal(got[True], got[False])
                    print(f"{'ok ' if ok else 'BAD'} {name} step {step}: persistent "
                          f"{'bit-equal to' if ok else 'differs from'} the per-op path", flush=True)
                    bad += int(not ok)
                bad += int(not torch.isfinite(got[False]).all())
                tok = int(got[False].argmax())
    return bad


if __name__ == "__main__":
    args = (int(sys.argv[1]) if len(sys.argv) > 1 else 0,
            [f.strip() for f in sys.argv[2].split(",")] if len(sys.argv) > 2 else list(PATHS),
            [p.strip() for p in sys.argv[3].split(",")] if len(sys.argv) > 3 else list(PARTS))
    try:
        check_args(*args[1:])   # (before the GPU's check: a typo is said on any machine)
    except ValueError as e:
        sys.exit(f"bench/sanitize_paths.py: {e}")
    if not torch.cuda.is_available():   # (a CPU machine: QuantizedTensor.to's traceback)
        sys.exit("bench/sanitize_paths.py: needs a CUDA GPU (torch sees none here)")
    sys.exit(main(*args))
