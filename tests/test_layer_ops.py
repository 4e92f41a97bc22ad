"""CPU tier of the fused layer ops and the fp16 GEMV: which shapes they serve, and the clear
errors a CPU model gives when asked for them (the kernels themselves: tests/test_layer_ops_gpu.py,
tests/test_fp16_gemv_gpu.py)."""
from __future__ import annotations

import numpy as np
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


@pytest.fixture
def meta_launches(monkeypatch):
    """The layer ops on meta tensors (shapes without memory, taken as CUDA ones by their checks),
    their launches recorded as (kernel, grid) instead of made."""
    from quantzoo.kernels import layer_ops as lo

    calls = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    monkeypatch.setattr(lo, "_k", lambda name: name)
    monkeypatch.setattr(lo, "launch", lambda kern, grid, block, args, shared_mem=0: calls.append((kern, tuple(grid))))
    return calls


def _meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_attn_decode_kv_heads_past_the_grid_y_limit(meta_launches):
    """attn_decode's grid is n_split x KV heads: 65536 KV heads (a 16 MiB cache of one position)
    passed CUDA's gridDim.y limit of 65535 and went to the driver; refused by name before any
    launch, and supports() says so. 65535 still goes out."""
    from quantzoo.kernels import layer_ops as lo

    assert "65536 KV heads" in lo.supports(4096, 12288, 64, 65536, 65536)
    assert lo.supports(4096, 12288, 64, 65535, 65535) is None
    pos = _meta(1, dtype=torch.int64)
    kv = 65536
    cache = _meta(kv, 1, 64)
    with pytest.raises(ValueError, match=r"^k_cache: 65536 KV heads, past CUDA's gridDim.y limit of 65535"):
        lo.attn_decode.__wrapped__(_meta(1, kv, 64), cache, cache, pos, lo.DecodeWork(kv, kv, 64, 1, "meta"))
    assert not meta_launches
    kv = 65535
    cache = _meta(kv, 1, 64)
    lo.attn_decode.__wrapped__(_meta(1, kv, 64), cache, cache, pos, lo.DecodeWork(kv, kv, 64, 1, "meta"))
    assert meta_launches == [("attn_decode<2, 1, 4>", (1, 65535))]


def test_attn_decode_refuses_work_of_another_shape_and_empty_caches(meta_launches):
    """The kernel writes work.n_split partials of head_dim floats a head into work.o: a DecodeWork
    made for head_dim 64 (or with n_split, o, ml or count not as DecodeWork makes them) under a
    head_dim 128 cache went out, its writes past o's end. A cache of no KV heads was a
    ZeroDivisionError, of no positions (or a q of no heads) a launch reading row 0 of nothing."""
    from quantzoo.kernels import layer_ops as lo

    H, KV, S = 8, 2, 4096
    cache, q, pos = _meta(KV, S, 128), _meta(1, H, 128), _meta(1, dtype=torch.int64)
    good = lo.DecodeWork(H, KV, 128, S, "meta")
    lo.attn_decode.__wrapped__(q, cache, cache, pos, good)
    assert meta_launches == [("attn_decode<4, 4, 4>", (good.n_split, KV))] and good.n_split > 1
    meta_launches.clear()
    bad = [lo.DecodeWork(H, KV, 64, S, "meta")]   # head_dim 64's partials
    for name, value in (("n_split", 0), ("n_split", lo.SPLITS_MAX + 1), ("n_split", good.n_split + 1),
                        ("ml", _meta(H, good.n_split, 2)), ("count", _meta(KV, dtype=torch.int64)),
                        ("o", _meta(good.n_split, H, 128, dtype=torch.float32).transpose(0, 1))):
        w = lo.DecodeWork(H, KV, 128, S, "meta")
        setattr(w, name, value)
        bad.append(w)
    for w in bad:
        with pytest.raises(ValueError, match=r"^work: n_split=.*DecodeWork\(8, 2, 128, 4096, device\) makes them"):
            lo.attn_decode.__wrapped__(q, cache, cache, pos, w)
    for c, qq in ((_meta(0, S, 128), q), (_meta(KV, 0, 128), q)):
        with pytest.raises(ValueError, match=r"^k_cache: shape .*, no KV heads or no positions"):
            lo.attn_decode.__wrapped__(qq, c, c, pos, good)
    with pytest.raises(ValueError, match=r"^q: shape \(1, 0, 128\), expected \(1, H, 128\) with H a positive"):
        lo.attn_decode.__wrapped__(_meta(1, 0, 128), cache, cache, pos, good)
    assert not meta_launches


