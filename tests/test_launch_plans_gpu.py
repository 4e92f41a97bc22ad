"""GPU tier: launch plans (kernels.run_planned, cuda_launch.Plan). A matmul's second call with
the same M replays the launches its first call recorded, re-aimed at the new x and y; the result
must be bit-identical to an unplanned call on the same inputs, for every path of every format
with kernels, on x at another address (a row-offset view), into a caller's `out`, after the
workspaces were released, on another stream, under PDL and inside a CUDA graph capture."""
from __future__ import annotations

import pytest

import quantzoo as qz

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from quantzoo import kernels as K  # noqa: E402
from quantzoo import ops  # noqa: E402
from quantzoo.bench.model import random_weight  # noqa: E402
from quantzoo.cuda_launch import Plan, programmatic_launches  # noqa: E402

FORMATS = [f.name for f in qz.formats.weight_formats() if f.kernels in ("awq", "gguf")]
# M = 1 (GEMVs), 3 / 12 (small-M and chunked mmvq), 40 (mma, wgmma on Hopper), 200 (wgmma, or
# dequant + cuBLAS: a plan with torch steps), 600 (wgmma with whole and split tiles, or dequant),
# 1100 (dequant + cuBLAS for AWQ and Q5 / Q8_0 on Hopper too, wgmma for Q4)
MS = [1, 3, 12, 40, 200, 600, 1100]
N, KD = 6144, 4096   # big enough for every path the dispatch has (wgmma needs N * K >= 4096 * 4096)


def _unplanned(x, qt):
    saved, K.PLANS = K.PLANS, False
    try:
        return ops.matmul(x, qt)
    finally:
        K.PLANS = saved


def _plan(qt, m, stream=None):
    memo = qt.__dict__.get("_kernels_checked")
    return memo[3].get((m, (stream or torch.cuda.current_stream()).cuda_stream)) if memo else None


def _path(qt, m):
    return ops.kernels_for(qt.fmt).choose_path(m, qt)


def _random_weights():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    return {f: random_weight(f, N, KD, "cuda", gen) for f in FORMATS}


@pytest.fixture(scope="module")
def weights():
    return _random_weights()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", MS)
def test_replay_equals_an_unplanned_call(weights, fmt, m):
    qt = weights[fmt]
    big = torch.randn(3 * m + 1, KD, device="cuda").half()
    x1, x2, x3 = big[:m], big[m:2 * m], big[2 * m + 1:]        # three addresses in one buffer
    refs = [_unplanned(x, qt) for x in (x1, x2, x3)]
    ys = [ops.matmul(x1, qt), ops.matmul(x2, qt)]                  # records, then replays
    out = torch.full((m, N), float("nan"), dtype=torch.float16, device="cuda")
    ys.append(ops.kernels_for(qt.fmt).matmul(x3, qt, out=out))   # replays into the caller's out
    torch.cuda.synchronize()
    for i, (y, r) in enumerate(zip(ys, refs)):
        assert torch.equal(y, r), f"{fmt} M={m} ({_path(qt, m)}): call {i} differs from the unplanned call"
    plan = _plan(qt, m)
    assert isinstance(plan, Plan) and plan.steps, f"{fmt} M={m} ({_path(qt, m)}): no plan was recorded"


@pytest.fixture(scope="module")
def other_weights():   # a second stream's
    return _random_weights()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", MS)
def test_two_streams_at_once(weights, other_weights, fmt, m):
    """Two streams running matmuls at the same time (each its own weight and x) get each its own
    products: no workspace (split-K partials, tile counters, Q8_1 activations, the dequant
    buffer) is shared between streams. Both streams first sleep on the GPU, so that every launch
    is queued before either runs and their kernels overlap."""
    jobs = [(weights[fmt], torch.randn(m, KD, device="cuda").half()),
            (other_weights[fmt], torch.randn(m, KD, device="cuda").half())]
    refs = [_unplanned(x, qt) for qt, x in jobs]
    streams = [torch.cuda.Stream() for _ in jobs]
    for rnd in range(2):          # the first round records the plans, the second replays them
        outs = [[] for _ in jobs]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.cuda._sleep(50_000_000)   # ~25 ms at 2 GHz: the host queues all below first
        for _ in range(6):
            for i, (s, (qt, x)) in enumerate(zip(streams, jobs)):
                with torch.cuda.stream(s):
                    outs[i].append(ops.matmul(x, qt))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for i, ys in enumerate(outs):
            for j, y in enumerate(ys):
                assert torch.equal(y, refs[i]), (f"{fmt} M={m} ({_path(jobs[i][0], m)}), round {rnd}: stream {i}'s "
                                                 f"call {j} differs from its product computed alone")


