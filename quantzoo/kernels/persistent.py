"""The persistent decode kernel (cuda/decode_persistent.cu): all decoder layers of one decode
step in one launch, for a model whose decoder linears are all in one GGUF format.

    plan = PersistentDecode.build(model)      # or None, with PersistentDecode.why_not(model)
    plan.run(h, pos)                          # h (1, D) fp16 embedded token, updated in place

After run, h is the residual stream after the last layer (both deltas added); the runner's final
RMSNorm + lm_head follow as usual. The values equal the runner's fused-ops decode step bit for
bit (tests/test_persistent_gpu.py): the kernel runs the same device functions (layer_ops.cuh)
and gguf_mmvq16.cu's summation order. Graph-capturable: it zeroes its barrier counter with a
memset, reads the position from device memory and allocates nothing.
"""
from __future__ import annotations

import math

import numpy as np

from quantzoo.cuda_launch import get_kernel, launch, set_max_dynamic_smem, sm_count

from . import gguf, layer_ops

SOURCE = "decode_persistent.cu"
PIECE = 128                 # blocks per row piece (persist::PIECE)
SP = 4                      # row pieces per ring stage (persist::SP)
CONSUMER_THREADS = 16 * 32  # persist::CW warps
OPTIONS: tuple = ()         # extra compiler options (experiments)
THREADS = CONSUMER_THREADS + 32
SMEM_BUDGET = 200 * 1024    # dynamic shared memory the ring may grow to (of 227 KB per SM)
MAX_STAGES = 64
LAYER_PTRS = 9


def kernel_name(fmt: str, e: int, g: int, norm: bool, v: int) -> str:
    return f"decode_persistent<{gguf.BLOCKS[fmt]}, {e}, {g}, {'true' if norm else 'false'}, {v}>"


# Compiled by the CI's nvcc tier: Qwen3-8B's head shape (E 4, G 4, q/k norm) and a llama one
# (E 2, G 3) in every format; the runner compiles other instances on first use.
SOURCES = {SOURCE: tuple(kernel_name(f, e, g, n, 1) for f in gguf.BLOCKS for (e, g, n) in ((4, 4, True), (2, 3, False)))}


