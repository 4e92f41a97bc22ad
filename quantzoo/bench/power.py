"""Sustained clock, power and energy of a launch: is the card at its power limit?

At large M a tensor-core product, cuBLAS's as much as ours, draws the card's whole power limit
(700 W on the lent H100), and the driver lowers the SM clock to stay under it (clock-event
reason "SW power cap"). Time there is energy over the limit: a kernel that leaves the tensor
cores idle part of the time runs at a higher clock and still loses, and its ratio to cuBLAS is a
ratio of energies as much as of cycles (bench/NOTES.md, session 28). The bench's ~30 ms timings
see mostly that state. This module replays a launch's graph for a second or two while
nvidia-smi samples the SM clock, the board power and the clock-event reasons every 50 ms, and
keeps the medians of the second half (the first is the driver settling). nvidia-smi, not NVML
bindings: it ships with the driver, so there is nothing more to install.
"""
from __future__ import annotations

import statistics
import subprocess
import time

INTERVAL_MS = 50
FIELDS = "clocks.sm,power.draw"
# the active clock-event reasons: the newer drivers' name first, then the older one
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SW_POWER_CAP = 0x4
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake"}
MIN_SAMPLES = 4


def parse(text: str) -> list[tuple[float, float, int]]:
    """(SM clock MHz, board power W, reason bits) per line of `--format=csv,noheader,nounits`
    output; lines that do not parse ("[N/A]", messages) are skipped."""
    out = []
    for line in text.splitlines():
        f = [s.strip() for s in line.split(",")]
        if len(f) != 3:
            continue
        try:
            out.append((float(f[0]), float(f[1]), int(f[2], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: list[tuple[float, float, int]]) -> dict:
    """Medians of the second half of the samples, the share of them at the power cap and the
    reasons seen there."""
    if len(samples) < MIN_SAMPLES:
        raise ValueError(f"nvidia-smi gave {len(samples)} usable samples, fewer than {MIN_SAMPLES}")
    keep = samples[len(samples) // 2:]
    bits = 0
    for s in keep:
        bits |= s[2]
    return {"sm_clock_mhz": statistics.median(s[0] for s in keep),
            "power_w": statistics.median(s[1] for s in keep),
            "power_capped": sum(bool(s[2] & SW_POWER_CAP) for s in keep) / len(keep),
            "clock_reasons": [name for bit, name in REASONS.items() if bits & bit]}


def _query(cmd, device_id: str, field: str) -> list[str]:
    return [*cmd, f"--query-gpu={FIELDS},{field}", "--format=csv,noheader,nounits", "-i", device_id]


def reason_field(cmd=("nvidia-smi",), device_id: str = "0") -> str:
    """The clock-event field this driver's nvidia-smi knows (ValueError naming the command if
    neither works)."""
    errs = []
    for field in REASON_FIELDS:
        try:
            r = subprocess.run(_query(cmd, device_id, field), capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as e:
            raise ValueError(f"{cmd[0]}: cannot run it ({type(e).__name__}: {e})") from None
        if r.returncode == 0 and parse(r.stdout):
            return field
        errs.append((r.stdout + r.stderr).strip().splitlines()[:1])
    raise ValueError(f"{cmd[0]} -i {device_id}: no clock/power sample ({errs})")


def sustained(replay, sync, calls_per_replay: int, seconds: float = 1.5, device_id: str = "0",
              cmd=("nvidia-smi",)) -> dict:
    """Replay (a graph of calls_per_replay launches) back to back for `seconds` while nvidia-smi
    samples; returns summarize()'s fields and sustained_us (wall time per launch over the whole
    stretch) and mj_per_call (median power x that time)."""
    field = reason_field(cmd, device_id)
    replay()
    sync()
    proc = subprocess.Popen(_query(cmd, device_id, field) + ["-lms", str(INTERVAL_MS)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        t0 = time.perf_counter()
        n = 0
        while True:
            replay()
            n += 1
            if n % 16 == 0:
                sync()
                if time.perf_counter() - t0 >= seconds:
                    break
        dt = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            text = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0]
    out = summarize(parse(text))
    us = dt / (n * calls_per_replay) * 1e6
    out.update(sustained_us=us, mj_per_call=out["power_w"] * us * 1e-3, sustained_s=dt)
    return out


def smi_id(device=None) -> str:
    """nvidia-smi's -i for a torch device: its UUID (right under CUDA_VISIBLE_DEVICES too), else
    its index."""
    import torch

    p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    uuid = str(getattr(p, "uuid", "") or "")
    return (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid else str(torch.cuda.current_device())


def of_launches(fn, inner: int, seconds: float) -> dict:
    """sustained() for fn(0) .. fn(inner - 1) captured in one CUDA graph (timing.capture_graph)."""
    import torch

    from . import timing

    g = timing.capture_graph(fn, inner)
    try:
        return sustained(g.replay, torch.cuda.synchronize, inner, seconds, smi_id())
    finally:
        del g