def test_row_counts_past_the_kernels_int_and_grid_x(meta_launches):
    """add_rms_norm runs a block a row: 2^31 rows (a 32 GiB h of 8 values a row) passed CUDA's
    gridDim.x limit; silu_mul takes F as an int: a (1, 2^32) gu (8 GiB) was np.int32's
    OverflowError; qk_rope_store with no heads at all launched a grid of no blocks. Each is refused
    by name (or returns) before any launch; the largest sizes that fit still go out."""
    from quantzoo.kernels import layer_ops as lo

    w = _meta(8)
    with pytest.raises(ValueError, match=r"^h: 2147483648 rows, past CUDA's gridDim.x limit of 2147483647"):
        lo.add_rms_norm.__wrapped__(_meta(2**31, 8), None, w, 1e-6)
    with pytest.raises(ValueError, match=r"^gu: shape \(1, 4294967296\), F=2147483648 too large"):
        lo.silu_mul.__wrapped__(_meta(1, 2**32))
    assert not meta_launches
    lo.add_rms_norm.__wrapped__(_meta(2**31 - 1, 8), None, w, 1e-6)
    lo.silu_mul.__wrapped__(_meta(1, 2**32 - 4))
    assert [grid for _, grid in meta_launches] == [(2**31 - 1,), (132 * 8,)]
    meta_launches.clear()
    T, S = 3, 16
    empty = _meta(0, S, 64)
    q = lo.qk_rope_store.__wrapped__(_meta(T, 0), None, _meta(S, 64), _meta(S, 64), _meta(T, dtype=torch.int64),
                                     empty, empty, 0, 0, 1e-6)
    assert q.shape == (T, 0, 64) and not meta_launches
    nopos = _meta(1, 0, 64)
    with pytest.raises(ValueError, match=r"^k_cache: shape \(1, 0, 64\), no positions"):
        lo.qk_rope_store.__wrapped__(_meta(T, 3 * 64), None, _meta(0, 64), _meta(0, 64),
                                     _meta(T, dtype=torch.int64), nopos, nopos, 1, 1, 1e-6)
    assert not meta_launches


def test_gemv_leaves_n_or_k_past_2_31_to_cublas(monkeypatch):
    """fp16_gemv takes N and K as ints: a (1, 2^31) fp16 weight (4 GiB) passed gemv_ok, and
    linear died in np.int32's OverflowError at the launch. Such a weight goes to cuBLAS
    (F.linear) now, and gemv refuses it by name; N or K of 2^31 - 1 (and 8 less) still launch."""
    from quantzoo.kernels import fp16

    calls = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    monkeypatch.setattr(fp16, "get_kernel", lambda src, name, names: name)
    monkeypatch.setattr(fp16, "launch", lambda kern, grid, block, args, shared_mem=0: calls.append((grid, args)))
    for n, k in ((1, 2**31), (2**31, 8)):
        w, x = _meta(n, k), _meta(1, k)
        assert not fp16.gemv_ok(x, w)
        assert fp16.linear.__wrapped__(x, w).shape == (1, n)
        with pytest.raises(ValueError, match=r"^gemv: .*N and K below 2\^31"):
            fp16.gemv.__wrapped__(x, w)
    assert not calls
    for n, k in ((1, 2**31 - 8), (2**31 - 1, 8)):
        assert fp16.linear.__wrapped__(_meta(1, k), _meta(n, k)).shape == (1, n)
    assert [(grid, int(args[3]), int(args[4])) for grid, args in calls] == [
        ((1,), 1, 2**31 - 8), ((2**27,), 2**31 - 1, 8)]


