"""ModelConfig: the few numbers that define a Qwen3 / llama decoder (DESIGN.md §5)."""
from __future__ import annotations

from dataclasses import dataclass, field

ARCHS = ("qwen3", "llama")


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
        self.eos_token_ids = [int(i) for i in (self.eos_token_ids or [])]

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
