"""The scratch memory the kernels' launches share: split-K partials, Q8_1 activations, dequantised
weight slabs, the GLU product (scratch), and split-K tile counters (counters).

Eager calls: one buffer per (kind, device, torch's current stream), grown and never shrunk, reused
by every call of either format (calls on one stream run in order, so an AWQ and a GGUF call may
share the dequant slab). Kernels queued on two streams at once must not share partials or
counters, hence the stream in the key; host threads that share a stream take kernels._LOCK
around a call's launches (kernels.run_planned / run_unplanned), and growing a buffer drops the
launch plans that point into the old one (cuda_launch.workspaces_changed).

During a CUDA graph capture, and inside cuda_launch.fresh_workspaces() (torch.compile's CUDA
graphs), a call's scratch is a tensor of its own from torch's allocator -- during a capture the
graph's private pool, which keeps its memory for the replays -- freed when the call returns (a
later allocation in the same capture may reuse it: the graph runs in stream order). So a graph
never points into the eager caches: growing or releasing them cannot break one, and a graph's
replay on another stream shares nothing with eager calls there.

Counters must read zero when a kernel starts; each kernel leaves the counters it used at zero
again (cuda/awq_common.cuh's atomicInc wraps, wg::hand_over and wg::meet store 0), so consecutive launches
on one stream share one zeroed buffer. Zeroing costs a memset, which in a graph is a node that
also breaks the programmatic-dependent-launch chain: a capture therefore gets one counter buffer
per stream it runs on, zeroed at its first use there (one memset node per graph and stream) and
shared by its later calls there, kept here until the capture is seen to have ended
(capture_counters). Per stream, as eager calls': a capture forked onto a second stream
(s2.wait_stream(s1) inside it) becomes a graph that runs the two branches' kernels at once, and
a branch's memset is ordered with that branch only. Inside fresh_workspaces() every call
zeroes its own (torch's CUDA-graph trees refuse a live buffer in their pool that their outputs
do not account for, so none may outlive the call).
"""
from __future__ import annotations

import torch

from quantzoo import cuda_launch as cl

MIN_SCRATCH_BYTES = 1 << 16   # a first allocation's least size: small calls grow it less often
MIN_COUNTERS = 4096           # counters a buffer holds at least (one per output tile)

_CACHE: dict = {}      # (kind, device str, stream handle or None) -> uint8 or int32 tensor
_CAPTURES: dict = {}   # (device str, capture id, stream handle) -> zeroed int32 tensor


def _key(kind: str, device) -> tuple:
    device = torch.device(device)
    return kind, str(device), cl.current_stream_ptr() if device.type == "cuda" else None


def scratch(kind: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """numel elements of dtype (contents undefined) for this call's launches; hold the tensor
    until the last launch that uses it is queued."""
    nbytes = max(numel, 1) * dtype.itemsize
    if cl.uncached_workspaces():
        return torch.empty(nbytes, dtype=torch.uint8, device=device).view(dtype)
    key = _key(kind, device)
    buf = _CACHE.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = _CACHE[key] = torch.empty(max(nbytes, MIN_SCRATCH_BYTES), dtype=torch.uint8, device=device)
        cl.workspaces_changed()   # launch plans may point into the old buffer, now freed
    return buf[:nbytes].view(dtype)


def counters(numel: int, device) -> torch.Tensor:
    """At least max(numel, MIN_COUNTERS) int32 counters, zero when the next launch on this
    stream starts (see the module's docstring for who zeroes them when)."""
    numel = max(numel, MIN_COUNTERS)
    if cl.uncached_workspaces():
        return capture_counters(numel, device)
    key = _key("counters", device)
    buf = _CACHE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _CACHE[key] = torch.zeros(numel, dtype=torch.int32, device=device)
        cl.workspaces_changed()
    return buf


def capture_counters(numel: int, device) -> torch.Tensor:
    """A capture's counters: one buffer per capture (by its id) and stream, zeroed when first
    taken, grown (zeroed again) if a later call needs more. Inside fresh_workspaces(), or a
    capture whose id cannot be read, a zeroed buffer per call."""
    stream = cl.current_stream_ptr()
    cid = None if cl.fresh_workspaces_on() else cl.capture_id(stream)
    if cid is None:
        return torch.zeros(numel, dtype=torch.int32, device=device)
    key = (str(torch.device(device)), cid, stream)
    buf = _CAPTURES.get(key)
    if buf is None:
        # a new capture (or stream of one): forget those that have ended (their graphs' own pools
        # keep the memory; each graph re-zeroes its buffer as it replays)
        for k in list(_CAPTURES):
            if _capture_on(k[2]) != k[1]:   # (a driver call: another thread may drop k meanwhile)
                _CAPTURES.pop(k, None)
    if buf is None or buf.numel() < numel:
        buf = _CAPTURES[key] = torch.zeros(numel, dtype=torch.int32, device=device)
    return buf


def _capture_on(stream: int):
    """The capture id under way on stream; None where there is none or the driver refuses the
    handle (a stream destroyed since its capture: a CuPy or external one)."""
    try:
        return cl.capture_id(stream)
    except RuntimeError:
        return None


def release() -> None:
    """Drop the eager caches (the dequant slab can be as large as the largest weight). Not while
    another thread's call is between its launches (taken under kernels._LOCK). Captured graphs
    do not use these buffers."""
    from quantzoo.kernels import _LOCK

    with _LOCK:
        _CACHE.clear()
        cl.workspaces_changed()
