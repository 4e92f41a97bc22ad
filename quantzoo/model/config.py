"""ModelConfig: the few numbers that define a Qwen3 / llama decoder (DESIGN.md §5)."""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field

import numpy as np

ARCHS = ("qwen3", "llama")


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A finite real number (numpy's too), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def positive(v, kind, what: str):
    """v as a positive int (kind int) or a positive finite float (kind float), or one clear error
    naming it (what: the file and the key)."""
    if not (is_int(v) if kind is int else is_real(v)) or not v > 0:
        raise ValueError(f"{what}={v!r} must be a positive {'integer' if kind is int else 'number'}")
    return kind(v)


def token_ids(ids, vocab_size: int, what: str = "ids", bound: str | None = None,
              empty_ok: bool = False) -> list[int]:
    """ids (a sequence of ints, a 1-D integer tensor or array) as a non-empty (or, empty_ok, any)
    list of ints, each a row of the vocab_size-row embedding; else one clear error. bound: what
    an id past vocab_size is not, for the message (default: a row of the embedding)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise ValueError(f"{what}: expected a sequence of token ids, got {type(ids).__name__} "
                         "(encode text with model.tokenizer.encode first)")
    if hasattr(ids, "tolist"):   # a tensor or array: its elements, as Python numbers
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    ids = list(ids)
    if ids and all(type(i) is int for i in ids) and min(ids) >= 0 and max(ids) < vocab_size:
        return ids   # the common case: 2048 ids in 0.1 ms on a CI core, 0.9 ms through the loop
    out = []
    for i in ids:
        if not is_int(i):
            raise ValueError(f"{what}: {i!r} is not a token id (an integer)")
        if not 0 <= i < vocab_size:
            raise ValueError(f"{what}: token id {i} is not {bound or f'a row of the {vocab_size}-row embedding'}")
        out.append(int(i))
    if not out and not empty_ok:
        raise ValueError(f"{what}: empty (at least one token is needed)")
    return out


def check_bool(v, what: str, none_ok: bool = False):
    """v if a bool (or None, none_ok), else one clear error naming what: bool("false") and
    bool([False]) are True, a silently flipped setting."""
    if isinstance(v, bool) or none_ok and v is None:
        return v
    raise ValueError(f"{what}={v!r} must be a boolean{' or None' if none_ok else ''}, not {type(v).__name__}")


def check_finite(w, where: str, name: str):
    """w (a torch float tensor or a QuantizedTensor, as a loader read it), or one clear error
    naming the file and tensor where a value or scale is NaN or inf: a corrupt file, whose every
    product with that row would be NaN (generation would then print garbage, or token 0 forever,
    without a word). A float tensor is scanned by its exponent bits (all ones: inf or NaN), ~4x
    faster than torch.isfinite on the CPU; a quantized one by its scales (Format.nonfinite_rows)."""
    import torch

    if hasattr(w, "format"):
        bad = w.fmt.nonfinite_rows(w)
    elif not w.numel():
        return w
    else:
        rows = w.reshape(len(w), -1) if w.ndim else w.reshape(1, 1)
        bad = np.zeros(len(rows), bool)
        step = max(1, (1 << 24) // max(1, rows.shape[1]))   # (bounds the temporaries)
        for r0 in range(0, len(rows), step):
            chunk = rows[r0:r0 + step]
            if _exponent_all_ones(chunk):
                bad[r0:r0 + step] = (~torch.isfinite(chunk)).any(dim=1).numpy()
    if bad.any():
        raise ValueError(f"{where}: tensor {name!r}: row {int(np.flatnonzero(bad)[0])} holds NaN or inf "
                         f"{'in its scales ' if hasattr(w, 'format') else ''}({int(bad.sum())} rows do); "
                         "the file is corrupt")
    return w


def _exponent_all_ones(t) -> bool:
    """Whether some element of the float tensor t is inf or NaN, read from its bits."""
    import torch

    kind = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
            torch.float32: (torch.int32, 0x7F800000)}.get(t.dtype)
    if kind is None:
        return not bool(torch.isfinite(t).all())
    bits, mask = kind
    return t.numel() > 0 and int((t.contiguous().view(bits) & mask).max()) == mask


def special_token_id(v, n: int, what: str) -> int | None:
    """A file's special-token id (bos, eos, ...) if it indexes the n-token vocabulary; an id past
    it is ignored with a warning, as llama.cpp does (a stop id that can never be sampled is
    harmless); a value that is no integer at all is an error. what: file and key, for messages."""
    if v is None:
        return None
    if not is_int(v):
        raise ValueError(f"{what}={v!r} is not a token id")
    if not 0 <= v < n:
        warnings.warn(f"{what}={v!r} is not one of the {n} token ids: ignored", stacklevel=2)
        return None
    return int(v)


@dataclass
class ModelConfig:
    arch: str                   # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool               # qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Llama 3 RoPE: rotation frequency i, theta^(-2i/head_dim), is divided by factor i (head_dim/2
    # values): GGUF's rope_freqs.weight, or computed from HF's rope_type "llama3" (llama3_rope_factors).
    # None: plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    # Mistral v0.1: every layer attends to the last sliding_window positions (HF sliding_window,
    # GGUF {arch}.attention.sliding_window). The runner attends to the whole context, which is
    # the same inside the window only, so max_position (the positions the runner takes) is cut
    # to it, and context_length keeps the model's own context (HF max_position_embeddings, GGUF
    # context_length: what an export writes). None: no window / no cut (max_position is it).
    sliding_window: int | None = None
    context_length: int | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: the runner knows {ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position", "sliding_window", "context_length"):
            v = getattr(self, name)
            if v is None and name in ("sliding_window", "context_length"):
                continue
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if self.sliding_window is not None and self.sliding_window < self.max_position:
            self.context_length = self.context_length or self.max_position
            self.max_position = self.sliding_window
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA needs whole groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        for name in ("rms_norm_eps", "rope_theta"):
            setattr(self, name, positive(getattr(self, name), float, name))
        if self.rope_freq_factors is not None:
            f = tuple(self.rope_freq_factors)
            if len(f) != self.head_dim // 2:
                raise ValueError(f"rope_freq_factors: {len(f)} values; head_dim {self.head_dim} has "
                                 f"{self.head_dim // 2} rotation frequencies")
            self.rope_freq_factors = tuple(positive(v, float, f"rope_freq_factors[{i}]") for i, v in enumerate(f))
        self.check_rope()
        self.check_token_ids()

    def check_rope(self) -> None:
        """The runner's RoPE angles, position x theta^(-2i/head_dim) / factor_i, are float32
        (llm.rope_tables, as HF computes them): a base whose frequencies overflow there (1e-45
        gives inf, then NaN at position 0) or vanish would rotate nothing right, so it is refused
        here rather than blamed on the weights later."""
        f32 = np.finfo(np.float32)
        if not f32.tiny <= self.rope_theta <= f32.max:
            raise ValueError(f"rope_theta={self.rope_theta!r} (the RoPE base) is outside float32's "
                             "normal range, in which the runner computes RoPE")
        # theta^(-2i/head_dim) is monotonic in i: without factors its ends i = 0 and i = head_dim/2 - 1
        # bound it (an array of head_dim/2 values, for a corrupt head_dim of 2^31 before any tensor
        # shape is compared, had taken minutes and 17 GB; 2^40 a MemoryError naming no key)
        i = np.arange(0, self.head_dim, 2) if self.rope_freq_factors is not None else np.array([0, self.head_dim - 2])
        with np.errstate(all="ignore"):
            inv = 1.0 / float(self.rope_theta) ** (i / self.head_dim)
            if self.rope_freq_factors is not None:
                inv = inv / np.asarray(self.rope_freq_factors)
            ok = np.all(inv >= f32.tiny) and np.all(inv * self.max_position <= f32.max)
        if not ok:
            raise ValueError(f"rope_theta={self.rope_theta!r} (the RoPE base): with head_dim "
                             f"{self.head_dim} its frequencies theta^(-2i/head_dim) "
                             f"({inv.min():.3g} to {inv.max():.3g}) leave float32's range over "
                             f"{self.max_position} positions")

    def check_token_ids(self) -> None:
        """bos / eos ids are rows of the embedding (an id past it would crash the first lookup)."""
        if self.bos_token_id is not None:
            self.bos_token_id = token_ids([self.bos_token_id], self.vocab_size, "bos_token_id")[0]
        eos = list(self.eos_token_ids or [])
        self.eos_token_ids = token_ids(eos, self.vocab_size, "eos_token_ids") if eos else []

    def check_tokenizer(self, tok, where: str, strict: bool) -> None:
        """A loader's last check, after it took special ids from the tokenizer: ids past the
        embedding are dropped with a warning (special_token_id; where: the file or directory,
        for the message). A tokenizer larger than the embedding is an error with strict (GGUF:
        llama.cpp sizes the embedding by the token list), else a warning: HF checkpoints with an
        added token past the embedding exist (an added <pad>) and work as long as that token is
        not fed (the runner's token_ids check refuses it then)."""
        msg = None
        if tok is not None and tok.vocab_size > self.vocab_size:
            msg = (f"{where}: the tokenizer has {tok.vocab_size} tokens, the embedding only "
                   f"{self.vocab_size} rows")
        elif tok is not None and tok.stray_id and tok.stray_id[1] >= self.vocab_size:
            # (its count of tokens misses a stray large id, which had loaded silently)
            msg = (f"{where}: the tokenizer's token {tok.stray_id[0]!r} has id {tok.stray_id[1]}, the embedding "
                   f"only {self.vocab_size} rows")
        if msg:
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; prompts holding the extra tokens will be refused", stacklevel=2)
        self.eos_token_ids = [i for i in self.eos_token_ids
                              if special_token_id(i, self.vocab_size, f"{where}: eos token id") is not None]
        self.bos_token_id = special_token_id(self.bos_token_id, self.vocab_size, f"{where}: bos token id")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_cache_bytes(self, positions: int, itemsize: int) -> int:
        """Bytes of a K and a V cache for `positions` tokens, every layer, itemsize bytes a value."""
        return 2 * self.num_layers * self.kv_size * positions * itemsize

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF weight name -> (out, in) shape (torch orientation), for validation by loaders."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        s = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (v, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = (h,)
            s[p + "post_attention_layernorm.weight"] = (h,)
            s[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            s[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            s[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            s[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                s[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            s[p + "mlp.gate_proj.weight"] = (f, h)
            s[p + "mlp.up_proj.weight"] = (f, h)
            s[p + "mlp.down_proj.weight"] = (h, f)
        return s


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position: int) -> tuple[float, ...]:
    """Llama 3.1's RoPE frequency scaling as one divisor per frequency (the form GGUF stores).

    With wavelength L_i = 2 pi / f_i of frequency f_i = theta^(-2i/d) and the pre-training
    context C: frequencies whose wavelength is short (L < C / high_freq_factor) are kept,
    long ones (L > C / low_freq_factor) are divided by `factor`, and those between blend the
    two, f' = (1 - s) f / factor + s f with s = (C / L - low) / (high - low) -- which is f divided
    by 1 / ((1 - s) / factor + s). Meta's reference and HF's rope_type "llama3" apply the same
    rule to f directly; llama.cpp's converter writes these divisors as rope_freqs.weight."""
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"high_freq_factor={high_freq_factor!r} must exceed "
                         f"low_freq_factor={low_freq_factor!r}")
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_max_position / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_max_position / low_freq_factor:
            out.append(float(factor))
        else:
            s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - s) / factor + s))
    return tuple(out)
