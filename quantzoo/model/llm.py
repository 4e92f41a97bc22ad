"""The Qwen3 / llama decoder in torch: one short file, in the spirit of gpt-fast.

    h = embed(ids)
    per layer:  q, k, v = split(qkv_proj(rms(h)))          (one fused linear on CUDA)
                q, k    = rope(qk_norm(q)), rope(qk_norm(k))  (qk_norm: qwen3 only)
                h      += o_proj(attention(q, cache(k), cache(v)))
                h      += down_proj(silu(gate(rms(h))) * up(rms(h)))   (gate|up fused on CUDA)
    logits = lm_head(rms(h))                                (lm_head = embed_tokens when tied)

Every quantized linear is a `QuantizedTensor` applied through `quantzoo.ops.matmul`, so the
registry picks the kernel. Norms, RoPE, attention (SDPA; grouped-query heads) and SwiGLU are
torch; on CUDA (fp16) `_forward_fused` runs the same arithmetic as four fused kernels per layer
(quantzoo.kernels.layer_ops: add+RMSNorm, q/k-norm+RoPE+KV-cache write, SiLU*up, and for one
token a split-cache decode attention), which is what makes a decode step mostly matmul time.

RoPE is rotate-half (NeoX): dims i and i + head_dim/2 form a pair. Loaders hand Q/K rows in
that (HF) order; llama-arch GGUF files store them permuted for llama.cpp's adjacent-pair
rotation and the GGUF loader undoes it (gguf_loader.unpermute_qk).

The KV cache is preallocated. A forward takes a run of tokens at positions pos0..pos0+T-1: the
prompt in one batched prefill, then one token per decode step. On CUDA the decode step is
captured once in a CUDA graph: the token and its position live in static buffers and the causal
mask is computed on the GPU from the position, so a replay does no Python work at all (an eager
step pays ~16 us of Python + launch per CuPy kernel, see bench/notes-runner.md for the gain).

Precision: CPU runs float32 (matching HF transformers on the dequantized weights to ~1e-7);
CUDA runs float16 activations (what the kernels take) with norms reduced in float32 and RoPE
applied in float16, as HF does for fp16 models.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels, ops
from ..cuda_launch import call_on_device, programmatic_launches
from ..kernels import fp16 as fp16_kernels
from ..kernels import layer_ops
from ..formats import QuantizedTensor
from .config import ModelConfig, check_bool, is_int, token_ids
from .host_memory import check_cache_fits, check_cpu_placement

MATMUL_MODES = ("cached", "dequant", "emulate")


class Linear:
    """y = x @ W.T for one weight: a float tensor (torch F.linear) or a QuantizedTensor (ops).

    CPU, mode "cached" (default): the QuantizedTensor is dequantized once (fmt.dequantize) and
    kept in float32, i.e. ops.matmul(mode="dequant") without redoing the dequantization per
    call; "dequant" / "emulate" call ops.matmul every time ("emulate" = what the GPU kernel
    computes, Q8_1 activations included). CUDA: ops.matmul on the CUDA tensor, i.e. the
    format's kernel; when the format has no kernel module yet, the weight is dequantized to
    fp16 once and cuBLAS runs it (`fallback` says so). Unquantized fp16 weights on CUDA go through
    quantzoo.kernels.fp16.linear: cuBLAS, or at M <= 4 the streaming GEMV.
    """

    def __init__(self, w, device: str, dtype, mode: str = "cached"):
        self.qt = None
        self.w = None
        self.fallback = None
        self.format = _kind(w)
        if not isinstance(w, QuantizedTensor):
            self.w = torch.as_tensor(w).to(device=device, dtype=dtype)
            self.shape = tuple(self.w.shape)
            return
        self.shape = tuple(w.shape)
        if device == "cpu":
            if mode == "cached":
                self.w = torch.from_numpy(np.ascontiguousarray(w.dequantize(), dtype=np.float32))
            else:
                self.qt, self.mode = w.numpy(), mode
            return
        try:
            mod = ops.kernels_for(w.fmt)
            if not hasattr(mod, "matmul"):
                raise ImportError(f"quantzoo.kernels.{w.fmt.kernels} has no matmul")
        except (ImportError, NotImplementedError) as e:
            self.fallback = f"{w.format}: no CUDA kernel ({e}); dequantized to fp16 + cuBLAS"
            self.w = torch.from_numpy(w.dequantize()).to(device=device, dtype=dtype)
            return
        self.qt, self.mode = (w if w.device != "cpu" else w.to(device)), "emulate"
        if w.format == "fp16":   # unquantized: the plain tensor, through fp16_kernels.linear
            self.w, self.qt = self.qt.data.to(dtype), None

    def __call__(self, x):
        if self.w is not None:   # F.linear, or our GEMV for fp16 CUDA operands at decode-sized M
            return fp16_kernels.linear(x, self.w)
        return ops.matmul(x, self.qt, mode=self.mode)

    def glu(self, x):
        """silu(x @ gate.T) * (x @ up.T) for a fused [gate; up] linear on CUDA: fused into the
        matmul where the format's kernel module does that (GLU_MATMUL: kernels.gguf / kernels.awq
        matmul(..., glu=True), whose wgmma paths compute it in their epilogue), else
        layer_ops.silu_mul on self(x). The same values either way (cuda/swiglu.cuh)."""
        if self._glu_matmul:
            return ops.kernels_for(self.qt.fmt).matmul(x, self.qt, glu=True)
        return layer_ops.silu_mul(self(x))

    @property
    def _glu_matmul(self) -> bool:
        """Whether this linear's matmul computes the GLU itself (a kernel module's GLU_MATMUL)."""
        return (self.qt is not None and self.mode == "emulate"
                and getattr(ops.kernels_for(self.qt.fmt), "GLU_MATMUL", False))

    def planned(self, x, glu: bool = False, silu_mul=None):
        """self(x), or self.glu(x), for the runner's own rows: x (M, K) fp16 on the model's
        device, which is current. A kernel linear replays the launches its matmul recorded for
        M (kernels.replay) without the public call's checks and dispatch; the first call for an
        M, and any other linear, goes through self(x) / self.glu(x) -- where glu is not fused
        into the matmul, silu_mul (layer_ops.silu_mul's signature; by default that) of self(x)."""
        if glu and not self._glu_matmul:
            return (silu_mul or layer_ops.silu_mul)(self.planned(x))
        if self.qt is not None and self.mode == "emulate" and x.dim() == 2 and x.is_contiguous():
            m = x.shape[0]
            y = x.new_empty((m, self.shape[0] // 2 if glu else self.shape[0]))
            if kernels.replay(self.qt, ("glu", m) if glu else m, x, y):
                return y
            del y   # (not held beside the call's own output: all_logits' lm_head output is large)
        return self.glu(x) if glu else self(x)

    def q8_1_layout(self, m: int, glu: bool = False) -> str | None:
        """The Q8_1 layout in which this linear's GGUF kernel takes M rows already quantized
        (kernels.gguf.q8_1_layout; glu: for self.glu), or None: it takes fp16 x (other formats,
        other M, CPU)."""
        layouts = self.__dict__.setdefault("_q8_layouts", {})   # (asked per layer and call)
        if (m, glu) not in layouts:
            from ..kernels import gguf

            if len(layouts) >= 256:   # (a server sees many prompt lengths)
                layouts.clear()
            layouts[m, glu] = gguf.q8_1_layout(self.qt, m, glu) if self._gguf_kernel else None
        return layouts[m, glu]

    def gguf_fp16_input(self, m: int, glu: bool = False) -> bool:
        """Whether this is a GGUF kernel linear that takes M rows of x in fp16 (its kernels
        quantize no activations there: wgmma, or M past mmvq's), not in Q8_1."""
        return self._gguf_kernel and self.q8_1_layout(m, glu) is None

    @property
    def _gguf_kernel(self) -> bool:
        """Whether kernels.gguf runs this linear (a GGUF block weight, mode "emulate")."""
        return self.qt is not None and self.qt.fmt.kernels == "gguf" and self.mode == "emulate"

    def from_q8_1(self, xq, m: int, layout: str):
        """y for M rows of x given as Q8_1 blocks in `layout` (q8_1_layout(m)); equal to self(x)."""
        from ..kernels import gguf

        y = xq.new_empty((m, self.shape[0]), dtype=torch.float16)
        if kernels.replay(self.qt, ("q8_1", m), xq, y):   # (as planned())
            return y
        return gguf.matmul_q8_1(xq, self.qt, m, layout, out=y)

    @property
    def nbytes(self) -> int:
        if self.qt is not None:
            return self.qt.nbytes
        return self.w.numel() * self.w.element_size()


class Embedding:
    """Row lookup; a quantized table is dequantized per looked-up row on CPU, once on CUDA."""

    def __init__(self, w, device, dtype):
        self.qt = None
        if isinstance(w, QuantizedTensor):
            self.format = w.format
            if device == "cpu" and not isinstance(w.data, dict):   # block rows: slice them
                self.qt = w.numpy()
                self.table = None
                return
            w = torch.from_numpy(w.dequantize())
        else:
            self.format = _kind(w)
        self.table = torch.as_tensor(w).to(device=device, dtype=dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        flat = ids.reshape(-1).cpu().numpy()
        rows = QuantizedTensor(self.qt.format, (len(flat), self.qt.shape[1]), self.qt.data[flat],
                               self.qt.params)
        return torch.from_numpy(rows.dequantize()).reshape(*ids.shape, -1)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale (w=None: no scale). On CUDA
    one fused torch op."""
    if x.is_cuda and hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if w is None else w * xf.to(x.dtype)


def rope_tables(cfg: ModelConfig, max_seq: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin (max_seq, head_dim) in the activation dtype (as HF applies them).

    HF: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) with cos/sin the half-table
    repeated. Here the sign lives in the table, sin_signed = (-sin, sin), and the rotation is
    torch.roll(x, hd/2) = (x2, x1): the same products exactly, in three kernels instead of five.
    """
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg.rope_freq_factors is not None:   # Llama 3 frequency scaling (config.llama3_rope_factors)
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    f = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
    cos, sin = f.cos(), f.sin()
    return (torch.cat([cos, cos], -1).to(device=device, dtype=dtype),
            torch.cat([-sin, sin], -1).to(device=device, dtype=dtype))


def apply_rope(x, cos, sin_signed):
    """x (1, T, heads, hd); cos/sin_signed (T, 1, hd). Rotate-half: pairs (i, i + hd/2)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), sin_signed)


def fuse_weights(ws: list):
    """Stack weights along out_features (one launch instead of several, one Q8_1 quantization
    of the shared input), or None when their formats differ. GGUF rows and fp16 rows simply
    concatenate; AWQ packs 8 output columns per int32, so qweight/qzeros/scales concatenate
    along their column axis (every N here is a multiple of 8)."""
    if all(isinstance(w, QuantizedTensor) for w in ws):
        f0 = ws[0]
        if any(w.format != f0.format or w.params != f0.params or w.shape[1] != f0.shape[1]
               or w.device != f0.device for w in ws):
            return None
        cat = (lambda xs, axis: torch.cat(xs, axis)) if torch.is_tensor(
            next(iter(f0.arrays().values()))) else (lambda xs, axis: np.concatenate(xs, axis))
        if isinstance(f0.data, dict):
            if any(w.shape[0] % 8 for w in ws):
                return None
            data = {k: cat([w.data[k] for w in ws], 1) for k in f0.data}
        else:
            data = cat([w.data for w in ws], 0)
        return QuantizedTensor(f0.format, (sum(w.shape[0] for w in ws), f0.shape[1]), data, f0.params)
    if any(isinstance(w, QuantizedTensor) for w in ws):
        return None
    return torch.cat([torch.as_tensor(w) for w in ws], 0)


def _kind(w) -> str:
    """A weight's format as Model.formats shows it: the registry name, or the float dtype (with
    the GGUF type a loader dequantized it from, gguf_loader.dequantized_at_load)."""
    if isinstance(w, QuantizedTensor):
        return w.format
    kind = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(getattr(w, "dtype", None), "f32")
    src = getattr(w, "dequantized_from", None)
    return f"{kind} (dequantized from {src})" if src else kind


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # one linear each where fused


def _vector(t, device, dtype) -> torch.Tensor:
    """A norm weight on device in dtype, contiguous and 16-byte aligned -- a copy where the given
    tensor is not: the fused layer ops read 16 bytes at a time, and layer_ops.Repeated checks only
    the first tensors of a shape (a caller's CUDA fp16 view would otherwise be taken as it is)."""
    t = torch.as_tensor(t).to(device=device, dtype=dtype).contiguous()
    return t.clone() if t.data_ptr() % 16 else t


class Layer:
    """One decoder block's weights. On CUDA q/k/v and gate/up are fused into one linear each
    (fewer launches in the decode graph); on CPU every projection stays its own linear."""

    def __init__(self, cfg, w, i, device, dtype, mode, fuse: bool):
        p = f"model.layers.{i}."
        get = lambda n: w[p + n + ".weight"]  # noqa: E731
        L = lambda t: Linear(t, device, dtype, mode)  # noqa: E731
        V = lambda n: _vector(get(n), device, dtype)  # noqa: E731
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        src = {n: get(("self_attn." if n[0] in "qkvo" else "mlp.") + n) for n in names}
        self.kinds = {n: _kind(t) for n, t in src.items()}
        self.split_qkv = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        self.qkv = self.gate_up = None
        fq, fg = (fuse_weights([src[n] for n in group]) if fuse else None for group in FUSED)
        if fq is not None:
            self.qkv = L(fq)
        else:
            self.q, self.k, self.v = L(src["q_proj"]), L(src["k_proj"]), L(src["v_proj"])
        if fg is not None:
            self.gate_up = L(fg)
        else:
            self.gate, self.up = L(src["gate_proj"]), L(src["up_proj"])
        self.o, self.down = L(src["o_proj"]), L(src["down_proj"])
        self.attn_norm, self.mlp_norm = V("input_layernorm"), V("post_attention_layernorm")
        self.q_norm = V("self_attn.q_norm") if cfg.qk_norm else None
        self.k_norm = V("self_attn.k_norm") if cfg.qk_norm else None
        # fused path: q and k are adjacent in the qkv output, so they are normed and rotated
        # as one (heads + kv_heads, head_dim) block; the per-row norm weights stacked to match
        self.qk_norm = None
        if self.qkv is not None and cfg.qk_norm:
            self.qk_norm = torch.cat([self.q_norm.expand(cfg.num_heads, -1),
                                      self.k_norm.expand(cfg.num_kv_heads, -1)]).contiguous()

    def linears(self) -> list:
        ls = [self.qkv] if self.qkv is not None else [self.q, self.k, self.v]
        ls += [self.gate_up] if self.gate_up is not None else [self.gate, self.up]
        return ls + [self.o, self.down]

    def project_qkv(self, x):
        if self.qkv is not None:
            return self.qkv(x).split(self.split_qkv, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def mlp(self, x):
        if self.gate_up is not None:
            g, u = self.gate_up(x).chunk(2, dim=-1)
        else:
            g, u = self.gate(x), self.up(x)
        return self.down(F.silu(g) * u)


def check_device(device) -> str:
    """"cpu", "cuda" or "cuda:N" for `device` (a name or a torch.device), or a clear error: not
    a torch device, a device type the runner has no path for (meta, mps, ...), no CUDA GPU.

    A cpu index ("cpu:1") names the one CPU torch has, so it becomes "cpu": the CPU branches
    (matmul modes, the memory guard) test `device == "cpu"`."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if d.type == "cpu":
        return "cpu"
    if d.type != "cuda":   # torch knows it, but every tensor here is placed for cpu or cuda
        raise ValueError(f"device={device!r}: the runner runs on cpu, cuda or cuda:N, not on {d.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA GPU here")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:   # (torch's "invalid device ordinal", a traceback, at the first use)
        raise ValueError(f"device={device!r}: torch sees {n} CUDA GPU{'s' if n > 1 else ''} here "
                         f"(cuda:0{f' to cuda:{n - 1}' if n > 1 else ''})")
    return str(d)


def check_dtype(dtype, device: str):
    """The activation dtype the runner computes in on `device` (a check_device name): float32 on
    the CPU, float16 on CUDA (the kernels' precision). dtype None or that one is taken; any other
    is a ValueError."""
    native = torch.float16 if device.startswith("cuda") else torch.float32
    if dtype is not None and dtype != native:
        raise ValueError(f"dtype={dtype!r}: the runner computes in {native} on {device} "
                         "(float32 on CPU, float16 on CUDA: the kernels' precision)")
    return native


def _placement(cfg: ModelConfig, weights: dict, fuse: bool) -> list:
    """(weight, role) of every tensor Model places (host_memory.cpu_placement_bytes' pairs)."""
    emb = "model.embed_tokens.weight"
    fused = tuple(f"{n}.weight" for group in FUSED for n in group)
    role = lambda n: "lookup" if n == emb else "fused" if fuse and n.endswith(fused) else "linear"  # noqa: E731
    return ([(weights[n], role(n)) for n in cfg.expected_shapes()]
            + ([(weights[emb], "linear")] if cfg.tie_word_embeddings else []))


def _on_model_device(method):
    """Run a Model method with the model's GPU current (torch.cuda.device), whatever device the
    caller has current: the decode graph's capture stream, its replay and every kernel launch
    follow the current device. Free when it is current already. One thread at a time (the
    model's lock, which generate() holds for a whole generation): the KV cache, the sequence it
    holds and the decode graph's static buffers are the model's one state, and two threads'
    steps between each other's gave wrong tokens or a "skips positions" error."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return call_on_device(self._cuda_index, method, self, *args, **kwargs)
    return wrapper


class Model:
    """What load_model returns: one model with one KV cache (one sequence), used by one thread at a
    time (a second thread's call waits).

    Attributes: config (ModelConfig), tokenizer (model.tokenizer.Tokenizer, or None where the file
    has none), device ("cpu" or "cuda:N"), dtype (float32 on the CPU, float16 on CUDA), max_seq
    (the most positions a sequence may take), formats (tensor kind -> the format it runs in, as
    `quantzoo run model` prints it), fallbacks (what could not run as asked, e.g. a failed CUDA
    graph capture), matmul_mode, fused_ops, persistent.

    Token ids given to its methods are a list, numpy array or torch tensor of ints in
    0..config.vocab_size - 1 (ValueError otherwise, and for an empty one).
    generate(ids, ...) -> new ids; logits(ids) -> every position's logits; cached_prefix(ids) ->
    how much of ids the KV cache holds (generate(..., reuse_cache=True) skips that much);
    prefill / decode_step / setup_cache: the steps generate is made of.
    """

    def __init__(self, config: ModelConfig, weights: dict, tokenizer=None, device: str = "cpu",
                 max_seq: int | None = None, matmul_mode: str = "cached", cuda_graph: bool = True,
                 dtype=None, progress: bool = False, fuse: bool | None = None,
                 fused_ops: bool | None = None, pdl: bool = True, persistent: bool = False):
        check_options(max_seq=max_seq, matmul_mode=matmul_mode, cuda_graph=cuda_graph, progress=progress,
                      fuse=fuse, fused_ops=fused_ops, pdl=pdl, persistent=persistent)
        if max_seq is not None and max_seq > config.max_position:   # (it was cut to the context silently)
            raise ValueError(f"max_seq={max_seq}: the model takes at most {config.max_position} positions (its "
                             "config's context length, or the sliding window where that is shorter)")
        device = check_device(device)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        self.config, self.tokenizer, self.device = config, tokenizer, device
        self._lock = threading.RLock()   # one thread at a time (_on_model_device, generate)
        self.is_cuda = device.startswith("cuda")
        self._cuda_index = torch.device(device).index if self.is_cuda else None
        self.dtype = check_dtype(dtype, device)
        self.matmul_mode = matmul_mode
        self.use_graph = cuda_graph and self.is_cuda
        # Our kernels in the decode graph start while their predecessor finishes (programmatic
        # dependent launch, cuda/pdl.cuh; Hopper and newer); False captures plain launches (the
        # bench's comparison).
        self.pdl = bool(pdl) and self.is_cuda and torch.cuda.get_device_capability(device)[0] >= 9
        hd = config.head_dim
        self._gqa_shapes_ok = (self.is_cuda and self.dtype in (torch.float16, torch.bfloat16) and hd <= 256
                               and hd % 8 == 0 and torch.cuda.get_device_capability(device)[0] >= 8)
        cfg = config
        missing = [n for n in cfg.expected_shapes() if n not in weights]
        if missing:
            raise ValueError(f"weights: missing {missing[0]!r}" +
                             (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        fuse = self.is_cuda if fuse is None else fuse
        if device == "cpu":   # float32 there: refuse what cannot fit before the OOM killer does
            check_cpu_placement(_placement(cfg, weights, fuse), matmul_mode)
        self.embed = Embedding(weights["model.embed_tokens.weight"], device, self.dtype)
        it = range(cfg.num_layers)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc=f"placing layers on {device}", unit="layer", leave=False)
        self.layers = [Layer(cfg, weights, i, device, self.dtype, matmul_mode, fuse) for i in it]
        self.norm = _vector(weights["model.norm.weight"], device, self.dtype)
        head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = Linear(head, device, self.dtype, matmul_mode)
        self.max_seq = int(max_seq or cfg.max_position)
        self.formats = self._formats()
        self.fallbacks = sorted({ln.fallback for ln in self._all_linears() if ln.fallback})
        self.fused_ops, why = self._fused_ops_status(fused_ops)
        if why and fused_ops:
            raise ValueError(f"fused_ops=True: {why}")
        self._repeated = layer_ops.Repeated()
        self.k_cache = self.v_cache = None
        self._graph, self._seq = None, []
        # one-token steps through the persistent decode kernel (kernels.persistent: all decoder
        # layers in one launch; experimental, slower than the per-op graph on the H100)
        self.persistent, self._persistent = False, None
        self.use_persistent(persistent)
        # fused ops: a norm or SiLU feeding a GGUF linear on mmvq (M <= 8 unless wgmma takes it:
        # Linear.q8_1_layout) writes its output in Q8_1 too, and the linear skips its quantize
        # launch (bit-identical; False: the linear quantizes its fp16 input). Not the decode
        # attention: fused there it cost what it saved (session 14).
        self.q8_1_fusion = True

    # ---- bookkeeping ----------------------------------------------------------------------
    @_on_model_device
    def use_persistent(self, on: bool) -> None:
        """Decode one-token steps through the persistent kernel (True) or one launch per op
        (False). Raises ValueError naming what the model lacks for it (kernels.persistent)."""
        from ..kernels.persistent import PersistentDecode

        on = check_bool(on, "use_persistent: on")
        if on:
            why = PersistentDecode.why_not(self)
            if why:
                raise ValueError(f"persistent=True: {why}")
        self.persistent, self._graph = on, None
        self._persistent = PersistentDecode(self) if on and self.k_cache is not None else None

    def _fused_ops_status(self, want) -> tuple[bool, str | None]:
        """Whether _forward uses the fused CUDA layer ops, and if not, why (None: not asked)."""
        if want is False:
            return False, None
        if not self.is_cuda or self.dtype != torch.float16:
            return False, "the fused layer ops run on CUDA in float16"
        if any(lay.qkv is None or lay.gate_up is None for lay in self.layers):
            return False, "q/k/v or gate/up projections could not be fused (their formats differ)"
        cfg = self.config
        why = layer_ops.supports(cfg.hidden_size, cfg.intermediate_size, cfg.head_dim,
                                 cfg.num_heads, cfg.num_kv_heads)
        return why is None, why

    def _all_linears(self):
        for lay in self.layers:
            yield from lay.linears()
        yield self.lm_head

    def _formats(self) -> dict:
        kinds: dict[str, list] = {}
        for lay in self.layers:
            for k, f in lay.kinds.items():
                kinds.setdefault(k, [])
                if f not in kinds[k]:
                    kinds[k].append(f)
        out = {"embed_tokens": self.embed.format}
        out.update({k: "/".join(v) for k, v in kinds.items()})
        out["lm_head"] = self.lm_head.format + (" (tied to embed_tokens)" if self.config.tie_word_embeddings else "")
        out["norms"] = {torch.float16: "f16", torch.float32: "f32"}.get(self.dtype, str(self.dtype))
        return out

    def weight_bytes(self, include_embedding: bool = False) -> int:
        """Bytes of every linear's weight as placed (a CPU "cached" linear: its float32 copy),
        lm_head included; the embedding table too with include_embedding."""
        n = sum(ln.nbytes for ln in self._all_linears())
        if include_embedding and self.embed.table is not None:
            n += self.embed.table.numel() * self.embed.table.element_size()
        return n

    # ---- KV cache ---------------------------------------------------------------------------
    @_on_model_device
    def setup_cache(self, max_seq: int | None = None, keep: bool = False):
        """(Re)allocate the KV cache for max_seq positions (drops a captured graph); a cache of
        that size already there is kept as it is. keep: the current sequence's rows move into the
        new cache (when they fit in it, and both caches fit in memory at once), so a generation
        with reuse_cache=True can continue it; otherwise the new cache holds no sequence. Returns
        the cache's positions. ValueError for a max_seq outside 1..self.max_seq; MemoryError where
        the cache would not fit in the memory left."""
        cfg = self.config
        if max_seq is not None and (not is_int(max_seq) or not 0 < max_seq <= self.max_seq):
            raise ValueError(f"setup_cache: max_seq={max_seq!r} must be a number of positions 1..{self.max_seq} "
                             "(the model's max_seq), or None for all of them")
        n = int(max_seq or self.max_seq)
        if self.k_cache is not None and self.k_cache.shape[3] == n:
            return n
        shape = (cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim)
        nbytes = cfg.kv_cache_bytes(n, self.dtype.itemsize)
        # the sequence counts as written only once the new cache is whole (an interrupt or an
        # error part way leaves no cache and no sequence)
        seq, self._seq = self._seq, []
        old = (self.k_cache, self.v_cache) if keep and self.k_cache is not None and 0 < len(seq) <= n else None
        # the graph, the persistent plan and the work hold the old cache too; without keep its
        # memory goes before the new one is counted and allocated
        self.k_cache = self.v_cache = self._graph = self._persistent = self._decode_work = None
        try:
            try:
                check_cache_fits(nbytes, n, self.device)
            except MemoryError:
                if old is None:
                    raise
                old = None   # not both at once: the sequence goes, the new cache may fit alone
                check_cache_fits(nbytes, n, self.device)
            self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
            if old is not None:   # the current sequence's rows move over
                self.k_cache[:, :, :, :len(seq)].copy_(old[0][:, :, :, :len(seq)])
                self.v_cache[:, :, :, :len(seq)].copy_(old[1][:, :, :, :len(seq)])
            self.cos, self.sin = rope_tables(cfg, n, self.device, self.dtype)
            if self.fused_ops:
                from ..kernels.gguf import MMVQ_COLS
                from ..kernels.layer_ops import DecodeWork

                self._decode_work = DecodeWork(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, n, self.device)
                # Q8_1 of a norm's or SiLU's output, for GGUF linears at M <= MMVQ_COLS (_forward_fused)
                widest = max(cfg.hidden_size, cfg.intermediate_size)
                self._q8 = torch.empty(MMVQ_COLS * widest // 32 * 36, dtype=torch.uint8, device=self.device)
                if self.persistent:
                    from ..kernels.persistent import PersistentDecode

                    self._persistent = PersistentDecode(self)   # points at this cache
        except BaseException:
            self.k_cache = self.v_cache = self._persistent = self._decode_work = None
            raise
        if old is not None:
            self._seq = seq
        return n

    @property
    def _length(self) -> int:
        """Positions of the current sequence written to the cache."""
        return len(self._seq)

    def cached_prefix(self, ids) -> int:
        """How many leading ids the KV cache already holds: the length of the common prefix of ids
        and the current sequence (the tokens written at positions 0, 1, ..; a token a greedy
        look-ahead step fed from the GPU counts as unknown until generate() learns it)."""
        n = 0
        for a, b in zip(self._seq, ids):
            if a is None or a != b:
                break
            n += 1
        return n

    def fed(self, start: int, tokens) -> None:
        """Tell the sequence which tokens the steps at positions start.. were fed (where a step
        took its token from the GPU, cached_prefix counted it unknown)."""
        for i, t in enumerate(tokens):
            if start + i < len(self._seq) and self._seq[start + i] is None:
                self._seq[start + i] = int(t)

    def kv_cache_bytes(self) -> int:
        """Bytes of the K and V caches allocated now (0 while there is none)."""
        return 0 if self.k_cache is None else 2 * self.k_cache.numel() * self.k_cache.element_size()

    # ---- forward ------------------------------------------------------------------------------
    def _attend(self, q, kc, vc, T: int, from_start: bool, mask):
        """SDPA over the cache: q (1, T, H, hd), kc/vc (1, KV, S, hd) -> (1, T, H*hd)."""
        H, KV = self.config.num_heads, self.config.num_kv_heads
        G, hd = H // KV, q.shape[-1]
        if from_start:
            # causal over the first T rows. Where SDPA's fused kernels (cuDNN, flash) take
            # grouped heads themselves (CUDA, fp16/bf16; _fused_gqa) they go in as they are;
            # elsewhere K/V are repeated per query head (T rows, cheap), so that no backend
            # falls back to the math path's (H, T, T) score matrix. The grouped route picks
            # the same cuDNN kernel on the H100, bit-identical, without the two copy kernels
            # and ~25 us of host time per layer (bench/NOTES.md, session 11).
            kr, vr = kc[:, :, :T], vc[:, :, :T]
            if G > 1 and self._fused_gqa():
                a = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=True, enable_gqa=True)
                return a.transpose(1, 2).reshape(1, T, H * hd)
            if G > 1:
                kr, vr = kr.repeat_interleave(G, dim=1), vr.repeat_interleave(G, dim=1)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=True)
            return a.transpose(1, 2).reshape(1, T, H * hd)
        # GQA without copying the cache per head: the G query heads sharing a KV head
        # become G*T query rows of that head (head h = kv*G + g, as HF's repeat_kv).
        qg = q.reshape(1, T, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(1, KV, G * T, hd)
        a = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask)
        return a.view(1, KV, G, T, hd).permute(0, 3, 1, 2, 4).reshape(1, T, H * hd)

    def _fused_gqa(self) -> bool:
        """Whether SDPA's fused kernels take this model's grouped heads directly (enable_gqa):
        CUDA on compute capability >= 8.0, fp16 / bf16, head_dim <= 256, and the flash or the
        cuDNN backend enabled (the memory-efficient one does not take grouped heads)."""
        b = torch.backends.cuda
        return self._gqa_shapes_ok and (b.flash_sdp_enabled() or b.cudnn_sdp_enabled())

    def _mask(self, pos):
        """(G*T, S) bool: row g*T + t of the grouped queries sees keys at positions <= pos[t]."""
        G = self.config.num_heads // self.config.num_kv_heads
        S = self.k_cache.shape[3]
        return (torch.arange(S, device=pos.device)[None, :] <= pos[:, None]).repeat(G, 1)

    def _forward_fused(self, ids, pos, all_logits: bool, from_start: bool) -> torch.Tensor:
        """_forward on CUDA with the per-layer small ops fused (quantzoo.kernels.layer_ops):
        add+RMSNorm, q/k-norm+RoPE+KV-cache write, SiLU*up, and for one token the split-cache
        decode attention -- the same arithmetic as _forward, ~10 launches per layer fewer. A GGUF
        linear on mmvq (M <= 8, where wgmma does not take it) gets its input in Q8_1 from the op
        before it (q8_1_fusion)."""
        from ..kernels import layer_ops as lo

        rep = self._repeated   # the layer ops, checked once per shape (layer_ops.Repeated)
        cfg = self.config
        T, eps = ids.shape[0], cfg.rms_norm_eps
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        mask = None if from_start or T == 1 else self._mask(pos)
        h = self.embed(ids).reshape(T, -1)          # the residual stream, updated in place
        delta = None
        q8 = self._q8 if self.q8_1_fusion else None

        def norm_into(lin, h, delta, w, glu=False):
            # h += delta, RMSNorm, lin (glu: lin.glu): in Q8_1 where lin takes it
            lq = lin.q8_1_layout(h.shape[0], glu) if q8 is not None else None
            if lq is None:
                return lin.planned(rep.add_rms_norm(h, delta, w, eps), glu, rep.silu_mul)
            xq = q8[: h.numel() // 32 * 36]
            rep.add_rms_norm(h, delta, w, eps, xq, lq)
            y = lin.from_q8_1(xq, h.shape[0], lq)
            return rep.silu_mul(y) if glu else y

        layers = self.layers
        if T == 1 and self._persistent is not None:
            self._persistent.run(h, pos)   # every decoder layer in one launch; h += both deltas
            layers = ()
        for li, lay in enumerate(layers):
            qkv = norm_into(lay.qkv, h, delta, lay.attn_norm)
            kc, vc = self.k_cache[li, 0], self.v_cache[li, 0]            # (KV, S, hd)
            q = rep.qk_rope_store(qkv, lay.qk_norm, self.cos, self.sin, pos, kc, vc, H, KV, eps)
            if T == 1:
                a = lo.attn_decode(q, kc, vc, pos, self._decode_work)
            else:
                a = self._attend(q[None], kc[None], vc[None], T, from_start, mask).reshape(T, H * hd)
            lq = lay.down.q8_1_layout(T) if q8 is not None else None
            if lq is None or lay.gate_up.gguf_fp16_input(T, glu=True):
                # silu(gate) * up fused into the gate/up matmul where it can be (a GGUF gate/up on
                # the wgmma path keeps its GLU epilogue even where down would take Q8_1: down
                # quantizes its input; a gate/up of another kind beside it feeds silu_mul's Q8_1)
                delta = lay.down.planned(norm_into(lay.gate_up, h, lay.o.planned(a), lay.mlp_norm, glu=True))
            else:            # silu(gate) * up written in Q8_1 for down's GEMV
                gu = norm_into(lay.gate_up, h, lay.o.planned(a), lay.mlp_norm)
                xq = q8[: T * gu.shape[1] // 64 * 36]
                rep.silu_mul(gu, xq, lq)
                delta = lay.down.from_q8_1(xq, T, lq)
        if not all_logits:
            h, delta = h[-1:], (None if delta is None else delta[-1:])
        return norm_into(self.lm_head, h, delta, self.norm)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, all_logits: bool,
                 from_start: bool = False) -> torch.Tensor:
        """ids (T,) at positions pos (T,) (int64 tensors on the device) -> logits (T or 1, V).

        Attention runs over the whole cache with a mask built from pos, so the same code
        serves prefill, eager decode and graph capture (no Python ints depend on pos). A
        prompt that starts at position 0 (`from_start`) attends to the first T cache rows with
        is_causal instead, which lets SDPA pick its flash kernel for long prefills.
        """
        if self.fused_ops:
            return self._forward_fused(ids, pos, all_logits, from_start)
        cfg = self.config
        T = ids.shape[0]
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]        # (T, 1, hd)
        mask = None if from_start else self._mask(pos)
        h = self.embed(ids)[None]                                        # (1, T, hidden)
        for li, lay in enumerate(self.layers):
            x = rms_norm(h, lay.attn_norm, cfg.rms_norm_eps)
            if lay.qkv is not None:   # one norm + one RoPE over the q and k heads together
                qkv = lay.qkv(x)
                qk = qkv[..., :(H + KV) * hd].view(1, T, H + KV, hd)
                v = qkv[..., (H + KV) * hd:].view(1, T, KV, hd)
                if lay.qk_norm is not None:
                    qk = rms_norm(qk, None, cfg.rms_norm_eps) * lay.qk_norm
                qk = apply_rope(qk, cos, sin)
                q, k = qk[:, :, :H], qk[:, :, H:]
            else:
                q, k, v = lay.project_qkv(x)
                q, k, v = q.view(1, T, H, hd), k.view(1, T, KV, hd), v.view(1, T, KV, hd)
                if lay.q_norm is not None:
                    q = rms_norm(q, lay.q_norm, cfg.rms_norm_eps)
                    k = rms_norm(k, lay.k_norm, cfg.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]                  # (1, KV, S, hd)
            kc.index_copy_(2, pos, k.transpose(1, 2))
            vc.index_copy_(2, pos, v.transpose(1, 2))
            a = self._attend(q, kc, vc, T, from_start, mask)
            h = h + lay.o(a)
            h = h + lay.mlp(rms_norm(h, lay.mlp_norm, cfg.rms_norm_eps))
        h = h[0] if all_logits else h[0, -1:]
        return self.lm_head(rms_norm(h, self.norm, cfg.rms_norm_eps))

    @_on_model_device
    @torch.inference_mode()
    def prefill(self, ids, start: int = 0) -> torch.Tensor:
        """Run tokens at positions start.. through the model (one batched pass), writing their K/V
        into the cache; returns the last position's next-token logits (vocab_size,) on the model's
        device in its dtype. start > 0 continues the sequence the cache holds (ValueError where it
        skips positions, or there is none); the cache is (re)sized as needed from start 0."""
        ids = token_ids(ids, self.config.vocab_size)
        if not is_int(start) or start < 0:
            raise ValueError(f"start={start!r}: a position >= 0")
        if start and self.k_cache is None:
            raise ValueError(f"prefill: start={start} continues a sequence, but there is no KV cache yet; "
                             "prefill from start=0 first")
        if start > self._length:   # (it would attend to cache rows no token of this sequence wrote)
            raise ValueError(f"prefill: start={start} skips positions {self._length}..{start - 1}; this sequence "
                             f"holds {self._length} (continue at start <= {self._length})")
        start = int(start)
        end = start + len(ids)
        if end > self.max_seq:
            raise ValueError(f"{end} positions exceed the model's max_seq {self.max_seq}")
        if self.k_cache is None or (start == 0 and end > self.k_cache.shape[3]):   # (re)size it
            self.setup_cache(min(self.max_seq, -(-end // 256) * 256))
        if end > self.k_cache.shape[3]:
            raise ValueError(f"{end} positions do not fit the KV cache ({self.k_cache.shape[3]}) that "
                             "holds this sequence; prefill from start=0 with a longer prompt")
        del self._seq[start:]   # (rows from start on are rewritten: an interrupted pass leaves them unknown)
        t = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        out = self._forward(t, pos, all_logits=False, from_start=start == 0)[-1]
        self._seq.extend(ids)
        return out

    @_on_model_device
    @torch.inference_mode()
    def decode_step(self, token: int | torch.Tensor, pos: int) -> torch.Tensor:
        """One token at position pos -> its next-token logits (vocab_size,) on the model's device in
        its dtype. Replays a CUDA graph on GPU. Needs a cache (prefill first) and pos at most the
        sequence's length (ValueError otherwise)."""
        if self.k_cache is None:
            raise ValueError("decode_step: no KV cache yet; run prefill first")
        if not is_int(pos) or not 0 <= pos < self.k_cache.shape[3]:
            raise ValueError(f"position {pos!r} is not in the KV cache (0..{self.k_cache.shape[3] - 1})")
        pos = int(pos)
        if pos > self._length:   # (it would attend to cache rows no token of this sequence wrote)
            raise ValueError(f"decode_step: position {pos} skips positions {self._length}..{pos - 1}; this "
                             f"sequence holds {self._length} (the next step is at {self._length})")
        if torch.is_tensor(token) and token.numel() != 1:
            raise ValueError(f"token: a tensor of {token.numel()} elements; one token id is needed")
        # A GPU tensor (an argmax, as generate's look-ahead feeds) is taken as it is: checking its
        # value would wait for the GPU (the sequence records it as unknown: cached_prefix). Anything
        # else is checked as an id.
        on_gpu = torch.is_tensor(token) and token.device.type == "cuda"
        if not on_gpu:
            token = token_ids([token.item() if torch.is_tensor(token) else token], self.config.vocab_size, "token")[0]
        del self._seq[pos:]   # (row pos is rewritten: an interrupted step leaves it unknown)
        if not self.use_graph:
            ids = (token.reshape(1).to(self.device) if torch.is_tensor(token) else
                   torch.as_tensor([int(token)], dtype=torch.int64, device=self.device))
            out = self._forward(ids, torch.tensor([pos], device=self.device), False)[-1]
        else:
            if self._graph is None:
                self.ensure_graph()
                if not self.use_graph:
                    return self.decode_step(token, pos)
            self._g_tok.fill_(int(token)) if not torch.is_tensor(token) else self._g_tok.copy_(token.reshape(1))
            self._g_pos.fill_(pos)
            self._graph.replay()
            out = self._g_out[-1]
        self._seq.append(None if on_gpu else int(token))
        return out

    @_on_model_device
    def ensure_graph(self):
        """Capture the decode graph if needed; if capture fails (a kernel that cannot be
        captured), decode eagerly from then on and say so in `fallbacks`."""
        if not self.use_graph or self._graph is not None:
            return
        try:
            with torch.inference_mode():
                self._capture()
        except Exception as e:
            self._graph = None
            self.use_graph = False
            self.fallbacks.append(f"CUDA graph capture failed ({type(e).__name__}: {e}); eager decode")
            torch.cuda.synchronize(self.device)

    def _capture(self):
        """Capture one decode step into a CUDA graph. The warm-up runs (kernel compiles,
        cuBLAS workspaces) write K/V at the last cache position, which the mask hides until a
        real step at that position overwrites it (and which the sequence stops holding)."""
        del self._seq[self.k_cache.shape[3] - 1:]
        self._g_tok = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._g_pos = torch.full((1,), self.k_cache.shape[3] - 1, dtype=torch.int64, device=self.device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up: kernel compiles, allocator, cuBLAS handles
                self._forward(self._g_tok, self._g_pos, False)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        # captured on s, a stream of this model's device: torch.cuda.graph's default capture
        # stream is made once per process, on whichever device was current then, and entering it
        # makes that device current -- a second model's kernels then left the capture (on
        # another GPU: an empty graph, a decode of zeros). capture_error_mode "thread_local": in
        # torch's default ("global") another thread's cudaMalloc during the capture (a second
        # model's prefill) failed there and broke this capture, leaving this model eager for good
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"), programmatic_launches(self.pdl):
            self._g_out = self._forward(self._g_tok, self._g_pos, False)
        self._graph = g

    @_on_model_device
    def logits(self, ids) -> torch.Tensor:
        """Teacher-forced next-token logits for every position: (len(ids), vocab_size) float32 CPU;
        row i predicts ids[i + 1]. The cache then holds ids (cached_prefix sees them). ValueError
        for bad ids or more than max_seq of them."""
        ids = token_ids(ids, self.config.vocab_size)
        if len(ids) > self.max_seq:
            raise ValueError(f"{len(ids)} ids exceed the model's max_seq {self.max_seq}")
        with torch.inference_mode():
            if self.k_cache is None or self.k_cache.shape[3] < len(ids):
                self.setup_cache(max(len(ids), self.k_cache.shape[3] if self.k_cache is not None else 0))
            t = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
            pos = torch.arange(len(ids), device=self.device)
            self._seq = []
            out = self._forward(t, pos, all_logits=True, from_start=True)
            self._seq = list(ids)
        # copied outside inference mode: an inference tensor refuses in-place edits (masking a
        # token) and autograd, and on CPU .float().cpu() would hand back that very tensor
        return out.to(device="cpu", dtype=torch.float32, copy=True)

    @_on_model_device
    def generate(self, ids, max_new_tokens: int = 48, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop=None, stream=None, **kw) -> list[int]:
        """Prefill ids, then decode up to max_new_tokens new token ids and return them (list of int;
        the end-of-generation id included where one ended it, as is the token that completed a
        stop string).

        temperature 0 (default) is greedy; > 0 samples, filtered by top_k (0 = off), top_p (1 = off)
        and kw min_p (0 = off) in transformers' order, seeded by seed (None: unseeded). Those four
        need temperature > 0 (ValueError otherwise). stop: a str or list of str, ending generation
        where the decoded text holds one; stream: a callable given each piece of new text as it
        becomes final (both need a tokenizer). kw: min_p; eos_token_ids (default
        tokenizer.eos_token_ids); reuse_cache=True (prefill only what follows the part of ids the
        KV cache holds: cached_prefix); look_ahead (greedy CUDA decode queued ahead of the host;
        None = on there). quantzoo.model.generate.generate is the same call returning a Generation
        (text, stop_reason, timings). ValueError for bad ids or settings, or a prompt +
        max_new_tokens past max_seq; TypeError for another keyword."""
        from .generate import generate

        return generate(self, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, stop=stop, stream=stream, **kw).tokens


def check_options(**opts) -> None:
    """One clear error for an option of Model (load_model's **opts) that it does not take or that
    holds a bad value; checked before a model is loaded (minutes for a large one)."""
    import inspect

    takes = [p for p in inspect.signature(Model.__init__).parameters
             if p not in ("self", "config", "weights", "tokenizer", "device")]
    unknown = sorted(set(opts) - set(takes))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the model takes {takes}")
    if opts.get("matmul_mode", "cached") not in MATMUL_MODES:
        raise ValueError(f"matmul_mode={opts['matmul_mode']!r}: choose one of {MATMUL_MODES}")
    max_seq = opts.get("max_seq")
    if max_seq is not None and (not is_int(max_seq) or max_seq <= 0):
        raise ValueError(f"max_seq={max_seq!r}: a positive number of positions, or None for the config's")
    for name in ("cuda_graph", "progress", "pdl", "persistent", "fuse", "fused_ops"):
        if name in opts:   # (bool("no") is True: a switch read backwards)
            check_bool(opts[name], name, none_ok=name in ("fuse", "fused_ops"))


def build_model(config: ModelConfig, weights: dict, tokenizer=None, device: str = "cpu", **opts) -> Model:
    """Model from a config and a LoadedWeights dict (HF names; see quantzoo/model/config.py).

    opts: max_seq (the largest KV cache the model may allocate, default the context length, at
    most that; the cache itself is sized on demand: prompt + new tokens rounded up to 256), matmul_mode
    ("cached" | "dequant" | "emulate", CPU only), cuda_graph (default True on CUDA), fuse
    (q/k/v and gate/up as one linear each; default on CUDA), fused_ops (norms, RoPE + cache
    write, SiLU and decode attention as fused CUDA kernels; default on CUDA when the shapes
    allow, False = the torch ops), pdl (the decode graph's kernels launched with programmatic
    dependent launch, default True), persistent (one-token steps of a GGUF model through the
    experimental persistent decode kernel, Model.use_persistent; default False), dtype
    (activation dtype: None or the device's own, float32 on the CPU, float16 on CUDA; any other
    is refused), progress (tqdm while placing layers). matmul_mode is not used on CUDA.
    """
    return Model(config, weights, tokenizer, device, **opts)
