"""The persistent decode kernel (cuda/decode_persistent.cu, quantzoo.kernels.persistent).

GPU tier: for every GGUF format of the registry and two head shapes (Qwen3's head_dim 128 with
q/k norms and 4 query heads per KV head; a llama-style head_dim 64, 3 per KV head, no q/k norm),
a small random model decodes 40 tokens after a 150-token prompt (so the attention runs 1-3 runs
of the cache and merges them) twice: through the persistent kernel and through the one-launch-
per-op path. Every step's logits must be bit-equal -- the kernel runs the same device functions
and the same summation orders -- in the CUDA graph and eagerly, and the KV caches must end equal.

CPU tier: where the kernel does not apply the model says why, and persistent=True refuses.
"""
from __future__ import annotations

import pytest
import torch

from quantzoo.bench.model import synthetic_weights
from quantzoo.kernels import gguf
from quantzoo.model import build_model
from quantzoo.model.config import ModelConfig

SHAPES = {   # (arch, heads, kv heads, head_dim, q/k norm)
    "qwen3-hd128-g4": ("qwen3", 4, 1, 128, True),
    "llama-hd64-g3": ("llama", 12, 4, 64, False),
}


def _config(shape: str, layers: int = 3) -> ModelConfig:
    arch, H, KV, hd, qk = SHAPES[shape]
    return ModelConfig(arch=arch, vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=layers,
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
    models = {p: build_model(cfg, w, None, device="cuda", persistent=p) for p in (True, False)}
    assert models[True].persistent and models[True].persistent_why is None
    assert not models[False].persistent
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (150,), generator=gen).tolist()
    for graph in (True, False):
        last = {}
        for p, m in models.items():
            m.use_graph, m._graph = graph, None
            last[p] = m.prefill(prompt)
        assert torch.equal(last[True], last[False])
        tok = int(last[True].argmax())
        for step in range(40):
            pos = len(prompt) + step
            got = {p: m.decode_step(tok, pos).clone() for p, m in models.items()}
            assert torch.isfinite(got[True]).all(), f"{fmt} {shape} graph={graph} step {step}: non-finite logits"
            diff = (got[True].float() - got[False].float()).abs().max().item()
            assert torch.equal(got[True], got[False]), \
                f"{fmt} {shape} graph={graph} step {step} (position {pos}): max |diff| {diff}"
            tok = int(got[True].argmax())
        n = len(prompt) + 40
        for a, b in ((models[True].k_cache, models[False].k_cache), (models[True].v_cache, models[False].v_cache)):
            assert torch.equal(a[:, :, :, :n], b[:, :, :, :n])


def test_persistent_refused_off_gpu():
    cfg = _config("qwen3-hd128-g4", layers=1)
    w = synthetic_weights("q4_0", cfg, "cpu", seed=1)
    m = build_model(cfg, w, None, device="cpu")
    assert not m.persistent
    with pytest.raises(ValueError, match="persistent=True"):
        build_model(cfg, w, None, device="cpu", persistent=True)
