"""The persistent decode kernel (cuda/decode_persistent.cu, quantzoo.kernels.persistent).

GPU tier: for every GGUF format of the registry and four shapes, a small random model decodes
100 tokens after a 40-token prompt (positions 40-139: the attention takes 1, 2 and 3 runs of the
cache) twice: through the persistent kernel and through the one-launch-per-op path, in the CUDA
graph and eagerly. Every step's logits and the final KV caches must be bit-equal: the kernel
runs the same device functions and each format's GEMV adds in the order of the kernel the per-op
path takes (gguf_mmvq16.cu for q4_0 / q8_0, gguf_mmvq.cu for the others). The shapes:
  qwen3-hd128-g4   Qwen3's heads (head_dim 128, q/k norms, 4 query heads per KV head);
  llama-hd64-g3    llama-style (head_dim 64, no q/k norm, 3 per KV head);
  qwen3-g8-pieces  8 query heads per KV head (two per attention warp group), rows of 40 and
                   144 blocks (a partial row piece);
  qwen3-long-rows  down_proj rows of 1024 blocks (8 pieces): a warp's next stage lies further
                   ahead than the ring is deep in q8_0, the case the kernel's issued-count wait
                   is for.

CPU tier: where the kernel does not apply the model says why, and persistent=True refuses.
"""
from __future__ import annotations

import pytest
import torch

from quantzoo.bench.model import synthetic_weights
from quantzoo.kernels import gguf
from quantzoo.model import build_model
from quantzoo.model.config import ModelConfig

SHAPES = {   # (arch, hidden, intermediate, heads, kv heads, head_dim, q/k norm, layers)
    "qwen3-hd128-g4": ("qwen3", 512, 1024, 4, 1, 128, True, 3),
    "llama-hd64-g3": ("llama", 512, 1024, 12, 4, 64, False, 3),
    "qwen3-g8-pieces": ("qwen3", 1280, 4608, 16, 2, 64, True, 2),
    "qwen3-long-rows": ("qwen3", 1024, 32768, 8, 2, 128, True, 2),
}


def _config(shape: str, layers: int | None = None) -> ModelConfig:
    arch, D, F, H, KV, hd, qk, n = SHAPES[shape]
    return ModelConfig(arch=arch, vocab_size=1024, hidden_size=D, intermediate_size=F, num_layers=layers or n,
                       num_heads=H, num_kv_heads=KV, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position=4096, tie_word_embeddings=False, qk_norm=qk)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt", sorted(gguf.BLOCKS))
def test_persistent_decode_bit_equal(fmt, shape):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 GPU")
    cfg = _config(shape)
    w = synthetic_weights(fmt, cfg, "cuda", seed=3)
    for k in w:   # the random blocks are biased (q5_1: mean ~0.9 std): smaller norm weights keep the
        if k.endswith("norm.weight"):   # residual stream of the long rows finite in fp16
            w[k] = w[k] * 0.25
    models = {p: build_model(cfg, w, None, device="cuda", persistent=p) for p in (True, False)}
    assert models[True].persistent
    assert not models[False].persistent
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=gen).tolist()
    steps = 100
    for graph in (True, False):
        last = {}
        for p, m in models.items():
            m.use_graph, m._graph = graph, None
            last[p] = m.prefill(prompt)
        assert models[True]._persistent is not None and models[False]._persistent is None
        assert torch.equal(last[True], last[False])
        tok = int(last[True].argmax())
        for step in range(steps):
            pos = len(prompt) + step
            got = {p: m.decode_step(tok, pos).clone() for p, m in models.items()}
            assert torch.isfinite(got[True]).all(), f"{fmt} {shape} graph={graph} step {step}: non-finite logits"
            diff = (got[True].float() - got[False].float()).abs().max().item()
            assert torch.equal(got[True], got[False]), \
                f"{fmt} {shape} graph={graph} step {step} (position {pos}): max |diff| {diff}"
            tok = int(got[True].argmax())
        n = len(prompt) + steps
        for a, b in ((models[True].k_cache, models[False].k_cache), (models[True].v_cache, models[False].v_cache)):
            assert torch.equal(a[:, :, :, :n], b[:, :, :, :n])


def test_persistent_refused_off_gpu():
    cfg = _config("qwen3-hd128-g4", layers=1)
    w = synthetic_weights("q4_0", cfg, "cpu", seed=1)
    m = build_model(cfg, w, None, device="cpu")
    assert not m.persistent
    with pytest.raises(ValueError, match="persistent=True"):
        build_model(cfg, w, None, device="cpu", persistent=True)