def test_attn_decode_rechecks_work_changed_since_its_check(meta_launches):
    """attn_decode checks a DecodeWork's tensors on every call: a work.o replaced by head_dim 64's
    partials or reshaped in place (resize_, transpose_), or an ml made non-contiguous, after a
    call that took the work, is refused (a check remembered by the tensors' ids let them through
    while it was tried: an id is taken again at once by a new tensor, and kept by in-place ops)."""
    from quantzoo.kernels import layer_ops as lo

    H, KV, S = 8, 2, 4096
    cache, q, pos = _meta(KV, S, 128), _meta(1, H, 128), _meta(1, dtype=torch.int64)
    f = lo.attn_decode.__wrapped__
    refused = r"^work: n_split=.*DecodeWork\(8, 2, 128, 4096, device\) makes them"
    for change in ("reassigned", "resize_", "transpose_", "as_strided_"):
        w = lo.DecodeWork(H, KV, 128, S, "meta")
        f(q, cache, cache, pos, w)
        if change == "reassigned":
            w.o = None
            w.o = torch.empty((H, w.n_split, 64), dtype=torch.float32, device="meta")
        elif change == "resize_":
            w.o.resize_(H, w.n_split, 64)
        elif change == "transpose_":
            w.o.transpose_(1, 2)
        else:   # the same shape, not contiguous
            w.ml.as_strided_((H, w.n_split, 2), (2 * w.n_split, 1, w.n_split))
        with pytest.raises(ValueError, match=refused):
            f(q, cache, cache, pos, w)
    assert len(meta_launches) == 4


def test_a_decode_work_made_from_numpy_ints_is_taken(meta_launches):
    """DecodeWork(np.int64 heads, KV heads, S) kept numpy's n_split, and attn_decode refused the
    work it made: "work: n_split=np.int64(64), ...; the cache needs n_split in 1..256 ...
    (DecodeWork(8, 2, 128, 4096, device) makes them)". Its sizes are Python ints now."""
    from quantzoo.kernels import layer_ops as lo

    H, KV, S = 8, 2, 4096
    cache, q, pos = _meta(KV, S, 128), _meta(1, H, 128), _meta(1, dtype=torch.int64)
    w = lo.DecodeWork(np.int64(H), np.int32(KV), np.int64(128), np.int64(S), "meta")
    assert type(w.n_split) is int and type(w.S) is int
    assert w.n_split == lo.DecodeWork(H, KV, 128, S, "meta").n_split
    lo.attn_decode.__wrapped__(q, cache, cache, pos, w)
    assert meta_launches == [("attn_decode<4, 4, 4>", (w.n_split, KV))]
    with pytest.raises(TypeError):   # (not a whole number: refused where it is made)
        lo.DecodeWork(H, KV, 128, 4096.0, "meta")


def test_qk_rope_store_refuses_no_positions_without_kv_heads(meta_launches):
    """qk_rope_store rotates q too, reading cos and sin at pos[t]: a cache of no positions (and
    so tables of no rows) was refused only where KV > 0, and with KV = 0 and a q head the kernel
    went out reading row pos of a table of none (an empty CUDA tensor's address is 0)."""
    from quantzoo.kernels import layer_ops as lo

    T, hd = 1, 64
    none = _meta(0, 0, hd)
    with pytest.raises(ValueError, match=r"^k_cache: shape \(0, 0, 64\), no positions"):
        lo.qk_rope_store.__wrapped__(_meta(T, hd), None, _meta(0, hd), _meta(0, hd), _meta(T, dtype=torch.int64),
                                     none, none, 1, 0, 1e-6)
    assert not meta_launches
    q = lo.qk_rope_store.__wrapped__(_meta(0, hd), None, _meta(0, hd), _meta(0, hd), _meta(0, dtype=torch.int64),
                                     none, none, 1, 0, 1e-6)   # (no tokens: nothing to rotate or store)
    assert q.shape == (0, 1, hd) and not meta_launches
    lo.qk_rope_store.__wrapped__(_meta(T, hd), None, _meta(4, hd), _meta(4, hd), _meta(T, dtype=torch.int64),
                                 _meta(0, 4, hd), _meta(0, 4, hd), 1, 0, 1e-6)
    assert meta_launches == [("qk_rope_store<2, false>", (1,))]
