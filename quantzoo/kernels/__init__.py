"""GPU kernels' Python side: awq, gguf and fp16 expose matmul(x, qt) for CUDA tensors; layer_ops,
persistent and stream hold the runner's per-layer ops, the persistent decode kernel and the
stream read; wgmma_tiles the wgmma kernels' tile schedule; workspaces their scratch buffers.

Modules here import CuPy lazily (quantzoo.cuda_launch): the package works without CUDA.
"""
import threading


def checked_once(qt, check):
    """check(qt) (a weight validation that raises ValueError or returns what the launches need),
    run once per QuantizedTensor and remembered on it while its storage tensors stay the same
    objects at the same addresses (replacing one in qt.data, or re-pointing one in place --
    t.data = other, set_, a resize_ that reallocates -- re-runs the check and drops the launch
    plans, which hold the old addresses). A matmul's weight checks cost tens of microseconds of
    Python per call, as much as a small kernel's GPU time; x is still checked on every call.
    The addresses cost one data_ptr() per storage tensor a call (AWQ's three: the memo's test
    1.14 -> 1.24 us, best of 11 on the 2-core CPU box). A shape, stride or dtype changed in place
    at the same address (t_, as_strided_, t.data = t.view(dtype)) is not noticed: do not do that
    to a weight in use."""
    data = getattr(qt, "data", None)
    parts = tuple(data.values()) if isinstance(data, dict) else (data,)
    memo = getattr(qt, "__dict__", {}).get("_kernels_checked")
    # (len(memo) == 5: a weight pickled before the addresses were kept carries a memo of 4 slots,
    # whose memo[4] was an IndexError on its first call: checked again instead)
    if memo is not None and memo[0] is check and _memo_current(memo, parts):
        return memo[2]
    result = check(qt)
    try:   # QuantizedTensor is a frozen dataclass: the memo is not one of its fields
        # the 4th slot holds the weight's launch plans (run_planned), dropped with the memo; the 5th
        # its storage addresses, which the plans replay
        from quantzoo.cuda_launch import PlanCache

        object.__setattr__(qt, "_kernels_checked", (check, parts, result, PlanCache(), _addresses(parts)))
    except (AttributeError, TypeError):
        pass
    return result


def _memo_current(memo, parts) -> bool:
    """Whether a checked_once memo still describes these storage tensors: the same objects at the
    same addresses."""
    if len(memo) != 5 or len(memo[1]) != len(parts):
        return False
    for a, b, at in zip(memo[1], parts, memo[4]):
        if a is not b or (at is not None and b.data_ptr() != at):
            return False
    return True


def _addresses(parts) -> tuple:
    """Where each storage tensor's memory starts (None for what has no data_ptr: a numpy array,
    which the kernels' checks refuse)."""
    return tuple(p.data_ptr() if hasattr(p, "data_ptr") else None for p in parts)


def negated(name: str, written: bool = False) -> str:
    """The ValueError message for a tensor with torch's negative bit set (a lazily negated view,
    torch._neg_view): its memory holds the negated values, and the kernels read and write memory
    by address, so an x or weight went in with its sign flipped and an `out` read back as -y,
    without a word. (z.conj().imag is one too, but strided: refused as not contiguous, and its
    .contiguous() copy holds the values.) The checks ask t.is_neg() next to t.is_contiguous():
    0.15-0.35 us a call on the 2-core CPU box for x (and a given out), the weights once
    (checked_once). The conjugate bit needs no test: only complex tensors carry it, and the dtype
    checks refuse those."""
    if written:
        return (f"{name}: a lazily negated view (its negative bit is set); the kernels write its memory, "
                "which would read back negated: pass a tensor without it")
    return (f"{name}: a lazily negated view (its negative bit is set); the kernels read its memory, which "
            f"holds the negated values: pass {name}.resolve_neg()")


def check_out_overlap(x, out) -> None:
    """ValueError when the output tensor shares bytes with x: every kernel reads x while (or
    after) it writes y, so an aliased output gives a silently wrong product. Checked on every
    call that is given an `out` (a forced path, a graph capture and an unplanned call as well
    as a planned one)."""
    if out is None:
        return
    xb, yb = x.numel() * x.element_size(), out.numel() * out.element_size()
    if not xb or not yb:
        return
    xp, yp = x.data_ptr(), out.data_ptr()
    if xp < yp + yb and yp < xp + xb:
        raise ValueError("out: overlaps x; the matmul needs a separate output")


