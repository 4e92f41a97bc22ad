"""The persistent decode kernel (cuda/decode_persistent.cu): all decoder layers of one decode
step in one launch, for a model whose decoder linears are all in one GGUF format. The runner
uses it when asked: `build_model(..., persistent=True)` or `model.use_persistent(True)`, which
raise ValueError saying why a model does not qualify (PersistentDecode.why_not).

    plan = PersistentDecode(model)            # PersistentDecode.why_not(model) is None
    plan.run(h, pos)                          # h (1, D) fp16 embedded token, updated in place

Experimental and slower than the runner's default one-launch-per-op decode on the H100 (324 vs
448 tok/s on a Qwen3-8B q4_0 model, bench/model-h100.json as of session 32; the kernel's header
and bench/NOTES.md, session 29, say why).

After run, h is the residual stream after the last layer (both deltas added); the runner's final
RMSNorm + lm_head follow as usual. The values equal the runner's fused-ops decode step bit for
bit (tests/test_persistent_gpu.py): the kernel runs the same device functions (layer_ops.cuh)
and the summation order of the format's one-token kernel (gguf_mmvq16.cu or gguf_mmvq.cu).
Graph-capturable: it zeroes its barrier counter with a
memset, reads the position from device memory and allocates nothing. Its grid barriers need all
of its CTAs (one per SM) resident at once, so it goes out as a cooperative launch: the driver
refuses a grid that cannot all be resident (a RuntimeError here) instead of starting one that
would wait forever.
"""
from __future__ import annotations

import math

import numpy as np

from quantzoo.cuda_launch import PackedLaunch, get_kernel, set_max_dynamic_smem, sm_count

from . import gguf, layer_ops

SOURCE = "decode_persistent.cu"
PIECE = 128                 # blocks per row piece (persist::PIECE)
SP = 4                      # row pieces per ring stage (persist::SP)
CONSUMER_THREADS = 16 * 32  # persist::CW warps
THREADS = CONSUMER_THREADS + 32
SMEM_BUDGET = 200 * 1024    # dynamic shared memory the ring may grow to (of 227 KB per SM)
MAX_STAGES = 64
LAYER_PTRS = 9              # pointers a layer's row of the table holds (decode_persistent.cu)


def kernel_name(fmt: str, e: int, g: int, norm: bool, v: int, scalar: bool) -> str:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return f"decode_persistent<{gguf.BLOCKS[fmt]}, {e}, {g}, {b(norm)}, {v}, {b(scalar)}>"


# Compiled by the CI's nvcc tier (two instances keep it short; the GPU test compiles the rest):
# Qwen3-8B's heads (E 4, G 4, q/k norm) in q4_0, and a llama shape (E 2, G 3) in q5_0, whose
# GEMV adds in gguf_mmvq.cu's order (scalar).
SOURCES = {SOURCE: (kernel_name("q4_0", 4, 4, True, 1, False), kernel_name("q5_0", 2, 3, False, 1, True))}


def smem_budget(device) -> int:
    """Dynamic shared memory the kernel may take: SMEM_BUDGET, less where the device opts in to
    less (~16 KB left for the kernel's static shared memory)."""
    import torch

    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 227 * 1024)
    return min(SMEM_BUDGET, optin - 16 * 1024)


def stage_bytes(fmt: str) -> int:
    """Shared memory per ring stage: SP pieces of PIECE blocks, and its two mbarriers."""
    return SP * PIECE * gguf.BYTES[fmt] + 16


