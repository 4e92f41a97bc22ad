"""`quantzoo bench model`: the runner on a Qwen3-8B-shaped model with random weights.

Per format (awq g128 with an fp16 lm_head, q4_0, q8_0, fp16 -- GGUF formats put every 2-D
weight, lm_head included, in the one format, as the llama.cpp numbers of DESIGN.md §6 were
made), one run measures:
  decode tok/s at batch 1: 128 tokens after a 16-token prompt, the decode step replayed from
      a CUDA graph (and eager, for the gain); the next token is the argmax fed back on the GPU,
      so no host sync per step; and the graph decode after a long prompt (--long-context, 4096),
      where the attention's reads of the KV cache weigh in;
  prefill tok/s for 512- and 2048-token prompts (one batched forward; median of 7), and again
      with every format's model held at once and timed round-robin (prefill_side_by_side: the
      ratios to fp16 without the host's drift between the formats' turns);
  peak GPU memory (torch's max allocated) against weights + KV cache (+10 % allowed);
  the bandwidth roofline: copy bandwidth measured in the same run / bytes of every weight read
      once per token (embedding excluded), and the fraction of it decode reaches;
  the same graph decode with plain launches (pdl off), for programmatic dependent launch's gain;
  the same graph decode with the per-layer ops as torch ops (fused_ops off), for the fusion's gain;
  GGUF formats: the graph decode through the experimental persistent kernel (every decoder layer
      in one launch, kernels.persistent) and where one of its steps spends its time;
  a per-op breakdown of one eager decode step and of one prefill (torch.profiler, GPU time per
      kernel name, and the prefill's wall time: where GPU time < wall time, Python is the limit),
      taken after every timing of the run (profile_formats says why);
  two bounds for the decode graph, on the CUDA runner (kernels.stream: a plain one-launch read
      of a buffer, a measured floor for an M = 1 matmul of that many bytes):
      decode_tok_s_ideal_linears -- the same graph with every linear's product replaced by that
          read of as many bytes as its weight (a GGUF linear's own Q8_1 quantize of fp16 x
          kept), the per-layer ops unchanged: about what this runner could do with GEMVs as fast
          as a plain read of their weight;
      decode_tok_s_reads_only -- a graph of those reads alone, one per linear of a step: about
          what any runner launching one kernel per linear could reach, per-layer ops for free.

Weights are built on the GPU directly: random block bytes with a fixed, finite scale per block
(GGUF), random nibbles with small scales (AWQ), Gaussian fp16: setup takes seconds, not the
minutes a CPU quantizer would need for 8 B weights. The numbers do not depend on the values.
"""
from __future__ import annotations

import json
import math
import sys
import time

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position=40960)
FORMATS = ("awq", "q4_0", "q8_0", "fp16")
# llama.cpp on the same H100 (the brief's ../shared/DESIGN.md §6, llama-bench, flash attention
# on; Qwen3-8B): tokens/s. Shown beside a run of that shape only.
LLAMA_CPP = {"q4_0": {"pp512": 10473, "pp2048": 11043, "tg128": 309},
             "q8_0": {"pp512": 10567, "pp2048": 11111, "tg128": 214},
             "fp16": {"pp512": 18513, "pp2048": 19751, "tg128": 161}}


def add_arguments(p) -> None:
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated formats (default: {','.join(FORMATS)})")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 36 = Qwen3-8B, with --tiny 2; fewer for a quick look)")
    p.add_argument("--decode-tokens", type=int, default=128, help="graph decode steps timed (default 128)")
    p.add_argument("--eager-tokens", type=int, default=32, help="eager decode steps timed (default 32)")
    p.add_argument("--prompt-lens", default=None, help="prefill lengths (default 512,2048, with --tiny 64,256)")
    p.add_argument("--long-context", type=int, default=None, metavar="N",
                   help="also time the graph decode after an N-token prompt (default 4096, with --tiny 0; "
                        "0 skips)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-op profile")
    p.add_argument("--awq-group-size", type=int, default=None, help="AWQ group size (default 128; needs awq "
                   "in --formats)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test, CPU or GPU)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --tiny")
    p.add_argument("--json", default=None, help="write the results as JSON to this path (rewritten after each "
                   "format with \"partial\": true, so that a run cut short keeps the formats it finished)")


