"""ModelConfig: the few numbers that define a Qwen3 / llama decoder (DESIGN.md §5)."""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field

ARCHS = ("qwen3", "llama")


def special_token_id(v, n: int, what: str) -> int | None:
    """A file's special-token id (bos, eos, ...) if it indexes the n-token vocabulary; an id past
    it is ignored with a warning, as llama.cpp does (a stop id that can never be sampled is
    harmless); a value that is no integer at all is an error. what: file and key, for messages."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
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

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: the runner knows {ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA needs whole groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive finite number")
            setattr(self, name, float(v))
        self.check_token_ids()

    def check_token_ids(self) -> None:
        """bos / eos ids are rows of the embedding (an id past it would crash the first lookup)."""
        def token_id(name, i):
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < self.vocab_size:
                raise ValueError(f"{name}: {i!r} is not a token id of a {self.vocab_size}-token vocabulary")
            return int(i)

        if self.bos_token_id is not None:
            self.bos_token_id = token_id("bos_token_id", self.bos_token_id)
        self.eos_token_ids = [token_id("eos_token_ids", i) for i in (self.eos_token_ids or [])]

    def check_tokenizer(self, tok, where: str, strict: bool) -> None:
        """A loader's last check, after it took special ids from the tokenizer: ids past the
        embedding are dropped with a warning (special_token_id; where: the file or directory,
        for the message). A tokenizer larger than the embedding
        is an error with strict (GGUF: llama.cpp sizes the embedding by the token list), else a
        warning: HF checkpoints with an added token past the embedding exist (an added <pad>) and
        work as long as that token is not fed (Model.forward refuses it then)."""
        if tok is not None and tok.vocab_size > self.vocab_size:
            msg = (f"{where}: the tokenizer has {tok.vocab_size} tokens, the embedding only "
                   f"{self.vocab_size} rows")
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