PLANS = True            # run_planned replays recorded launches (False: every call runs queue())
# Held around every launch sequence that uses the cached workspaces (a plan's replay or recording,
# an unplanned call, a release): they are per (kind, device, stream), and host threads share a
# stream (every thread's default one is the device's), so one call's quantize -> GEMV (or split-K
# partials -> reduce) must not have another thread's launches, or its workspace growth, between them.
_LOCK = threading.Lock()


def run_unplanned(queue) -> None:
    """queue() (a call's launches, a forced path's or awq_gemm's, which record no plan) under
    _LOCK, as run_planned's calls: it uses the cached workspaces all the same. Not during a
    capture or inside cuda_launch.fresh_workspaces(), whose workspaces are the call's own."""
    from quantzoo import cuda_launch as cl

    if cl.uncached_workspaces():
        queue()
        return
    with _LOCK:
        queue()


def run_planned(qt, m: int, x, y, queue) -> None:
    """Run one matmul of x (M rows) by weight qt into y: queue() launches its kernels, its torch
    work going through cuda_launch.torch_step. The first such call per (M, stream) records them
    as a cuda_launch.Plan on qt's checked_once memo; later calls replay it with x's and y's
    addresses, skipping the path choice, tile schedule and argument packing (tens of
    microseconds of Python per call). Never inside a CUDA graph capture, whose workspaces are
    the graph's own (nor inside cuda_launch.fresh_workspaces()); a workspace (re)allocation or
    release (cuda_launch.workspaces_changed) drops every plan, and the next call records anew.
    The weight must have passed checked_once, which holds the plans (cuda_launch.PlanCache). y
    must not overlap x (the callers refuse a given out that does, check_out_overlap; a plan could
    not tell their pointers apart)."""
    from quantzoo import cuda_launch as cl

    memo = qt.__dict__.get("_kernels_checked")
    if cl.uncached_workspaces():   # workspaces of the call's own: nothing shared
        queue()
        return
    xp, xb, yp, yb = x.data_ptr(), x.numel() * x.element_size(), y.data_ptr(), y.numel() * y.element_size()
    if not PLANS or memo is None or (xp | yp) % 16:
        # (off a 16-byte boundary: a plan replays launch choices made for the recorded addresses
        # -- gguf's split-K reduce writes 8 bytes at a time into an 8-byte-aligned y -- so such a
        # view runs unplanned, its launches chosen for its own address)
        with _LOCK:   # unplanned, but on the shared workspaces all the same
            queue()
        return
    plans = memo[3]
    key = (m, cl.current_stream_ptr())
    with _LOCK:   # a replay re-aims shared argument slots: one at a time
        plan = plans.get(key)
        if plan is not None:
            plan.replay(x, y)
            return
        with cl.recording() as rec:
            queue()
        plans.put(key, cl.Plan(rec.launches, xp, xb, yp, yb))


def replay(qt, key, x, y) -> bool:
    """run_planned's replay alone: True when weight qt holds a plan for key on the current stream
    (a matmul's earlier call recorded it) and it has run on x and y; False, launching nothing,
    where it does not (no plan yet, a capture, fresh_workspaces(), a storage tensor replaced since
    the weight's check, x or y off a 16-byte boundary) -- the caller then makes the matmul call,
    which records one. For callers that have checked x and y themselves and pass the key their
    matmul records under: the runner's linears on its own contiguous fp16 rows (model/llm.py,
    Linear.planned), whose calls -- 5 a layer in a prefill -- cost 40-45 us of host time through
    ops.matmul against ~16 us of replay on the lent H100's host (bench/NOTES.md, session 55)."""
    from quantzoo import cuda_launch as cl

    memo = qt.__dict__.get("_kernels_checked")
    data = getattr(qt, "data", None)
    if (not PLANS or memo is None or (x.data_ptr() | y.data_ptr()) % 16
            or not _memo_current(memo, tuple(data.values()) if isinstance(data, dict) else (data,))
            or cl.uncached_workspaces()):
        return False
    with _LOCK:
        plan = memo[3].get((key, cl.current_stream_ptr()))
        if plan is None:
            return False
        plan.replay(x, y)
    return True