# ---- random weights in each format, built on the device ------------------------------------
def random_weight(fmt: str, n: int, k: int, device, gen, group_size: int = 128, std: float = 0.02):
    """A QuantizedTensor (n, k) of random contents, valid for its format, on `device`: built there
    for fp16, AWQ and the GGUF block formats; any other format of the registry quantizes a
    Gaussian with its own codec (on the CPU: minutes for a Qwen3-8B-sized model)."""
    import torch

    from .. import formats
    from ..formats import QuantizedTensor
    from ..formats.gguf_blocks import GGUFBlockFormat

    if fmt == "fp16":
        w = (torch.randn(n, k, device=device, generator=gen, dtype=torch.float32) * std).half()
        return QuantizedTensor("fp16", (n, k), w if device != "cpu" else w.numpy())
    if fmt == "awq":
        g = group_size
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=device, generator=gen, dtype=torch.int64).to(torch.int32)
        qz = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), device=device, generator=gen, dtype=torch.int64).to(torch.int32)
        sc = torch.full((k // g, n), std / 4, device=device, dtype=torch.float16)
        data = {"qweight": qw, "qzeros": qz, "scales": sc}
        if device == "cpu":
            data = {a: b.numpy() for a, b in data.items()}
        return QuantizedTensor("awq", (n, k), data, {"group_size": g})
    f = formats.get(fmt)
    if not isinstance(f, GGUFBlockFormat):
        w = (torch.randn(n, k, device=device, generator=gen, dtype=torch.float32) * std).cpu().numpy()
        qt = f.quantize(w, **({"group_size": group_size} if "group_size" in f.param_names else {}))
        return qt if device == "cpu" else qt.to(device)
    B, nb = f.bytes_per_block, k // f.block_size
    raw = torch.randint(0, 256, (n, nb, B), device=device, generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = std / (127 if f.bits == 8 else 8)
    raw[..., 0:2] = torch.full((n, nb, 1), scale, dtype=torch.float16, device=device).view(torch.uint8)
    if f.has_min:
        raw[..., 2:4] = torch.full((n, nb, 1), -8 * scale, dtype=torch.float16, device=device).view(torch.uint8)
    data = raw.reshape(n, nb * B)
    return QuantizedTensor(fmt, (n, k), data if device != "cpu" else data.numpy())


def synthetic_weights(fmt: str, cfg, device, group_size=128, seed=0) -> dict:
    """LoadedWeights (HF names) of a random model: every linear in `fmt` (lm_head fp16 for awq)."""
    import torch

    from .. import formats
    from ..report.sizes import embedding_format

    gen = torch.Generator(device=device).manual_seed(seed)
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    dt = torch.float16 if device != "cpu" else torch.float32
    ones = lambda n: torch.ones(n, device=device, dtype=dt)  # noqa: E731
    W = lambda n, k: random_weight(fmt, n, k, device, gen, group_size)  # noqa: E731
    w = {"model.embed_tokens.weight": (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dt),
         "model.norm.weight": ones(h)}
    # GGUF files quantize lm_head; AWQ checkpoints keep it in fp16 (modules_to_not_convert), as
    # every format without a ggml type does here (report.sizes.embedding_format)
    w["lm_head.weight"] = random_weight(embedding_format(formats.get(fmt)), v, h, device, gen)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
        w[p + "self_attn.q_norm.weight"] = ones(cfg.head_dim)
        w[p + "self_attn.k_norm.weight"] = ones(cfg.head_dim)
        w[p + "self_attn.q_proj.weight"] = W(cfg.q_size, h)
        w[p + "self_attn.k_proj.weight"] = W(cfg.kv_size, h)
        w[p + "self_attn.v_proj.weight"] = W(cfg.kv_size, h)
        w[p + "self_attn.o_proj.weight"] = W(h, cfg.q_size)
        w[p + "mlp.gate_proj.weight"] = W(f, h)
        w[p + "mlp.up_proj.weight"] = W(f, h)
        w[p + "mlp.down_proj.weight"] = W(h, f)
    return w


def synthetic_model(fmt: str, cfg, device, group_size=128, seed=0, **opts):
    from ..model import build_model

    return build_model(cfg, synthetic_weights(fmt, cfg, device, group_size, seed), None,
                       device=device, **opts)


def model_bytes(fmt: str, cfg, device: str, positions: int) -> tuple[int, int]:
    """(weights, KV cache) bytes one synthetic model of `fmt` holds on `device` with a cache of
    `positions`: the packed linears (lm_head fp16 for awq, as for any format without a ggml
    type: synthetic_weights) and the embedding in the runner's float dtype (fp16 on CUDA,
    float32 on the CPU, which also keeps every linear dequantized to float32: matmul_mode
    "cached"); the cache in that dtype."""
    from .. import formats
    from ..report.sizes import embedding_format

    h, v, fl = cfg.hidden_size, cfg.vocab_size, 2 if device.startswith("cuda") else 4
    lin = cfg.num_layers * h * (2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size)
    bits = formats.get(fmt).bits_per_weight
    head_bits = formats.get(embedding_format(formats.get(fmt))).bits_per_weight
    w = (lin * bits + v * h * head_bits) / 8 + v * h * fl
    if fl == 4:
        w += 4 * (lin + v * h)
    return int(w), cfg.kv_cache_bytes(positions, fl)


def prompt_lens(args) -> list[int]:
    """--prompt-lens as token counts ('' for none; ValueError where one is not a number: run()
    says which flag)."""
    return [int(x) for x in args.prompt_lens.split(",") if x]


def make_config(layers: int, tiny: bool):
    from ..model.config import ModelConfig

    d = dict(QWEN3_8B, num_layers=layers)
    if tiny:
        d.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=4,
                 num_kv_heads=2, head_dim=64, max_position=4096)
    return ModelConfig(arch="qwen3", tie_word_embeddings=False, qk_norm=True, **d)


# ---- measurements -----------------------------------------------------------------------------
def _sync(dev):
    import torch

    if str(dev).startswith("cuda"):
        torch.cuda.synchronize(dev)


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The fixed n-token prompt every prefill measurement here uses."""
    return [(7 * i + 3) % vocab for i in range(n)]


def cache_positions(n: int) -> int:
    """KV cache positions for n tokens: rounded up to 256, as the runner sizes its cache."""
    return -(-n // 256) * 256


def decode_cache_positions(args) -> int:
    """KV cache positions of the short decode runs: the 16-token prompt, then as many steps as the
    longer of the graph (--decode-tokens) and eager (--eager-tokens) runs, and a margin of 8."""
    return cache_positions(16 + max(args.decode_tokens, args.eager_tokens) + 8)


def time_decode(m, steps: int, prompt: int = 16, graph: bool = True) -> float:
    """Decode tok/s at batch 1: `steps` steps after a `prompt`-token prefill; argmax fed back."""
    import torch

    m.use_graph = graph and m.is_cuda
    ids = prompt_ids(prompt, m.config.vocab_size)
    logits = m.prefill(ids)
    tok = torch.argmax(logits).reshape(1)
    m.ensure_graph()
    if graph and not m.use_graph:
        return float("nan")   # capture failed: m.fallbacks says why
    for i in range(3):  # warm-up (kernel compiles for eager, replays for the graph)
        logits = m.decode_step(tok, prompt + i)
    _sync(m.device)
    t = time.perf_counter()
    for i in range(steps):
        logits = m.decode_step(tok, prompt + i)
        tok = torch.argmax(logits).reshape(1)
    _sync(m.device)
    return steps / (time.perf_counter() - t)


def time_prefill(m, n: int, reps: int = 7, warmup_s: float = 0.5) -> float:
    ids = prompt_ids(n, m.config.vocab_size)
    # warm-up by time, not by count: kernel compiles, cuBLAS heuristics, the allocator, and the
    # GPU's clocks, which idle low while a model is built. (A 512-token prefill is partly bound
    # by the host's Python -- wall 1.2-1.4x its ~12-16 ms of GPU work since the launch plans of
    # session 14, 2.5-2.8x before -- and moves with the lent machine's host; bench/NOTES.md.)
    t_end = time.perf_counter() + warmup_s
    for i in range(1000):
        m.prefill(ids)
        _sync(m.device)
        if i >= 1 and time.perf_counter() > t_end:
            break
    ts = []
    for _ in range(reps):
        _sync(m.device)
        t = time.perf_counter()
        m.prefill(ids)
        _sync(m.device)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return n / ts[len(ts) // 2]


class ReadLinear:
    """Stands in for a CUDA runner Linear (model/llm.py) in a decode bound: the same shape and
    input layouts, but its product is kernels.stream.read (launched in `config`) of a buffer as
    large as the weight (its own, so no two linears share L2 lines), writing an output of the
    right shape.
    A GGUF linear on mmvq given fp16 x still quantizes it to Q8_1 first, as the real one does."""

    def __init__(self, lin, config, device):
        import torch

        self.lin, self.shape, self.config = lin, lin.shape, config
        self.buf = torch.empty(-(-lin.nbytes // 16) * 16, dtype=torch.uint8, device=device)

    def _read(self, rows: int, n: int):
        import torch

        from ..kernels import stream

        y = torch.empty(rows, n, dtype=torch.float16, device=self.buf.device)
        stream.read(self.buf, y if y.numel() % 8 == 0 else None, config=self.config)   # (zeros in y where it can)
        return y

    def __call__(self, x):
        rows = x.numel() // x.shape[-1]
        if self.lin.q8_1_layout(rows) is not None:   # (a GGUF linear on mmvq)
            from ..kernels import gguf

            gguf.quantize_q8_1_split(x.reshape(rows, -1))
        return self._read(rows, self.shape[0])

    def glu(self, x):
        return self._read(x.numel() // x.shape[-1], self.shape[0] // 2)

    def planned(self, x, glu: bool = False, silu_mul=None):
        return self.glu(x) if glu else self(x)

    def q8_1_layout(self, m: int, glu: bool = False):
        return self.lin.q8_1_layout(m, glu)

    def gguf_fp16_input(self, m: int, glu: bool = False) -> bool:
        return self.lin.gguf_fp16_input(m, glu)

    def from_q8_1(self, xq, m: int, layout: str):
        return self._read(m, self.shape[0])


def decode_bounds(m, steps: int, bw) -> dict:
    """decode_tok_s_reads_only and decode_tok_s_ideal_linears (module docstring) for a CUDA model
    with fused layer ops, their fractions of the bandwidth roofline bw / weight bytes, and the
    read configs they were fastest with (decode_read_config*). Each is timed with every config of
    kernels.stream.CONFIGS, one config for the whole step, and the fastest kept: the fastest per
    size in isolation (stream.best_read_us) was not the fastest in the chain (H100: awq reads-only
    485 tok/s with per-size picks, 537-557 with one config; bench/NOTES.md, session 27). So these
    are what plain reads reached here, not a proof that nothing is faster."""
    import torch

    from ..cuda_launch import programmatic_launches
    from ..kernels import stream
    from . import timing

    slots = [(lay, name) for lay in m.layers for name, v in vars(lay).items() if _is_linear(v)]
    slots.append((m, "lm_head"))
    saved = [getattr(obj, name) for obj, name in slots]
    if len(saved) != len(list(m._all_linears())):
        raise ValueError(f"decode_bounds: found {len(saved)} of the model's {len(list(m._all_linears()))} linears")
    use_graph, fallbacks = m.use_graph, list(m.fallbacks)   # time_decode and a failed capture change them
    reads, ideal = {}, {}
    try:
        proxies = [ReadLinear(lin, stream.DEFAULT, m.device) for lin in saved]
        for cfg in stream.CONFIGS:
            with programmatic_launches(m.pdl):
                g = timing.capture_graph(lambda i: [stream.read(p.buf, config=cfg) for p in proxies], 1)
            per_step = sorted(timing.time_graph(g, inner=1, reps=max(5, steps // 8)))
            del g
            reads[cfg] = 1.0 / per_step[len(per_step) // 2]
        for (obj, name), p in zip(slots, proxies):
            setattr(obj, name, p)
        for cfg in stream.CONFIGS:
            for p in proxies:
                p.config = cfg
            m._graph = None
            ideal[cfg] = time_decode(m, steps, graph=True)
    finally:
        for (obj, name), lin in zip(slots, saved):
            setattr(obj, name, lin)
        m.use_graph, m.fallbacks[:], m._graph, m._g_out = use_graph, fallbacks, None, None   # recaptured on use
        proxies = None
        torch.cuda.empty_cache()
    out = {}
    for key, got in (("reads_only", reads), ("ideal_linears", ideal)):
        got = {c: v for c, v in got.items() if math.isfinite(v)}   # NaN: a capture that failed
        if not got:
            raise RuntimeError(f"decode_bounds: no {key} timing succeeded")
        cfg = max(got, key=got.get)
        out[f"decode_tok_s_{key}"] = got[cfg]
        out[f"decode_read_config_{key}"] = list(cfg)
        if bw:
            out[f"roofline_fraction_{key}"] = got[cfg] * m.weight_bytes(include_embedding=False) / bw
    return out


def _is_linear(v) -> bool:
    from ..model.llm import Linear

    return isinstance(v, Linear)


def decode_breakdown(m, pos: int = 16, top: int = 12) -> list[dict]:
    """GPU time per kernel name over one eager decode step (torch.profiler / CUPTI)."""
    graph = m.use_graph
    m.use_graph = False
    try:
        m.prefill([1] * pos)   # (a step attends to the positions before it)
        m.decode_step(1, pos)
        _sync(m.device)
        return profile_kernels(lambda: m.decode_step(1, pos), m.device, top)
    finally:
        m.use_graph = graph


def prefill_breakdown(m, n: int, top: int = 12, runs: int = 3) -> list[dict]:
    """GPU time per kernel name over one n-token prefill, and the wall time around it: the
    profiled run of least GPU time out of `runs`. (The first format a process profiles ran
    every kernel, its norms and SiLU included, 15-25 % slower in its first profiled prefill:
    bench/NOTES.md, session 13.)"""
    ids = prompt_ids(n, m.config.vocab_size)
    m.prefill(ids)
    return min((profile_kernels(lambda: m.prefill(ids), m.device, top) for _ in range(runs)),
               key=lambda rows: rows[0]["total_gpu_us"])


def profile_kernels(fn, device, top: int) -> list[dict]:
    """[{total_gpu_us, wall_us, kernels}, then the top kernels by GPU time] for one call of fn."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t
    rows = {}
    for e in prof.events():
        dt = getattr(e, "device_time", None)
        if dt is None:
            dt = getattr(e, "cuda_time", 0)
        if not dt or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(e.name, {"kernel": e.name, "calls": 0, "us": 0.0})
        r["calls"] += 1
        r["us"] += dt
    out = sorted(rows.values(), key=lambda r: -r["us"])
    total = sum(r["us"] for r in out) or 1.0
    for r in out:
        r["share"] = r["us"] / total
        r["us"] = round(r["us"], 1)
    return [{"total_gpu_us": round(total, 1), "wall_us": round(wall * 1e6, 1), "kernels": len(out)}] + out[:top]


def profile_formats(results, cfg, args, device) -> None:
    """decode_breakdown and prefill_breakdown (the shortest prompt) into each format's record,
    on a model built again for it. Run after every timing of the run: torch.profiler leaves
    CUPTI attached when it ends (Kineto does not tear it down unless TEARDOWN_CUPTI=1,
    pytorch/pytorch#144455), and every host-bound figure timed after a profile read slower --
    H100, 8 layers, eager decode tok/s before / after one profile: q4_0 310-327 / 230-276, awq
    567-572 / 472-490, and a 64-token prefill down to half (bench/NOTES.md, session 56); the
    formats profiled before the others' timings biased the eager decode and prefill walls."""
    import torch

    from .. import ops

    lens = prompt_lens(args)
    for r in results:
        if "error" in r:
            continue
        m = synthetic_model(r["format"], cfg, device, group_size=args.awq_group_size)
        for key in ("decode_breakdown", "prefill_breakdown") if lens else ("decode_breakdown",):
            try:
                if key == "decode_breakdown":
                    m.setup_cache(decode_cache_positions(args))
                    r[key] = decode_breakdown(m)
                else:
                    m.setup_cache(cache_positions(max(lens)))
                    r[key] = prefill_breakdown(m, min(lens))
            except Exception as e:  # noqa: BLE001 - the profile is a nicety; never lose the numbers for it
                r[key] = [{"error": f"{type(e).__name__}: {e}"}]
        del m
        ops.release_workspaces()
        torch.cuda.empty_cache()


def prefill_side_by_side(fmts, cfg, args, device, lens, reps: int = 7) -> dict:
    """Prefill wall time with every format's model held at once, timed round-robin (the order
    rotated each round), so that the host's slow and fast phases fall on every format alike.
    A 512-token prefill is bound by Python on the lent machine and its wall time moves up to 2x
    between phases of one process (bench/NOTES.md, session 11); per-format runs one after
    another then give ratios to fp16 anywhere from 0.6x to 1.3x. Returns {"reps", "tok_s":
    {fmt: {n: median tok/s}}, "x_fp16": {fmt: {n: ratio}}} or {"skipped": why}."""
    import statistics

    import torch

    if not lens or len(fmts) < 2:
        return {"skipped": "needs two formats and a prompt length"}
    from ..model.host_memory import free_bytes

    free = free_bytes(device)   # (on the CPU, too much is no exception: the OOM killer ends the run)
    if free is not None and sum(sum(model_bytes(f, cfg, device, cache_positions(max(lens)))) for f in fmts) > free:
        return {"skipped": "the formats' models do not fit in memory together"}
    models = {}
    try:
        for f in fmts:
            models[f] = synthetic_model(f, cfg, device, group_size=args.awq_group_size)
            models[f].setup_cache(cache_positions(max(lens)))
    except torch.cuda.OutOfMemoryError:
        models.clear()
        torch.cuda.empty_cache()
        return {"skipped": "the formats' models do not fit on the GPU together"}
    ids = {n: prompt_ids(n, cfg.vocab_size) for n in lens}
    times = {f: {n: [] for n in lens} for f in fmts}
    for rnd in range(2 + reps):          # two untimed rounds: compiles, allocator, clocks
        order = fmts[rnd % len(fmts):] + fmts[:rnd % len(fmts)]
        for n in lens:
            for f in order:
                _sync(device)
                t = time.perf_counter()
                models[f].prefill(ids[n])
                _sync(device)
                if rnd >= 2:
                    times[f][n].append(time.perf_counter() - t)
    del models
    if str(device).startswith("cuda"):
        from .. import ops

        ops.release_workspaces()
        torch.cuda.empty_cache()
    tok_s = {f: {n: n / statistics.median(times[f][n]) for n in lens} for f in fmts}
    out = {"reps": reps, "tok_s": tok_s}
    if "fp16" in tok_s:
        out["x_fp16"] = {f: {n: tok_s[f][n] / tok_s["fp16"][n] for n in lens} for f in fmts}
    return out


def persistent_decode(m, steps: int) -> dict:
    """decode_tok_s_graph_persistent: the graph decode through kernels.persistent (all decoder
    layers in one launch), and decode_persistent_phases_us, where one of its steps spends its time
    (PersistentDecode.phase_times); or decode_persistent_why_not."""
    import torch

    from ..kernels.persistent import PersistentDecode

    why = PersistentDecode.why_not(m)
    if why:
        return {"decode_persistent_why_not": why}
    out = {}
    try:
        m.use_persistent(True)
        out["decode_tok_s_graph_persistent"] = time_decode(m, steps, graph=True)
        p = m._persistent
        trace = torch.zeros(p.trace_size(), dtype=torch.int64, device=m.device)
        with torch.inference_mode():
            h = m.embed(torch.ones(1, dtype=torch.int64, device=m.device)).reshape(1, -1)
            pos = torch.tensor([16], device=m.device)   # a position time_decode's prompt wrote
            for _ in range(2):   # the second one traced warm
                p.run(h.clone(), pos, trace)
        out["decode_persistent_phases_us"] = {k: (round(v, 1) if isinstance(v, float) else
                                                  {a: round(b, 1) for a, b in v.items()})
                                              for k, v in p.phase_times(trace).items()}
    finally:
        m.use_persistent(False)
    return out


def bench_format(fmt, cfg, args, device, bw) -> dict:
    import torch

    lens = prompt_lens(args)
    t0 = time.perf_counter()
    m = synthetic_model(fmt, cfg, device, group_size=args.awq_group_size)
    _sync(device)
    setup_s = time.perf_counter() - t0
    dec_seq = decode_cache_positions(args)
    pre_seq = cache_positions(max(lens, default=0))
    m.setup_cache(dec_seq)   # decode attends over the whole cache: keep it as short as the run
    if device.startswith("cuda"):   # peak from here: the random-init transients do not count
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    wbytes = m.weight_bytes(include_embedding=False)
    emb = m.embed.table.numel() * m.embed.table.element_size()
    r = {"format": fmt, "setup_s": round(setup_s, 1), "weight_bytes": wbytes, "embedding_bytes": emb,
         "formats": m.formats, "fallbacks": m.fallbacks, "decode_cache_positions": dec_seq,
         "prefill_cache_positions": pre_seq}
    r["roofline_tok_s"] = bw / wbytes if bw else None
    r["decode_tok_s_graph"] = time_decode(m, args.decode_tokens, graph=True) if m.is_cuda else None
    r["decode_tok_s_eager"] = time_decode(m, args.eager_tokens, graph=False)
    r["fused_layer_ops"] = m.fused_ops
    if m.is_cuda:   # the same graph with plain launches: what programmatic dependent launch gains
        pdl, m.pdl, m._graph = m.pdl, False, None
        r["decode_tok_s_graph_no_pdl"] = time_decode(m, args.decode_tokens, graph=True)
        m.pdl, m._graph = pdl, None
    if m.fused_ops and m.is_cuda:   # the same graph decode with the per-layer ops left to torch
        m.fused_ops, m._graph = False, None
        r["decode_tok_s_graph_torch_ops"] = time_decode(m, args.decode_tokens, graph=True)
        m.fused_ops, m._graph = True, None
    if m.is_cuda and m.fused_ops:   # the experimental persistent decode kernel (GGUF formats)
        r.update(persistent_decode(m, args.decode_tokens))
    if r["decode_tok_s_graph"]:
        r["graph_gain"] = r["decode_tok_s_graph"] / r["decode_tok_s_eager"]
        if bw:
            r["roofline_fraction"] = r["decode_tok_s_graph"] / r["roofline_tok_s"]
    if device.startswith("cuda"):
        r["peak_decode_bytes"] = torch.cuda.max_memory_allocated(device)
        r["peak_decode_over_weights_kv"] = r["peak_decode_bytes"] / (wbytes + emb + m.kv_cache_bytes())
    if m.is_cuda and m.fused_ops:   # after the peak: the bounds hold a second copy of the weight bytes
        try:
            r.update(decode_bounds(m, args.decode_tokens, bw))
        except Exception as e:  # noqa: BLE001 - a bound is a nicety; never lose the numbers for it
            torch.cuda.synchronize()
            r["decode_bounds_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    n = getattr(args, "long_context", 0)
    if n and m.is_cuda:   # after the decode peak: this cache is larger than the short run's
        from .. import ops

        m.setup_cache(cache_positions(n + args.decode_tokens + 8))
        r[f"decode_tok_s_graph_ctx{n}"] = time_decode(m, args.decode_tokens, prompt=n)
        ops.release_workspaces()   # the N-token prefill's (AWQ's dequant buffer ...): not the prefill peak's
    m._graph = m._g_out = None
    m.k_cache = m.v_cache = None
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if not lens:   # decode only (--prompt-lens ''): no prefill phase
        return r
    m.setup_cache(pre_seq)
    r["kv_cache_bytes"] = m.kv_cache_bytes()
    for n in lens:
        r[f"prefill_tok_s_{n}"] = time_prefill(m, n)
    if device.startswith("cuda"):   # prefill phase: cache of pre_seq positions, T=2048 activations
        peak = torch.cuda.max_memory_allocated(device)
        r["peak_gpu_bytes"] = peak
        base = wbytes + emb + r["kv_cache_bytes"]
        r["peak_over_weights_kv"] = peak / base
    del m
    if device.startswith("cuda"):
        # the kernels' cached workspaces (AWQ's dequant buffer is as large as its largest weight)
        # would otherwise count against the next format's peak
        from .. import ops

        ops.release_workspaces()
        torch.cuda.empty_cache()
    return r


def run(args) -> int:
    import torch

    from .. import formats as registry
    from ..model.llm import check_device
    from ..paths import check_out_file

    fmts = [f.strip() for f in args.formats.split(",") if f.strip()]   # ("q4_0, q8_0" as bench kernels reads it)
    if not fmts:
        raise ValueError("--formats: no format named")
    for i, f in enumerate(fmts):
        registry.get_stored(f, "--formats")   # (an unknown name: a KeyError listing the known ones)
        if f in fmts[:i]:
            raise ValueError(f"--formats {args.formats}: {f} named twice")
    # the arguments first: a mistake should fail here, not once per format after minutes of setup
    # (--tiny's defaults keep a CPU run to seconds: 10 s on 2 cores)
    if args.layers is None:
        args.layers = 2 if args.tiny else QWEN3_8B["num_layers"]
    if args.layers < 1:   # (the model's config named it num_layers, no flag of this command)
        raise ValueError(f"--layers {args.layers}: at least 1")
    if args.prompt_lens is None:
        args.prompt_lens = "64,256" if args.tiny else "512,2048"
    try:
        lens = prompt_lens(args)
    except ValueError:
        raise ValueError(f"--prompt-lens {args.prompt_lens!r}: comma-separated token counts") from None
    cfg = make_config(args.layers, args.tiny)
    if any(not 1 <= n <= cfg.max_position for n in lens):
        raise ValueError(f"--prompt-lens {args.prompt_lens}: each in 1..{cfg.max_position} (the model's positions)")
    for name in ("decode_tokens", "eager_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if decode_cache_positions(args) > cfg.max_position:
        raise ValueError(f"--decode-tokens {args.decode_tokens} / --eager-tokens {args.eager_tokens}: after the "
                         f"16-token prompt (and a margin of 8) each must fit the model's {cfg.max_position} "
                         f"positions (at most {cfg.max_position - 16 - 8})")
    if args.long_context is None:
        args.long_context = 0 if args.tiny else 4096
    top = cfg.max_position - args.decode_tokens - 8
    if not 0 <= args.long_context <= top:
        raise ValueError(f"--long-context {args.long_context}: 0 (skip) up to {top} (the model's {cfg.max_position} "
                         f"positions less the {args.decode_tokens} decode tokens and a margin of 8)")
    from ..formats.awq import check_shape

    if args.awq_group_size is None:
        args.awq_group_size = 128
    elif "awq" not in fmts:   # (it would be ignored)
        raise ValueError(f"--awq-group-size {args.awq_group_size}: no AWQ format in --formats {args.formats}")
    check_shape(8, 128, args.awq_group_size, "--awq-group-size")
    if args.json is not None:   # (written after the first format, minutes in; its folder is not made)
        check_out_file(args.json, f"--json {args.json}")
    try:
        device = check_device(args.device)
    except ValueError as e:
        raise ValueError(f"--device: {e} (use --tiny --device cpu for a smoke test)") from None
    if not device.startswith("cuda") and not args.tiny:
        raise ValueError(f"--device {args.device}: the Qwen3-8B-shaped model is for a CUDA GPU "
                         "(its fp16 weights alone are 16 GB); add --tiny for a smoke test on the CPU")
    if args.long_context and not device.startswith("cuda"):   # (it times the CUDA graph decode)
        raise ValueError(f"--long-context {args.long_context}: it times the graph decode, which runs on CUDA only")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    # the largest model and cache of the run against the memory there is, before any is built
    positions = max(decode_cache_positions(args), cache_positions(max(lens, default=0)),
                    cache_positions(args.long_context + args.decode_tokens + 8) if args.long_context else 0)
    fmt = max(fmts, key=lambda f: sum(model_bytes(f, cfg, device, positions)))
    from ..model.host_memory import _size, free_bytes

    (w, kv), free = model_bytes(fmt, cfg, device, positions), free_bytes(device)
    if free is not None and w + kv > free:
        raise MemoryError(f"--layers {args.layers}: the {fmt} model takes {_size(w)} of weights and {_size(kv)} of "
                          f"KV cache ({positions} positions) on {device}, where {_size(free)} is free")
    info, bw = {}, None
    if device.startswith("cuda"):
        from .timing import copy_bandwidth, machine_info

        info = machine_info()
        cb = copy_bandwidth()
        bw = cb["copy_tbps"] * 1e12
        info["copy"] = cb
    results = []
    out = {"config": cfg.__dict__, "device": device, "machine": info, "copy_bandwidth_bytes_s": bw,
           "llama_cpp_h100": LLAMA_CPP, "results": results}
    for f in fmts:
        print(f"== {f} ...", file=sys.stderr, flush=True)
        try:
            results.append(bench_format(f, cfg, args, device, bw))
        except Exception as e:   # one broken format must not cost the others' numbers
            import traceback

            traceback.print_exc()
            results.append({"format": f, "error": f"{type(e).__name__}: {e}"})
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        r = results[-1]
        print(f"== {f}: " + ("ERROR" if "error" in r else ", ".join(
            f"{k} {v:,.0f}" for k, v in r.items() if k.startswith(("decode_tok_s", "prefill_tok_s"))
            and isinstance(v, float) and math.isfinite(v))), file=sys.stderr, flush=True)
        if args.json is not None:   # the formats so far, should a long run be cut short
            _write_json(args.json, dict(out, partial=True))
    ok = [r["format"] for r in results if "error" not in r]
    if lens and len(ok) > 1:
        print("== prefill, every format side by side ...", file=sys.stderr, flush=True)
        try:
            out["prefill_side_by_side"] = prefill_side_by_side(ok, cfg, args, device, lens)
        except Exception as e:   # noqa: BLE001 - never lose the per-format numbers for it
            out["prefill_side_by_side"] = {"skipped": f"{type(e).__name__}: {e}"}
    if device.startswith("cuda") and not args.no_breakdown:   # last: profile_formats says why
        print("== per-kernel breakdowns ...", file=sys.stderr, flush=True)
        profile_formats(results, cfg, args, device)
    print(render(out, args))
    if args.json is not None:
        _write_json(args.json, out)
    if not ok:
        print("bench model: every format failed (tracebacks above)", file=sys.stderr)
        return 1
    return 0


def _write_json(path: str, out: dict) -> None:
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, default=str)


def render(out: dict, args) -> str:
    from tabulate import tabulate

    res = out["results"]
    fp16 = next((r for r in res if r["format"] == "fp16" and "error" not in r), None)
    lens = prompt_lens(args)
    lc_n = getattr(args, "long_context", None) or 0
    c = out["config"]
    # llama.cpp's figures are of the whole Qwen3-8B on an H100: beside nothing else
    eight_b = all(c.get(k) == v for k, v in QWEN3_8B.items() if k not in ("max_position",))
    rows = []
    fmt_n = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"  # noqa
    for r in res:
        if "error" in r:
            rows.append([r["format"], "ERROR: " + r["error"][:150]])
            continue
        row = [r["format"], f"{r['weight_bytes'] / 1e9:.2f}", fmt_n(r.get("roofline_tok_s")),
               fmt_n(r.get("decode_tok_s_graph")),
               "-" if r.get("roofline_fraction") is None else f"{100 * r['roofline_fraction']:.0f}%"]
        if lc_n:
            row.append(fmt_n(r.get(f"decode_tok_s_graph_ctx{lc_n}")))
        row += [fmt_n(r.get("decode_tok_s_graph_no_pdl")), fmt_n(r.get("decode_tok_s_eager")),
                "-" if r.get("graph_gain") is None else f"{r['graph_gain']:.2f}x",
                fmt_n(r.get("decode_tok_s_graph_torch_ops"))]
        for n in lens:
            v = r[f"prefill_tok_s_{n}"]
            rel = f" ({v / fp16[f'prefill_tok_s_{n}']:.2f}x)" if fp16 and r is not fp16 else ""
            row.append(fmt_n(v) + rel)
        row.append("-" if "peak_gpu_bytes" not in r else
                   f"{r['peak_decode_bytes'] / 2**30:.1f} ({100 * (r['peak_decode_over_weights_kv'] - 1):+.0f}%) / "
                   f"{r['peak_gpu_bytes'] / 2**30:.1f} ({100 * (r['peak_over_weights_kv'] - 1):+.0f}%)")
        if eight_b:
            lc = LLAMA_CPP.get(r["format"], {})
            row.append("/".join(str(lc.get(k, "-")) for k in ("tg128", "pp512", "pp2048")) if lc else "-")
        rows.append(row)
    hdr = (["format", "weights GB", "roofline tok/s", "decode tok/s (graph)", "of roofline"]
           + ([f"decode after {lc_n} tokens"] if lc_n else [])
           + ["decode, no PDL", "decode eager", "graph gain", "decode, torch layer ops"]
           + [f"prefill {n}" for n in lens] +
           ["peak GiB decode / prefill (vs W+emb+KV)"]
           + (["llama.cpp H100 tg128/pp512/pp2048"] if eight_b else []))
    s = tabulate(rows, headers=hdr, tablefmt="github", disable_numparse=True)
    bw = out.get("copy_bandwidth_bytes_s")
    shaped = "Qwen3-8B-shaped" if c["hidden_size"] == QWEN3_8B["hidden_size"] else "A tiny smoke-test model"
    s += (f"\n\n{shaped} ({c['num_layers']} layers, hidden {c['hidden_size']}, vocab "
          f"{c['vocab_size']}), random weights, batch 1, {out['device']}. Roofline = copy bandwidth "
          f"{'-' if not bw else f'{bw / 1e12:.2f} TB/s'} (measured now) / weight bytes per token "
          "(embedding excluded). 'decode after N tokens': the graph decode after an N-token prompt (the "
          "attention reads the whole cache each step). Prefill in parentheses: ratio to the fp16 runner. "
          "'no PDL': the same "
          "graph with plain launches instead of programmatic dependent launch. 'torch layer ops': "
          "graph decode with norms, RoPE, attention and SwiGLU as torch ops instead of the fused kernels."
          + (" 'llama.cpp H100': llama-bench's tokens/s for Qwen3-8B on an H100 (quoted, not measured in "
             "this run)." if eight_b else ""))
    sbs = out.get("prefill_side_by_side") or {}
    if "tok_s" in sbs:
        s += (f"\n\nPrefill with every model held at once, timed round-robin (median of {sbs['reps']}; "
              "what the ratios to fp16 should be read from, the host's speed drifting within a run):")
        for f, per in sbs["tok_s"].items():
            s += f"\n  {f}: " + ", ".join(
                f"{n} tokens {v:,.0f} tok/s" + (f" ({sbs['x_fp16'][f][n]:.2f}x fp16)" if "x_fp16" in sbs else "")
                for n, v in per.items())
    elif sbs:
        s += f"\n\nPrefill side by side: skipped ({sbs.get('skipped')})"
    for r in res:
        if r.get("fallbacks"):
            s += f"\n{r['format']}: FALLBACK " + "; ".join(r["fallbacks"])
        s += _breakdown_text(r["format"], "one eager decode step", r.get("decode_breakdown"))
        if lens:
            s += _breakdown_text(r["format"], f"one {min(lens)}-token prefill", r.get("prefill_breakdown"))
    return s


def _breakdown_text(fmt: str, what: str, bd) -> str:
    from tabulate import tabulate

    if not bd:
        return ""
    if "error" in bd[0]:
        return f"\n{fmt}: {what}: breakdown unavailable ({bd[0]['error']})"
    head = bd[0]
    wall = f", {head['wall_us']:.0f} us wall (profiled)" if "wall_us" in head else ""
    return (f"\n\n{fmt}: {what}, {head['total_gpu_us']:.0f} us GPU time{wall} in {head['kernels']} "
            "kernel names (top):\n" +
            tabulate([[k["kernel"][:70], k["calls"], f"{k['us']:.0f}", f"{100 * k['share']:.1f}%"]
                      for k in bd[1:]], headers=["kernel", "calls", "us", "share"],
                     tablefmt="github", disable_numparse=True))
