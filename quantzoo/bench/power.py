"""Sustained clock, power and energy of a launch: is the card at its power limit?

At large M a tensor-core product, cuBLAS's as much as ours, draws the card's whole power limit
(700 W on the lent H100), and the driver lowers the SM clock to stay under it (clock-event
reason "SW power cap"). With every product at the same power, time is energy over the limit:
a kernel that leaves the tensor cores idle part of the time runs at a higher clock and still
loses, and its ratio to cuBLAS is a ratio of energies per product as much as of cycles
(bench/NOTES.md, session 28). The bench's short timings see mostly that state. This module
replays a launch's graph for a second or two while nvidia-smi samples the SM clock, the board
power (the instantaneous reading where the driver has one: `power.draw` is a 1 s average on
recent cards) and the clock-event reasons every INTERVAL_MS, and keeps the second half (the
first is the driver settling): the median clock, and the mean power, since the energy of the
stretch is power integrated over time and the cap holds the power's average, not each sample
(instantaneous readings at the cap scatter by +-50 W). nvidia-smi, not NVML bindings: it ships
with the driver, so there is nothing more to install.
"""
from __future__ import annotations

import functools
import statistics
import subprocess
import threading
import time

INTERVAL_MS = 50
CLOCK = "clocks.sm"
POWER_FIELDS = ("power.draw.instant", "power.draw")      # newer drivers first
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SW_POWER_CAP = 0x4
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake",
           0x100: "display clocks"}
MIN_SAMPLES = 4


def parse(text: str) -> list[tuple[float, float, int]]:
    """(SM clock MHz, board power W, reason bits) per line of `--format=csv,noheader,nounits`
    output of CLOCK, a power field and a reason field; lines that do not parse ("[N/A]",
    messages) are skipped."""
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


def summarize_samples(samples: list[tuple[float, float, int]]) -> dict:
    """Over the second half of the samples: the median SM clock, the mean power, the share of
    samples at the power cap and the reasons seen (names, and the bits)."""
    if len(samples) < MIN_SAMPLES:
        raise ValueError(f"nvidia-smi gave {len(samples)} usable samples, fewer than {MIN_SAMPLES}")
    keep = samples[len(samples) // 2:]
    bits = 0
    for s in keep:
        bits |= s[2]
    return {"sm_clock_mhz": statistics.median(s[0] for s in keep),
            "power_w": statistics.fmean(s[1] for s in keep),
            "power_capped": sum(bool(s[2] & SW_POWER_CAP) for s in keep) / len(keep),
            "clock_reasons": [name for bit, name in REASONS.items() if bits & bit],
            "clock_reason_bits": bits}


def _query(cmd, device_id: str, fields) -> list[str]:
    return [*cmd, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits", "-i", device_id]


@functools.lru_cache(maxsize=None)
def fields_for(cmd=("nvidia-smi",), device_id: str = "0") -> tuple[tuple[str, str], float | None]:
    """((power field, reason field) this driver's nvidia-smi answers, the card's enforced power
    limit in W or None), asked once per command and card; a ValueError naming the command if no
    pair works."""
    errs = []
    for reason in REASON_FIELDS:
        for pw in POWER_FIELDS:
            try:
                r = subprocess.run(_query(cmd, device_id, (CLOCK, pw, reason)), capture_output=True, text=True,
                                   timeout=20)
            except (OSError, subprocess.SubprocessError) as e:
                raise ValueError(f"{cmd[0]}: cannot run it ({type(e).__name__}: {e})") from None
            if r.returncode == 0 and parse(r.stdout):
                return (pw, reason), _power_limit(cmd, device_id)
            errs.append(((r.stdout + r.stderr).strip().splitlines() or [""])[0][:80])
    raise ValueError(f"{cmd[0]} -i {device_id}: no clock/power sample ({'; '.join(dict.fromkeys(errs))})")


def _power_limit(cmd, device_id: str) -> float | None:
    try:
        r = subprocess.run(_query(cmd, device_id, ("enforced.power.limit",)), capture_output=True, text=True,
                           timeout=20)
        return float(r.stdout.strip().splitlines()[0]) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def sustained(replay, sync, calls_per_replay: int, seconds: float = 1.5, device_id: str = "0",
              cmd=("nvidia-smi",)) -> dict:
    """Replay (a graph of calls_per_replay launches) back to back for `seconds` while nvidia-smi
    samples; returns summarize_samples()'s fields, power_limit_w, sustained_us (wall time per
    launch over the whole stretch) and mj_per_call: mean power x sustained_us, the energy of one
    launch as far as the board power tells it."""
    fields, limit = fields_for(cmd, device_id)
    replay()
    sync()
    proc = subprocess.Popen(_query(cmd, device_id, (CLOCK, *fields)) + ["-lms", str(INTERVAL_MS)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []   # read as they come: a full pipe would stall nvidia-smi on long runs
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # the stretch starts once the sampler answers (nvidia-smi takes a while to start; a
        # stretch timed from its launch had its first part unsampled, and a short one on a busy
        # host got too few samples); the replays meanwhile keep the GPU at work, uncounted
        wait_until = time.perf_counter() + 2.0
        while not lines and proc.poll() is None and time.perf_counter() < wait_until:
            replay()
            sync()
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
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    out = summarize_samples(parse("".join(lines)))
    us = dt / (n * calls_per_replay) * 1e6
    out.update(power_limit_w=limit, sustained_us=us, mj_per_call=out["power_w"] * us * 1e-3, sustained_s=dt)
    return out


def smi_id(device=None) -> str:
    """nvidia-smi's -i for a torch device: its UUID, which names the same card whatever
    CUDA_VISIBLE_DEVICES and the device order are (ValueError where torch has none)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "") or "")
    if not uuid:
        raise ValueError(f"{dev}: torch gives no UUID to find this card in nvidia-smi")
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def of_launches(fn, inner: int, seconds: float) -> dict:
    """sustained() for fn(0) .. fn(inner - 1) captured in one CUDA graph (timing.capture_graph)."""
    import torch

    from . import timing

    return sustained(timing.capture_graph(fn, inner).replay, torch.cuda.synchronize, inner, seconds, smi_id())
