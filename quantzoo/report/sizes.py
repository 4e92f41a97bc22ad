"""Size of Qwen3-8B in each format, from its real tensor shapes.

Qwen3-8B (HF config): hidden 4096, intermediate 12288, 36 layers, 32 query heads and 8 KV heads
of head_dim 128, vocab 151936, lm_head NOT tied to the embedding. Per layer:
q_proj 4096->4096, k_proj 4096->1024, v_proj 4096->1024, o_proj 4096->4096, gate_proj and
up_proj 4096->12288, down_proj 12288->4096; norms: input/post-attention (4096 each) and the
per-head q_norm/k_norm (128 each); one final norm (4096). 8.19 G parameters in all.

What is stored in which format follows what `quantzoo quantize` writes (quantzoo.model.export):
- a GGUF-storable format (fmt.gguf_type set: q4_0 ... q8_0, fp16): every 2-D weight, the
  embedding and lm_head included, in that format; 1-D norms in F32 (llama.cpp's converter).
- otherwise (AWQ, an HF checkpoint): the decoder linears in the format; embedding, lm_head and
  norms in fp16 (AutoAWQ keeps them unquantized).
"""
from __future__ import annotations

QWEN3_8B = {
    "hidden": 4096, "intermediate": 12288, "layers": 36, "heads": 32, "kv_heads": 8,
    "head_dim": 128, "vocab": 151936, "tied": False,
}


def qwen3_linears(c: dict = QWEN3_8B) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's linears."""
    h, i, q, kv = c["hidden"], c["intermediate"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]


def qwen3_norm_params(c: dict = QWEN3_8B) -> int:
    return c["layers"] * (2 * c["hidden"] + 2 * c["head_dim"]) + c["hidden"]


def qwen3_param_count(c: dict = QWEN3_8B) -> int:
    lin = c["layers"] * sum(n * k for _, n, k in qwen3_linears(c))
    emb = c["vocab"] * c["hidden"] * (1 if c["tied"] else 2)
    return lin + emb + qwen3_norm_params(c)


def embedding_format(fmt) -> str:
    """The format the embedding and lm_head are stored in next to `fmt` linears."""
    return fmt.name if fmt.gguf_type is not None else "fp16"


def weight_nbytes(fmt, n: int, k: int) -> int:
    if fmt.name == "awq":
        from quantzoo.formats.awq import GROUP_SIZES

        g = next(g for g in sorted(GROUP_SIZES, reverse=True) if k % g == 0)
        return fmt.nbytes((n, k), group_size=g)
    return fmt.nbytes((n, k))


def model_bytes(fmt, c: dict = QWEN3_8B) -> dict:
    """Bytes of the model stored with `fmt` linears: linears, embedding + lm_head, norms, total."""
    from quantzoo import formats

    lin = c["layers"] * sum(weight_nbytes(fmt, n, k) for _, n, k in qwen3_linears(c))
    efmt = formats.get(embedding_format(fmt))
    emb = weight_nbytes(efmt, c["vocab"], c["hidden"]) * (1 if c["tied"] else 2)
    norm_bytes = 4 if fmt.gguf_type is not None else 2
    norms = qwen3_norm_params(c) * norm_bytes
    return {"linears": lin, "embeddings": emb, "norms": norms, "total": lin + emb + norms,
            "embedding_format": efmt.name}


def decode_bytes_per_token(fmt, c: dict = QWEN3_8B) -> int:
    """Weight bytes one decode step reads: every linear and lm_head (embedding rows excluded),
    the figure DESIGN.md's tok/s rooflines use."""
    mb = model_bytes(fmt, c)
    # lm_head is read every step: the tied embedding itself, or the second of the two matrices
    return mb["linears"] + (mb["embeddings"] if c["tied"] else mb["embeddings"] // 2) + mb["norms"]
