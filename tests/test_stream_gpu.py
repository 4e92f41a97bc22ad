"""GPU tier: the one-launch read (cuda/stream_read.cu, quantzoo.kernels.stream) that the benches
use as a measured floor for an M = 1 matmul, and the model bench's decode bounds built on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _xor_words(buf: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(buf.cpu().numpy().view(np.uint32))) if buf.numel() else 0


@pytest.mark.parametrize("nbytes", [16, 48, 512 * 16 * 8 + 16, 3 * 2**20 + 7 * 16])
def test_read_folds_every_word_once(rng, nbytes):
    """Every 32-bit word is read exactly once (a word read twice would cancel in the xor, one
    skipped would be missing), in every launch shape; out is zeroed and nothing past out or past
    the grid's fold words is written."""
    from quantzoo.kernels import stream

    src = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).cuda()
    want = _xor_words(src) & 0xFFFFFFFF
    for cfg in stream.CONFIGS:
        for out_words in (5, 1500):   # 1500 > 512 threads: the single-block grids loop over out
            fold = torch.full((stream.FOLD_WORDS,), 12345, dtype=torch.int32, device="cuda")
            guarded = torch.full((8 * (out_words + 2),), -1.0, dtype=torch.float16, device="cuda")
            out = guarded[8:-8]   # 16-byte words, one untouched word on each side
            blocks = stream.read(src, out, fold, config=cfg)
            assert _xor_words(fold[: 16 * blocks]) & 0xFFFFFFFF == want, cfg
            assert (fold[16 * blocks:] == 12345).all(), cfg
            assert (out == 0).all() and (guarded[:8] == -1).all() and (guarded[-8:] == -1).all(), cfg


def test_read_replays_in_a_graph(rng):
    from quantzoo.kernels import stream

    src = torch.from_numpy(rng.integers(0, 256, 2**20, dtype=np.uint8)).cuda()
    fold = torch.zeros(stream.FOLD_WORDS, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        stream.read(src)   # compile off the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        blocks = stream.read(src, fold=fold)
    src.copy_(torch.from_numpy(rng.integers(0, 256, 2**20, dtype=np.uint8)).cuda())   # new bytes, same buffer
    g.replay()
    assert _xor_words(fold[: 16 * blocks]) & 0xFFFFFFFF == _xor_words(src) & 0xFFFFFFFF


def test_read_refuses_bad_arguments():
    from quantzoo.kernels import stream

    buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
    cases = [(lambda: stream.read(buf[1:17]), "16-byte aligned"),
             (lambda: stream.read(buf[:40]), "nbytes % 16"),
             (lambda: stream.read(buf.cpu()), "CUDA tensor"),
             (lambda: stream.read(buf, out=torch.zeros(3, dtype=torch.float16, device="cuda")), "out"),
             (lambda: stream.read(buf, fold=torch.zeros(stream.FOLD_WORDS, device="cuda")), "fold"),
             (lambda: stream.read(buf, fold=torch.zeros(1, dtype=torch.int32, device="cuda")), "fold"),
             (lambda: stream.read(buf, config=(3, 3)), "config"),
             (lambda: stream.read(buf, config=(2, 4, 0)), "config"),
             (lambda: stream.read(buf, config=5), "config"),
             (lambda: stream.read(buf, out=[0] * 8), "out"),
             (lambda: stream.read(buf, fold="x"), "fold")]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()


def test_best_read_us():
    from quantzoo.kernels import stream

    for pdl in (False, True):
        r = stream.best_read_us(2**20, pdl=pdl, target_s=0.002)
        assert tuple(r["config"]) in stream.CONFIGS and 0 < r["us"] < 1e4 and r["copies"] >= 2


@pytest.mark.parametrize("fmt", ["q4_0", "awq"])
def test_decode_bounds_leave_the_model_as_it_was(fmt):
    """decode_bounds swaps every linear for a ReadLinear and back (it refuses a model where it
    would miss one): the bounds come out positive, and the model is left as it was -- the same
    linears and graph setting, and the same tokens decoded."""
    from quantzoo.bench import model as bm
    from quantzoo.kernels import stream

    m = bm.synthetic_model(fmt, bm.make_config(2, tiny=True), "cuda")
    m.setup_cache(256)
    before = [id(lin) for lin in m._all_linears()]
    ref = m.generate(list(range(1, 9)), max_new_tokens=6)
    m.use_graph = False   # decode_bounds' own decode runs must not leave it changed
    out = bm.decode_bounds(m, 16, bw=3e12)
    assert [id(lin) for lin in m._all_linears()] == before
    assert m.use_graph is False and m.fallbacks == []
    m.use_graph = True
    for k in ("ideal_linears", "reads_only"):
        assert out[f"decode_tok_s_{k}"] > 0 and tuple(out[f"decode_read_config_{k}"]) in stream.CONFIGS
    assert m.generate(list(range(1, 9)), max_new_tokens=6) == ref