def smem_bytes(fmt: str, stages: int, D: int, HHD: int, F: int, ctas: int, G: int, hd: int) -> int:
    """The kernel's dynamic shared memory: ring (+ 16 bytes a window may read past it), Q8_1 x,
    gate / SwiGLU rows, mbarrier alignment, the attention's merge scratch (4 warps x G heads x
    (hd + 2) floats)."""
    xb = max(D, HHD, F) // 32
    umax = 32 * -(-(F // 32) // ctas)
    return stages * stage_bytes(fmt) + 16 + xb * 36 + 4 * umax + 8 + 16 * G * (hd + 2)


class PersistentDecode:
    """Everything one launch needs for a model: the per-layer pointer table, scratch, shapes."""

    @staticmethod
    def why_not(model) -> str | None:
        """None when the model's decode step can run as one persistent launch, else why not."""
        import torch

        cfg = model.config
        if not model.is_cuda or not model.fused_ops:
            return "needs CUDA and the fused layer ops"
        if torch.cuda.get_device_capability(model.device)[0] < 9:
            return "needs sm_90 (cp.async.bulk, mbarriers)"
        fmts = set()
        for i, lay in enumerate(model.layers):
            if lay.qkv is None or lay.gate_up is None:
                return f"layer {i}: q/k/v or gate/up not fused into one weight"
            for name, lin in (("qkv", lay.qkv), ("o_proj", lay.o), ("gate_up", lay.gate_up), ("down_proj", lay.down)):
                qt = lin.qt
                if qt is None or qt.format not in gguf.BLOCKS or lin.mode != "emulate":
                    return f"layer {i} {name}: {lin.format} is not a GGUF block format on the GPU kernels"
                k = qt.shape[1]
                if k % 256 or qt.data.data_ptr() % 16:
                    return f"layer {i} {name}: K={k} not a multiple of 256, or storage not 16-byte aligned"
                fmts.add(qt.format)
        if len(fmts) != 1:
            return f"decoder linears in several formats {sorted(fmts)}"
        hd, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        D, F = cfg.hidden_size, cfg.intermediate_size
        why = layer_ops.supports(D, F, hd, H, KV)
        if why:
            return why
        if F % 128 or (H * hd) % 256:
            return f"intermediate size {F} (a multiple of 128) / attention width {H * hd} (of 256)"
        if layer_ops.norm_shape(D)[1] > CONSUMER_THREADS:
            return f"hidden size {D}: its norm takes more than {CONSUMER_THREADS} threads"
        fmt = fmts.pop()
        if smem_bytes(fmt, 8, D, H * hd, F, sm_count(model.device), H // KV, hd) > smem_budget(model.device):
            return f"shapes too large for the kernel's shared memory ({smem_budget(model.device)} bytes)"
        return None

    def __init__(self, model):
        import torch

        cfg = model.config
        dev = model.device
        self.fmt = model.layers[0].qkv.qt.format
        self.D, self.F = cfg.hidden_size, cfg.intermediate_size
        self.H, self.KV, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.norm = model.layers[0].qk_norm is not None
        self.v, self.norm_threads = layer_ops.norm_shape(self.D)
        self.ctas = sm_count(dev)
        G = self.H // self.KV
        fixed = smem_bytes(self.fmt, 0, self.D, self.H * self.hd, self.F, self.ctas, G, self.hd)
        self.stages = int(min(MAX_STAGES, (smem_budget(dev) - fixed) // stage_bytes(self.fmt)))
        self.smem = smem_bytes(self.fmt, self.stages, self.D, self.H * self.hd, self.F, self.ctas, G, self.hd)
        # the summation order of the per-op path's one-token GEMV: gguf_mmvq16.cu ("split" Q8_1)
        # or gguf_mmvq.cu; the kernel reproduces it
        scalar = gguf.q8_1_layout(model.layers[0].qkv.qt, 1) != "split"
        self.name = kernel_name(self.fmt, layer_ops.HEAD_DIMS[self.hd], self.H // self.KV, self.norm, self.v, scalar)
        self.model = model
        self.layers_table(model)
        nq = (self.H + 2 * self.KV) * self.hd
        self.qkv = torch.empty(nq, dtype=torch.float16, device=dev)
        self.q = torch.empty(self.H * self.hd, dtype=torch.float16, device=dev)
        self.attn = torch.empty(self.H * self.hd, dtype=torch.float16, device=dev)
        self.act_q8 = torch.empty(self.F // 32 * 36, dtype=torch.uint8, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)

    def layers_table(self, model):
        """The L x LAYER_PTRS pointer table (qkv, o, gate_up, down, the two norms, q/k norm, k and v cache).
        The runner makes a new PersistentDecode whenever it reallocates the KV cache."""
        import torch

        rows = []
        kc, vc = model.k_cache, model.v_cache
        for i, lay in enumerate(model.layers):
            rows.append([lay.qkv.qt.data.data_ptr(), lay.o.qt.data.data_ptr(), lay.gate_up.qt.data.data_ptr(),
                         lay.down.qt.data.data_ptr(), lay.attn_norm.data_ptr(), lay.mlp_norm.data_ptr(),
                         lay.qk_norm.data_ptr() if lay.qk_norm is not None else 0,
                         kc[i, 0].data_ptr(), vc[i, 0].data_ptr()])
            assert len(rows[-1]) == LAYER_PTRS
        self.table = torch.tensor(np.array(rows, dtype=np.uint64).view(np.int64), device=model.device)
        self.cache, self.work = kc, model._decode_work   # what the table and the launch point at

    def run(self, h, pos, trace=None) -> None:
        """One decode step's decoder layers over h (1, D) fp16 in place, at position pos (1,) int64.
        trace: None, or an int64 tensor of trace_size() that receives every CTA's barrier times
        (phase_times reads it). Runs on the model's GPU whichever device is current."""
        import torch

        from quantzoo.cuda_launch import current_device

        m = self.model
        dev = self.table.device
        if dev.type == "cuda" and dev.index != current_device():
            with torch.cuda.device(dev):
                return self.run(h, pos, trace)
        if (not isinstance(h, torch.Tensor) or h.dtype != torch.float16 or h.device != dev
                or not h.is_contiguous() or h.numel() != self.D):
            got = (f"{h.dtype} {tuple(h.shape)} on {h.device}" if isinstance(h, torch.Tensor)
                   else type(h).__name__)
            raise ValueError(f"h: expected a contiguous float16 tensor of {self.D} values (1, {self.D}) "
                             f"on {dev}, got {got}")
        if h.data_ptr() % 16:   # read 16 bytes at a time (layer_ops.cuh, rms_norm_row)
            raise ValueError("h: its data must start at a 16-byte boundary")
        if (not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.numel() != 1
                or pos.device != dev):
            got = (f"{pos.dtype} {tuple(pos.shape)} on {pos.device}" if isinstance(pos, torch.Tensor)
                   else type(pos).__name__)
            raise ValueError(f"pos: expected an int64 tensor of one position on {dev}, got {got}")
        if m.k_cache is not self.cache or m._decode_work is not self.work:
            raise ValueError("persistent decode: the model's KV cache was replaced since this plan was made "
                             "(Model.setup_cache makes a new plan)")
        if trace is not None and (trace.dtype != torch.int64 or trace.device != h.device or not trace.is_contiguous()
                                  or trace.numel() < self.trace_size()):
            raise ValueError(f"trace: a contiguous int64 tensor of >= {self.trace_size()} elements on {h.device}")
        work = m._decode_work
        k = get_kernel(SOURCE, self.name, (self.name,))
        set_max_dynamic_smem(k, self.smem)
        self.bar.zero_()
        # cooperative: the grid barriers need every CTA resident (PackedLaunch); packed anew per
        # call (some Python against a ~3 ms step; the runner replays a captured graph)
        args = (self.table.data_ptr(), np.int32(len(m.layers)), h.data_ptr(), self.qkv.data_ptr(), self.q.data_ptr(),
                self.attn.data_ptr(), self.act_q8.data_ptr(), work.o.data_ptr(), work.ml.data_ptr(),
                work.count.data_ptr(), pos.data_ptr(), m.cos.data_ptr(), m.sin.data_ptr(), self.bar.data_ptr(),
                np.int32(self.D), np.int32(self.F), np.int32(self.H), np.int32(self.KV), np.int32(work.S),
                np.int32(work.n_split), np.int32(self.norm_threads), np.int32(self.stages), np.float32(self.eps),
                np.float32(math.log2(math.e) / math.sqrt(self.hd)), 0 if trace is None else trace.data_ptr())
        try:
            PackedLaunch(k, (self.ctas,), (THREADS,), args, self.smem, cooperative=True)()
        except RuntimeError as e:
            if "COOPERATIVE_LAUNCH_TOO_LARGE" not in str(e):
                raise
            raise RuntimeError(f"persistent decode: the GPU cannot hold all {self.ctas} CTAs of {self.smem} bytes of "
                               "shared memory at once (its occupancy, or an SM limit of MPS or a green context); "
                               "use Model.use_persistent(False)") from e

    def trace_size(self) -> int:
        return (len(self.model.layers) * 12 + 1) * self.ctas

    def phase_times(self, trace) -> dict:
        """us per step in each phase from a trace of run(): a phase's work is a CTA's time from
        leaving one grid barrier to arriving at the next (mean and max over the CTAs, summed over
        the layers); the barrier wait, a CTA's time inside the barriers (mean over the CTAs); the
        step, the first CTA's start to the last one's end."""
        L, P = len(self.model.layers), self.ctas
        t = trace.view(-1).cpu().numpy().astype(np.float64)
        bar = t[: L * 12 * P].reshape(L, 6, 2, P)
        end = t[L * 12 * P:]
        names = ("norm + qkv", "q/k norm + rope", "attention", "quantize + o_proj", "norm + gate/up + quantize",
                 "down_proj")
        out = {n: {"work_mean_us": 0.0, "work_max_us": 0.0} for n in names}
        waits = 0.0
        for l in range(L):
            for k in range(6):
                leave = bar[l, k, 1]
                arrive = bar[l, k + 1, 0] if k < 5 else (bar[l + 1, 0, 0] if l + 1 < L else end)
                w = (arrive - leave) / 1e3
                out[names[k]]["work_mean_us"] += float(w.mean())
                out[names[k]]["work_max_us"] += float(w.max())
                waits += float((bar[l, k, 1] - bar[l, k, 0]).mean()) / 1e3
        out["barrier wait (mean over CTAs)"] = waits
        out["step_us"] = float((end.max() - bar[0, 0, 1].min()) / 1e3)
        return out