def _norm_shape(D: int) -> tuple[int, int]:
    """add_rms_norm's (V, threads) for a row of D (quantzoo.kernels.layer_ops.add_rms_norm)."""
    v = next(v for v in layer_ops.NORM_CHUNKS if D <= 8 * 1024 * v)
    return v, -(-D // (8 * v * 32)) * 32


def smem_bytes(fmt: str, stages: int, D: int, HHD: int, F: int, ctas: int, G: int, hd: int) -> int:
    """The kernel's dynamic shared memory: ring, Q8_1 x, gate / SwiGLU rows, mbarriers, the
    attention's merge scratch (4 warps x G heads x (hd + 2) floats)."""
    slot = SP * PIECE * gguf.BYTES[fmt]
    xb = max(D, HHD, F) // 32
    umax = 32 * -(-(F // 32) // ctas)
    return stages * slot + 16 + xb * 36 + 4 * umax + 8 + 16 * stages + 16 * G * (hd + 2)


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
        if layer_ops.supports(cfg.hidden_size, cfg.intermediate_size, hd, H, KV):
            return layer_ops.supports(cfg.hidden_size, cfg.intermediate_size, hd, H, KV)
        D, F = cfg.hidden_size, cfg.intermediate_size
        if F % 128 or (H * hd) % 256:
            return f"intermediate size {F} (a multiple of 128) / attention width {H * hd} (of 256)"
        if _norm_shape(D)[1] > CONSUMER_THREADS:
            return f"hidden size {D}: its norm takes more than {CONSUMER_THREADS} threads"
        fmt = fmts.pop()
        if smem_bytes(fmt, 8, D, H * hd, F, sm_count(model.device), H // KV, hd) > SMEM_BUDGET:
            return "shapes too large for the kernel's shared memory"
        return None

    @classmethod
    def build(cls, model):
        return None if cls.why_not(model) else cls(model)

    def __init__(self, model):
        import torch

        cfg = model.config
        dev = model.device
        self.fmt = model.layers[0].qkv.qt.format
        self.D, self.F = cfg.hidden_size, cfg.intermediate_size
        self.H, self.KV, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.norm = model.layers[0].qk_norm is not None
        self.v, self.norm_threads = _norm_shape(self.D)
        self.ctas = sm_count(dev)
        slot = SP * PIECE * gguf.BYTES[self.fmt]
        G = self.H // self.KV
        fixed = smem_bytes(self.fmt, 0, self.D, self.H * self.hd, self.F, self.ctas, G, self.hd)
        self.stages = int(min(MAX_STAGES, (SMEM_BUDGET - fixed) // (slot + 16)))
        self.smem = smem_bytes(self.fmt, self.stages, self.D, self.H * self.hd, self.F, self.ctas, G, self.hd)
        self.name = kernel_name(self.fmt, layer_ops.HEAD_DIMS[self.hd], self.H // self.KV, self.norm, self.v)
        self.model = model
        self.layers_table(model)
        nq = (self.H + 2 * self.KV) * self.hd
        self.qkv = torch.empty(nq, dtype=torch.float16, device=dev)
        self.q = torch.empty(self.H * self.hd, dtype=torch.float16, device=dev)
        self.attn = torch.empty(self.H * self.hd, dtype=torch.float16, device=dev)
        self.act_q8 = torch.empty(self.F // 32 * 36, dtype=torch.uint8, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)

    def layers_table(self, model):
        """The L x 9 pointer table (qkv, o, gate_up, down, the two norms, q/k norm, k and v cache);
        rebuilt when the KV cache is reallocated (setup_cache)."""
        import torch

        rows = []
        kc, vc = model.k_cache, model.v_cache
        for i, lay in enumerate(model.layers):
            rows.append([lay.qkv.qt.data.data_ptr(), lay.o.qt.data.data_ptr(), lay.gate_up.qt.data.data_ptr(),
                         lay.down.qt.data.data_ptr(), lay.attn_norm.data_ptr(), lay.mlp_norm.data_ptr(),
                         lay.qk_norm.data_ptr() if lay.qk_norm is not None else 0,
                         kc[i, 0].data_ptr() if kc is not None else 0, vc[i, 0].data_ptr() if vc is not None else 0])
        self.table = torch.tensor(np.array(rows, dtype=np.uint64).view(np.int64), device=model.device)
        self.cache_ptr = kc.data_ptr() if kc is not None else 0

    def run(self, h, pos, trace=None) -> None:
        """One decode step's decoder layers over h (1, D) fp16 in place, at position pos (1,) int64.
        trace: None, or an int64 tensor of trace_size() that receives every CTA's barrier times
        (phase_times reads it)."""
        m = self.model
        if m.k_cache is None:
            raise ValueError("persistent decode: no KV cache yet; run prefill first")
        if m.k_cache.data_ptr() != self.cache_ptr:
            self.layers_table(m)
        work = m._decode_work
        k = get_kernel(SOURCE, self.name, (self.name,), OPTIONS)
        set_max_dynamic_smem(k, (SOURCE, self.name, self.smem), self.smem)
        self.bar.zero_()
        launch(k, (self.ctas,), (CONSUMER_THREADS + 32,),
               (self.table.data_ptr(), np.int32(len(m.layers)), h.data_ptr(), self.qkv.data_ptr(), self.q.data_ptr(),
                self.attn.data_ptr(), self.act_q8.data_ptr(), work.o.data_ptr(), work.ml.data_ptr(),
                work.count.data_ptr(), pos.data_ptr(), m.cos.data_ptr(), m.sin.data_ptr(), self.bar.data_ptr(),
                np.int32(self.D), np.int32(self.F), np.int32(self.H), np.int32(self.KV), np.int32(work.S),
                np.int32(work.n_split), np.int32(self.norm_threads), np.int32(self.stages), np.float32(self.eps),
                np.float32(math.log2(math.e) / math.sqrt(self.hd)), 0 if trace is None else trace.data_ptr()),
               shared_mem=self.smem)

    def trace_size(self) -> int:
        return (len(self.model.layers) * 12 + 1) * self.ctas

    def phase_times(self, trace) -> dict:
        """us per step in each phase from a trace of run(): 'work' is a CTA's time from leaving one
        grid barrier to arriving at the next (mean and max over CTAs, summed over layers), 'wait'
        its time inside barriers; 'step' the first departure to the last CTA's end."""
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