@pytest.mark.parametrize("fmt", FORMATS)
def test_release_stream_pdl_and_capture(weights, fmt):
    qt, m = weights[fmt], 40
    x = torch.randn(m, KD, device="cuda").half()
    ref = _unplanned(x, qt)
    ops.matmul(x, qt)
    old = _plan(qt, m)
    ops.release_workspaces()                       # the plan's workspaces are gone: record anew
    assert torch.equal(ops.matmul(x, qt), ref)
    assert _plan(qt, m) is not old
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # another stream: its own plan
        y_side = ops.matmul(x, qt)
        assert torch.equal(ops.matmul(x, qt), y_side)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y_side, ref)
    with programmatic_launches():
        assert torch.equal(ops.matmul(x, qt), ref)
    static_y = ops.matmul(x, qt)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                      # capture runs unplanned, on the graph's pool
        static_y = ops.matmul(x, qt)
    x.copy_(torch.randn(m, KD, device="cuda").half())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, _unplanned(x, qt))
    assert torch.equal(ops.matmul(x, qt), static_y)


def test_capture_id():
    """cuda_launch.capture_id reads the driver's capture state: None outside a capture, an id
    inside, another for the next capture."""
    from quantzoo.cuda_launch import capture_id, current_stream_ptr

    ids = []
    assert capture_id(current_stream_ptr()) is None
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ids.append(capture_id(current_stream_ptr()))
            torch.zeros(1, device="cuda")
    assert None not in ids and ids[0] != ids[1]
    assert capture_id(current_stream_ptr()) is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 40, 600])
def test_graphs_share_nothing(weights, other_weights, fmt, m):
    """Two graphs captured on one stream (as torch's stream pool hands a stream out again), then
    replayed at the same time on two other streams, while eager calls run on the capture stream
    and after the cached workspaces were released: every product is its own. A capture's split-K
    partials, Q8_1 activations and dequant slabs come from its own pool, its tile counters are
    its own (kernels/workspaces.py), and a capture leaves the recorded launch plans in place."""
    from quantzoo.cuda_launch import workspace_generation

    jobs = [(weights[fmt], torch.randn(m, KD, device="cuda").half()),
            (other_weights[fmt], torch.randn(m, KD, device="cuda").half())]
    refs = [_unplanned(x, qt) for qt, x in jobs]
    eager_x = torch.randn(m, KD, device="cuda").half()
    eager_ref = _unplanned(eager_x, jobs[0][0])
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        ops.matmul(eager_x, jobs[0][0])                       # a plan, and cached workspaces, on this stream
    torch.cuda.current_stream().wait_stream(capture)
    plan, gen = _plan(jobs[0][0], m, capture), workspace_generation()
    graphs, outs = [], []
    for qt, x in jobs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture):
            outs.append(ops.matmul(x, qt))
        graphs.append(g)
    assert workspace_generation() == gen and _plan(jobs[0][0], m, capture) is plan, \
        f"{fmt} M={m}: a capture dropped the launch plans"
    ops.release_workspaces()                                   # the graphs do not use them
    streams = [torch.cuda.Stream() for _ in graphs]
    for rnd in range(4):
        if rnd:   # new x each round: stale outputs or partials of the last replay cannot pass for right
            for qt, x in jobs:
                x.copy_(torch.randn(m, KD, device="cuda").half())
            refs = [_unplanned(x, qt) for qt, x in jobs]
        for s in streams + [capture]:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.cuda._sleep(50_000_000)   # ~25 ms: everything below is queued before any of it runs
        for s, g in zip(streams, graphs):
            with torch.cuda.stream(s):
                g.replay()
        eager = []
        for _ in range(3):
            with torch.cuda.stream(capture):
                eager.append(ops.matmul(eager_x, jobs[0][0]))
        for s in streams + [capture]:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for i, (y, r) in enumerate(zip(outs, refs)):
            assert torch.equal(y, r), f"{fmt} M={m} ({_path(jobs[i][0], m)}), round {rnd}: graph {i} differs"
        for j, y in enumerate(eager):
            assert torch.equal(y, eager_ref), f"{fmt} M={m}, round {rnd}: eager call {j} beside the graphs differs"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 40])
