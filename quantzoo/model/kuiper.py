"""KuiperLLama's Qwen3 AWQ `.bin` ("ak48", seed 000 §8.1): import and export.

Layout (little endian, no alignment between header fields):

    offset  size  field
    0x00    u32   magic 0x616b3438 ("ak48")
    0x04    i32   version 5
    0x08    7xi32 dim, hidden_dim (FFN intermediate), n_layers, n_heads, n_kv_heads,
                  vocab_size, max_seq_len
    0x24    u8    shared_classifier (1: lm_head tied to the embeddings)
    0x25    i32   head_dim
    0x29    i32   group_size
    ...     zero padding up to 256 bytes

    region A (fp16): input_layernorm x L, post_attention_layernorm x L, model.norm,
                     embed_tokens [vocab, dim]
    region B (AWQ):  for each of q, k, v, o, gate (w1), down (w2), up (w3), all L layers in
                     turn: qweight int32 [in, out/8], qzeros int32 [in/G, out/8],
                     scales fp16 [in/G, out]  (the HF "gemm" layout, DESIGN.md §3)
    region C (fp16): lm_head [vocab, dim] unless shared, q_norm x L, k_norm x L (head_dim each)

The seed's header example shows 14336 for hidden_dim (Llama-3's); Qwen3-8B's is 12288: every
dim is read from the file, and the file's size must equal what the header implies.
The header carries neither rope_theta nor rms_norm_eps: the engine hard-codes Qwen3's
(1e6 and 1e-6), and so do we unless told otherwise; an export of a model with other values is
refused (written, it would come back with Qwen3's and compute other logits). A tokenizer.json beside the file (the HF
model directory the .bin was exported from) is loaded when present.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path

import numpy as np

MAGIC = 0x616B3438
VERSION = 5
HEADER_BYTES = 256
_HEAD = struct.Struct("<Ii7iBii")          # 45 bytes, packed like the exporter's struct.pack calls
# region B order: (HF module, KuiperLLama name)
B_ORDER = (("self_attn.q_proj", "wq"), ("self_attn.k_proj", "wk"), ("self_attn.v_proj", "wv"),
           ("self_attn.o_proj", "wo"), ("mlp.gate_proj", "w1"), ("mlp.down_proj", "w2"),
           ("mlp.up_proj", "w3"))
DEFAULT_ROPE_THETA = 1e6
DEFAULT_RMS_EPS = 1e-6
I32_MAX = 2**31 - 1     # every header field is an i32, and so is every tensor dim in the engine


def _layout(config, group_size: int):
    """[(name, kind, shape, dtype)] in file order; kind 'f16' or the AWQ field name."""
    c, L, g = config, config.num_layers, group_size
    h, v = c.hidden_size, c.vocab_size
    items = []
    for i in range(L):
        items.append((f"model.layers.{i}.input_layernorm.weight", (h,), np.float16))
    for i in range(L):
        items.append((f"model.layers.{i}.post_attention_layernorm.weight", (h,), np.float16))
    items.append(("model.norm.weight", (h,), np.float16))
    items.append(("model.embed_tokens.weight", (v, h), np.float16))
    shapes = c.expected_shapes()
    for module, _ in B_ORDER:
        for i in range(L):
            m = f"model.layers.{i}.{module}"
            n, k = shapes[m + ".weight"]
            items.append((m + ".qweight", (k, n // 8), np.int32))
            items.append((m + ".qzeros", (k // g, n // 8), np.int32))
            items.append((m + ".scales", (k // g, n), np.float16))
    if not c.tie_word_embeddings:
        items.append(("lm_head.weight", (v, h), np.float16))
    for i in range(L):
        items.append((f"model.layers.{i}.self_attn.q_norm.weight", (c.head_dim,), np.float16))
    for i in range(L):
        items.append((f"model.layers.{i}.self_attn.k_norm.weight", (c.head_dim,), np.float16))
    return items


def read_header(path) -> dict:
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the 256-byte KuiperLLama header")
    (magic, version, dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, max_seq, shared,
     head_dim, group_size) = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"{path}: magic 0x{magic:08x} is not KuiperLLama's AWQ 0x{MAGIC:08x} ('ak48')")
    if version != VERSION:
        raise ValueError(f"{path}: header version {version}; only version {VERSION} (AWQ INT4) is supported")
    if shared not in (0, 1):   # a flag byte: another value is a corrupt header, not "tied"
        raise ValueError(f"{path}: header shared_classifier={shared}; must be 0 (lm_head stored) "
                         "or 1 (lm_head tied to the embeddings)")
    return dict(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv_heads, vocab_size=vocab, max_seq_len=max_seq,
                shared_classifier=bool(shared), head_dim=head_dim, group_size=group_size)


def load_kuiper(path, rope_theta: float = DEFAULT_ROPE_THETA, rms_norm_eps: float = DEFAULT_RMS_EPS,
                eos_token_ids=None):
    """.bin -> (ModelConfig, weights, Tokenizer | None); arrays are copy-on-write memory maps."""
    from quantzoo.formats import get
    from quantzoo.formats.awq import GROUP_SIZES, check_shape

    from .config import ModelConfig, check_finite
    from .export import linear_modules
    from .hf_loader import load_tokenizer

    path = Path(path)
    hd = read_header(path)
    if hd["group_size"] not in GROUP_SIZES:
        raise ValueError(f"{path}: header group_size={hd['group_size']}; supported {GROUP_SIZES}")
    try:
        config = ModelConfig(
            arch="qwen3", vocab_size=hd["vocab_size"], hidden_size=hd["dim"],
            intermediate_size=hd["hidden_dim"], num_layers=hd["n_layers"], num_heads=hd["n_heads"],
            num_kv_heads=hd["n_kv_heads"], head_dim=hd["head_dim"], rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta, max_position=hd["max_seq_len"],
            tie_word_embeddings=hd["shared_classifier"], qk_norm=True, bos_token_id=None,
            eos_token_ids=list(eos_token_ids or []))
        # one layer's shapes stand for all (every layer has the same); the size check below is
        # in closed form, so a corrupt n_layers fails at once instead of looping over it
        # the widths the header implies but does not store: a linear wider than an i32 is no
        # model (heads = 2^30 in a crafted file had wrapped the size check's int64 products)
        for field, heads in (("n_heads", config.num_heads), ("n_kv_heads", config.num_kv_heads)):
            if heads * config.head_dim > I32_MAX:
                raise ValueError(f"{field}*head_dim = {heads}*{config.head_dim} = {heads * config.head_dim} "
                                 f"is past {I32_MAX}, the largest tensor dim of the format")
        one = dataclasses.replace(config, num_layers=1)
        shapes = one.expected_shapes()
        for m in linear_modules(one):   # the AWQ format's own shape rule, per linear
            check_shape(*shapes[m + ".weight"], hd["group_size"], f"{m}.weight")
    except ValueError as e:
        raise ValueError(f"{path}: header: {e}") from None

    def data_bytes(layers: int) -> int:   # Python ints (np.prod is int64: a crafted header wraps it)
        return sum(math.prod(s) * np.dtype(d).itemsize
                   for _, s, d in _layout(dataclasses.replace(config, num_layers=layers), hd["group_size"]))

    first = data_bytes(1)
    need = HEADER_BYTES + first + (config.num_layers - 1) * (data_bytes(2) - first)
    size = path.stat().st_size
    if size != need:
        raise ValueError(f"{path}: {size} bytes, but the header (dim={hd['dim']}, hidden_dim="
                         f"{hd['hidden_dim']}, layers={hd['n_layers']}, vocab={hd['vocab_size']}, "
                         f"group_size={hd['group_size']}) implies {need}: "
                         f"{'truncated' if size < need else 'trailing bytes'}")
    items = _layout(config, hd["group_size"])
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    raw, off = {}, HEADER_BYTES
    for name, shape, dtype in items:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        raw[name] = mm[off:off + nbytes].view(dtype).reshape(shape)
        off += nbytes
    import torch

    awq = get("awq")
    weights = {}
    for name, shape, dtype in items:
        if name.endswith(".qweight"):
            m = name[: -len(".qweight")]
            weights[m + ".weight"] = check_finite(awq.from_arrays(
                raw[m + ".qweight"], raw[m + ".qzeros"], raw[m + ".scales"], hd["group_size"]), str(path), m + ".scales")
        elif name.endswith(".weight"):
            weights[name] = check_finite(torch.from_numpy(raw[name]), str(path), name)
    tok = load_tokenizer(path.parent)
    if tok is not None and not config.eos_token_ids:
        config.eos_token_ids = list(tok.eos_token_ids)
    config.check_tokenizer(tok, str(path), strict=False)
    return config, weights, tok


def write_kuiper(src, dst, group_size: int = 128, progress: bool = True) -> Path:
    """Source (export.Source) -> .bin; AWQ linears quantized by the registry's codec."""
    from tqdm import tqdm

    from .export import _fp16, check_dims_fit, check_group_size

    c = src.config
    if c.arch != "qwen3" or not c.qk_norm:
        raise ValueError(f"KuiperLLama's ak48 .bin is a Qwen3 format (q_norm/k_norm regions); "
                         f"the source is arch {c.arch!r}")
    # what a reader of the file will assume, since the header has no field for either
    for name, implied in (("rope_theta", DEFAULT_ROPE_THETA), ("rms_norm_eps", DEFAULT_RMS_EPS)):
        v = getattr(c, name)
        # (up to float32 rounding: a GGUF source stores them as F32, 1e-6 as 9.9999997e-07)
        if not math.isclose(v, implied, rel_tol=1e-6):
            raise ValueError(f"{src.path}: {name}={v:g}, but a KuiperLLama .bin implies {implied:g} "
                             f"(its header cannot carry {name}); export this model to a .gguf or an HF "
                             "directory instead")
    if c.rope_freq_factors is not None:
        raise ValueError(f"{src.path}: its RoPE frequency scaling (Llama 3 style) has no field in a "
                         "KuiperLLama .bin header; export this model to a .gguf or an HF directory instead")
    check_group_size(c, group_size)
    items = _layout(c, group_size)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    check_dims_fit(c, src.path, 2**31, "the .bin header's int32 field")
    header = _HEAD.pack(MAGIC, VERSION, c.hidden_size, c.intermediate_size, c.num_layers,
                        c.num_heads, c.num_kv_heads, c.vocab_size, c.max_position,
                        int(c.tie_word_embeddings), c.head_dim, group_size)
    # Written beside DST and renamed over it when complete, as write_gguf does: a failed export
    # (a NaN in a weight, a full disk) leaves an existing DST as it was and no partial file, and
    # DST never truncates the file the source is memory-mapped from (SRC and DST hard links to
    # one .bin: "wb" on DST had emptied the source under its own map, a Bus error).
    tmp = dst.with_name(dst.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(header + b"\0" * (HEADER_BYTES - len(header)))
            cache = {}
            for name, shape, dtype in tqdm(items, desc=f"writing {dst.name}", unit="tensor",
                                           disable=not progress, leave=False):
                if name.endswith((".qweight", ".qzeros", ".scales")):
                    m, key = name.rsplit(".", 1)
                    if m not in cache:
                        cache = {m: src.quantized(m + ".weight", "awq", group_size=group_size).data}
                    arr = cache[m][key]
                else:
                    arr = _fp16(src.tensor(name), name)
                assert arr.shape == shape and arr.dtype == dtype, (name, arr.shape, arr.dtype)
                f.write(np.ascontiguousarray(arr).tobytes())
        tmp.replace(dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst
