"""The persistent decode kernel (cuda/decode_persistent.cu, quantzoo.kernels.persistent).

GPU tier: for every GGUF format of the registry and four shapes, a small random model decodes
100 tokens after a 40-token prompt (positions 40-139: the attention takes one run of the cache,
then three) twice: through the persistent kernel and through the one-launch-per-op path, in the
CUDA graph and eagerly. Every step's logits and the final KV caches must be bit-equal: the kernel
runs the same device functions and each format's GEMV adds in the order of the kernel the per-op
path takes (gguf_mmvq16.cu for q4_0 / q8_0, gguf_mmvq.cu for the others). The shapes:
  qwen3-hd128-g4   Qwen3's heads (head_dim 128, q/k norms, 4 query heads per KV head);
  llama-hd64-g3    llama-style (head_dim 64, no q/k norm, 3 per KV head);
  qwen3-g8-pieces  8 query heads per KV head (two per attention warp group), rows of 40 and
                   144 blocks (a partial row piece);
  qwen3-long-rows  down_proj rows of 1024 blocks (8 pieces): a warp's next stage lies further
                   ahead than the ring is deep in q8_0, the case the kernel's issued-count wait
                   is for.

A grid one CTA larger than the GPU can hold at once is refused (cooperative launch), not left to
wait forever at its first grid barrier; models that share a kernel instance with different
shared-memory sizes run in turn.

CPU tier: persistent=True refuses off the GPU, and each check of PersistentDecode.why_not gives
its one-line reason (on stand-in model objects).
"""
from __future__ import annotations

from dataclasses import replace

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


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3-hd128-g4", "llama-hd64-g3"])
def test_persistent_decode_bit_equal_after_a_long_prompt(shape):
    """After a 3000-token prompt the attention takes 47 runs: the merge's lanes take two runs each."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 GPU")
    cfg = _config(shape, layers=2)
    w = synthetic_weights("q4_0", cfg, "cuda", seed=6)
    models = {p: build_model(cfg, w, None, device="cuda", persistent=p) for p in (True, False)}
    prompt = torch.randint(0, cfg.vocab_size, (3000,), generator=torch.Generator().manual_seed(7)).tolist()
    for graph in (True, False):
        for m in models.values():
            m.use_graph, m._graph = graph, None
            m.setup_cache(3072)
            last = m.prefill(prompt)
        assert models[True]._decode_work.n_split > 32
        tok = int(last.argmax())
        for step in range(8):
            got = {p: m.decode_step(tok, len(prompt) + step).clone() for p, m in models.items()}
            assert torch.equal(got[True], got[False]), f"{shape} graph={graph} step {step}"
            tok = int(got[True].argmax())


@pytest.mark.gpu
def test_persistent_grid_that_cannot_be_resident_is_refused():
    """The grid barriers would wait forever for a CTA that cannot become resident: the launch is
    cooperative, so one CTA more than the SMs (each holds one) is refused with a clear error,
    and the plan still runs afterwards with its own grid."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 GPU")
    cfg = _config("qwen3-hd128-g4", layers=1)
    m = build_model(cfg, synthetic_weights("q4_0", cfg, "cuda", seed=2), None, device="cuda", persistent=True)
    m.use_graph = False
    m.prefill([1, 2, 3])
    plan = m._persistent
    ctas = plan.ctas
    h = torch.zeros(1, cfg.hidden_size, dtype=torch.float16, device="cuda")
    pos = torch.tensor([3], dtype=torch.int64, device="cuda")
    plan.ctas = ctas + 1
    with torch.inference_mode(), pytest.raises(RuntimeError, match=f"cannot hold all {ctas + 1} CTAs"):
        plan.run(h, pos)   # (the runner's tensors are inference tensors)
    plan.ctas = ctas
    torch.cuda.synchronize()
    assert torch.isfinite(m.decode_step(4, 3)).all()


@pytest.mark.gpu
def test_persistent_models_sharing_a_kernel_with_other_shared_memory():
    """Two models whose steps run the same kernel instance with different shared-memory sizes,
    used in turn: every launch fits (the kernel's dynamic shared memory limit only ever rises).
    Setting each model's size in turn had left the larger one's next launch refused."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 GPU")
    models = []
    for shape in ("qwen3-hd128-g4", "qwen3-long-rows"):
        cfg = _config(shape, layers=1)
        m = build_model(cfg, synthetic_weights("q4_0", cfg, "cuda", seed=4), None, device="cuda", persistent=True)
        m.use_graph = False
        m.prefill([1, 2, 3])
        models.append(m)
    a, b = (m._persistent for m in models)
    assert a.name == b.name and a.smem != b.smem
    for m in models + models:
        assert torch.isfinite(m.decode_step(4, 3)).all()


def test_persistent_refused_off_gpu():
    cfg = _config("qwen3-hd128-g4", layers=1)
    w = synthetic_weights("q4_0", cfg, "cpu", seed=1)
    m = build_model(cfg, w, None, device="cpu")
    assert not m.persistent
    with pytest.raises(ValueError, match="persistent=True"):
        build_model(cfg, w, None, device="cpu", persistent=True)


def _fake_model(fmts=("q4_0",) * 4, K=(512, 512, 512, 1024), fused=True, cfg=None):
    """The attributes PersistentDecode.why_not reads, on the CPU."""
    from types import SimpleNamespace as NS

    def lin(fmt, k):
        qt = None if fmt == "f16" else NS(format=fmt, shape=(256, k), data=NS(data_ptr=lambda: 4096))
        return NS(qt=qt, mode="emulate", format=fmt)

    names = ("qkv", "o", "gate_up", "down")
    lay = NS(**{n: lin(f, k) for n, f, k in zip(names, fmts, K)})
    if not fused:
        lay.qkv = None
    return NS(is_cuda=True, fused_ops=True, device="cuda:0", config=cfg or _config("qwen3-hd128-g4"), layers=[lay])


@pytest.mark.parametrize("kw,why", [
    ({}, None),
    ({"fused": False}, "not fused"),
    ({"fmts": ("q4_0", "q4_0", "q8_0", "q4_0")}, "several formats"),
    ({"fmts": ("q4_0", "awq", "q4_0", "q4_0")}, "o_proj: awq is not a GGUF block format"),
    ({"fmts": ("q4_0", "f16", "q4_0", "q4_0")}, "o_proj: f16 is not a GGUF block format"),
    ({"K": (512, 512, 576, 1024)}, "gate_up: K=576 not a multiple of 256"),
    ({"cfg": replace(_config("qwen3-hd128-g4"), head_dim=96)}, "head_dim 96"),
    ({"cfg": replace(_config("qwen3-hd128-g4"), intermediate_size=1088)}, "intermediate size 1088"),
])
def test_persistent_why_not(monkeypatch, kw, why):
    """The one-line reason a model does not qualify (each check of why_not), without a GPU."""
    from quantzoo.kernels import persistent

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(persistent, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent, "smem_budget", lambda device: persistent.SMEM_BUDGET)
    got = persistent.PersistentDecode.why_not(_fake_model(**kw))
    assert got == why if why is None else why in got