def test_capture_forked_onto_two_streams(weights, other_weights, fmt, m):
    """A capture forked onto a second stream: its graph runs the two branches' kernels at once,
    so each branch has its own split-K tile counters, zeroed on its own branch, and its own
    scratch (kernels/workspaces.py). Each branch first sleeps as long, so that their matmuls start
    together, and x changes between replays: a block that took the other kernel's arrival for
    its own tile's last sums partials not yet written, or leaves an output unwritten, which
    stale memory from the previous replay would hide if x stayed the same."""
    qts = (weights[fmt], other_weights[fmt])
    xs = [torch.randn(m, KD, device="cuda").half() for _ in qts]
    for qt, x in zip(qts, xs):
        _unplanned(x, qt)                            # warm-up: kernels compiled and loaded
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    main.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=main):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000)
            y1 = ops.matmul(xs[1], qts[1])
        torch.cuda._sleep(1_000_000)
        y0 = ops.matmul(xs[0], qts[0])
        main.wait_stream(side)
    for i in range(30):
        for x in xs:
            x.copy_(torch.randn(m, KD, device="cuda").half())
        g.replay()
        refs = [_unplanned(x, qt) for qt, x in zip(qts, xs)]
        torch.cuda.synchronize()
        assert torch.equal(y0, refs[0]) and torch.equal(y1, refs[1]), f"{fmt} M={m}: replay {i} differs"


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_overlapping_x_is_refused(weights, fmt):
    qt, m = weights[fmt], 8
    mod = ops.kernels_for(qt.fmt)
    flat = torch.randn(m * (KD + N), device="cuda").half()
    x, out = flat[: m * KD].view(m, KD), flat[m * KD - 64: m * KD - 64 + m * N].view(m, N)
    mod.matmul(torch.randn(m, KD, device="cuda").half(), qt)     # a plan for M = 8 exists
    with pytest.raises(ValueError, match="out: overlaps x"):
        mod.matmul(x, qt, out=out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_threads_on_one_stream(weights, fmt):
    """Host threads share the device's default stream, and with it the workspaces cached per
    (kind, device, stream): one thread's planned M = 1 calls and another's unplanned M = 8 ones
    (a forced path) must not get between each other's launches -- a quantize of one between the
    quantize and the GEMV of the other gave the GEMV the other call's Q8_1 activations."""
    import sys
    import threading

    qt = weights[fmt]
    mod = ops.kernels_for(qt.fmt)
    xs = [torch.randn(m, KD, device="cuda").half() for m in (1, 8)]
    forced = "small" if qt.format == "awq" else "mmvq"   # (AWQ's split-K small-M kernel)
    calls = [lambda: ops.matmul(xs[0], qt), lambda: mod.matmul(xs[1], qt, path=forced)]
    refs = [_unplanned(xs[0], qt), calls[1]()]   # each call alone (a forced path is never planned)
    torch.cuda.synchronize()
    wrong = []

    def loop(i):
        try:
            for _ in range(300):
                if not torch.equal(calls[i](), refs[i]):
                    wrong.append(i)
        except Exception as e:   # noqa: BLE001 -- a thread's error must fail the test, not pass it
            wrong.append(f"thread {i}: {type(e).__name__}: {e}")

    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # a thread switch between two launches of one call, often
    try:
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), f"{fmt}: a thread never finished (a deadlock?)"
    finally:
        sys.setswitchinterval(saved)
    assert not wrong, f"{fmt}: {len(wrong)} of 600 calls gave another call's product"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 40, 600])
def test_replay_alone(weights, fmt, m):
    """kernels.replay (the runner's linears: Linear.planned / from_q8_1) runs nothing and says
    False until a matmul has recorded the key's plan, then replays it bit-identically to an
    unplanned call at new addresses -- plain, glu and (GGUF at mmvq's M) from Q8_1 -- and says
    False again inside a capture, for an x off a 16-byte boundary, and once the plans are dropped."""
    from quantzoo.cuda_launch import workspaces_changed
    from quantzoo.kernels import gguf

    qt = weights[fmt]
    workspaces_changed()
    big = torch.randn(2 * m + 1, KD, device="cuda").half()
    x1, x2 = big[:m], big[m + 1:]                      # two addresses
    y = torch.full((m, N), float("nan"), device="cuda", dtype=torch.float16)
    assert not K.replay(qt, m, x1, y) and torch.isnan(y).all()
    ops.matmul(x1, qt)                                  # records the plan
    assert K.replay(qt, m, x2, y)
    assert torch.equal(y, _unplanned(x2, qt))
    mod = ops.kernels_for(qt.fmt)
    yg = torch.empty((m, N // 2), device="cuda", dtype=torch.float16)
    mod.matmul(x1, qt, glu=True)
    assert K.replay(qt, ("glu", m), x2, yg)
    saved, K.PLANS = K.PLANS, False
    try:
        assert torch.equal(yg, mod.matmul(x2, qt, glu=True))
    finally:
        K.PLANS = saved
    layout = gguf.q8_1_layout(qt, m) if qt.fmt.kernels == "gguf" else None
    if layout is not None:
        xq = gguf.quantize_q8_1_split(x2) if layout == "split" else gguf.quantize_q8_1(x2).view(-1)
        want = gguf.matmul_q8_1(xq, qt, m, layout)      # records ("q8_1", m)
        yq = torch.empty((m, N), device="cuda", dtype=torch.float16)
        assert K.replay(qt, ("q8_1", m), xq, yq) and torch.equal(yq, want)
    # each refusal right after the same replay succeeds (a call above may have grown a workspace,
    # which drops the plans: a refusal then would say nothing)
    odd = torch.empty(m * KD + 4, device="cuda", dtype=torch.float16)[4:].view(m, KD)   # 8 bytes in
    ops.matmul(x1, qt)
    assert K.replay(qt, m, x2, y)
    assert odd.data_ptr() % 16 and not K.replay(qt, m, odd, y)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ops.matmul(x1, qt)                              # (this stream's plan)
        assert K.replay(qt, m, x2, y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            assert not K.replay(qt, m, x2, y)
    torch.cuda.synchronize()
    ops.matmul(x1, qt)
    assert K.replay(qt, m, x2, y)
    workspaces_changed()
    assert not K.replay(qt, m, x2, y)
    torch.cuda.synchronize()
