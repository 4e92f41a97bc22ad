"""CPU tier of the fused layer ops and the fp16 GEMV: which shapes they serve, and the clear
errors a CPU model gives when asked for them (the kernels themselves: tests/test_layer_ops_gpu.py,
tests/test_fp16_gemv_gpu.py)."""
from __future__ import annotations

import pytest
import torch


def test_supports_names_what_is_not_served():
    from quantzoo.kernels import layer_ops as lo

    assert lo.supports(4096, 12288, 128, 32, 8) is None          # Qwen3-8B
    assert lo.supports(576, 1536, 64, 9, 3) is None              # SmolLM2-135M
    assert "head_dim 96" in lo.supports(4096, 12288, 96, 32, 8)
    assert "KV heads" in lo.supports(4096, 12288, 128, 32, 2)    # 16 query heads per KV head
    assert "hidden 4100" in lo.supports(4100, 12288, 128, 32, 8)


def test_decode_work_runs(rng):
    from quantzoo.kernels.layer_ops import SPLITS_MAX, DecodeWork

    for S in (16, 64, 256, 4096, 40960, int(rng.integers(1, 50000))):
        for kv in (8, 2, 1):
            w = DecodeWork(32, kv, 128, S, "cpu")
            assert 1 <= w.n_split <= SPLITS_MAX and w.n_split * 64 <= max(S, 64)
            # about two CTAs per SM at most (132 SMs where there is no GPU)
            assert w.n_split == max(1, min(SPLITS_MAX, S // 64, -(-264 // kv)))
            assert tuple(w.o.shape) == (32, w.n_split, 128) and int(w.count.sum()) == 0


def test_cpu_model_refuses_fused_ops():
    from quantzoo.bench.model import make_config, synthetic_model

    cfg = make_config(1, tiny=True)
    m = synthetic_model("q4_0", cfg, "cpu")
    assert m.fused_ops is False
    with pytest.raises(ValueError, match="fused_ops=True: the fused layer ops run on CUDA"):
        synthetic_model("q4_0", cfg, "cpu", fused_ops=True)


def test_gemv_declines_cpu_tensors():
    from quantzoo.kernels import fp16

    w = torch.zeros(16, 64, dtype=torch.float16)
    x = torch.zeros(1, 64, dtype=torch.float16)
    assert not fp16.gemv_ok(x, w)
    with pytest.raises(ValueError, match="gemv"):
        fp16.gemv(x, w)


def test_persistent_run_checks_h_and_pos_before_launch(monkeypatch):
    """PersistentDecode.run(h, pos) hands h's and pos's addresses to a kernel that reads D fp16
    values of h 16 bytes at a time and one int64 position (which indexes the KV cache unchecked):
    a float32 or short h, an int32 pos or one on another device is refused by name, not launched.
    (The plan is built by hand: its constructor needs a CUDA model; no launch is reached.)"""
    from types import SimpleNamespace

    from quantzoo.kernels import persistent

    def no_launch(*a, **k):
        raise AssertionError("a bad call reached the kernel")

    monkeypatch.setattr(persistent, "get_kernel", no_launch)
    model = SimpleNamespace(k_cache=object(), _decode_work=object(), layers=[])
    plan = persistent.PersistentDecode.__new__(persistent.PersistentDecode)
    plan.model, plan.cache, plan.work, plan.D, plan.name = model, model.k_cache, model._decode_work, 64, "k"
    plan.table = torch.zeros((1, persistent.LAYER_PTRS), dtype=torch.int64)   # the model's device (CPU here)
    h = torch.zeros(1, 64, dtype=torch.float16)
    pos = torch.zeros(1, dtype=torch.int64)
    for bad_h in (h.float(), h[:, :32].contiguous(), torch.zeros(4, 64, dtype=torch.float16),
                  torch.zeros(64, 2, dtype=torch.float16).t()[:1], h.numpy()):
        with pytest.raises(ValueError, match="^h: "):
            plan.run(bad_h, pos)
    with pytest.raises(ValueError, match="^h: its data must start at a 16-byte boundary"):
        plan.run(torch.zeros(65, dtype=torch.float16)[1:].view(1, 64), pos)
    for bad_pos in (pos.int(), torch.zeros(2, dtype=torch.int64), 0):
        with pytest.raises(ValueError, match="^pos: "):
            plan.run(h, bad_pos)
    with pytest.raises(AssertionError, match="reached the kernel"):   # good arguments get through
        plan.run(h, pos)
