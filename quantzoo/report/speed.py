"""Kernel speed figures for the report, from a `quantzoo bench kernels` JSON.

Headline numbers aggregate one Qwen3-8B decoder layer: its seven linears (q, k, v, o, gate, up,
down = 2x 4096->4096, 2x 4096->1024, 2x 4096->12288, 1x 12288->4096) run back to back, so

    % of roofline at M   = sum(roofline time) / sum(measured time)       over the 7 linears
    x cuBLAS fp16 at M   = sum(cuBLAS fp16 time) / sum(measured time)

where a linear's roofline time is max(bytes / copy bandwidth, flops / cuBLAS fp16 TFLOP/s), both
ceilings measured in the same bench run. If the bench did not cover all four shapes, the
shapes it did cover are summed once each (the report says so).
"""
from __future__ import annotations

import json

from .checks import BASELINE, check_kernels_bench


def load_json(path, what: str):
    """A JSON file, or one clear error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a {what} JSON file ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file ({e.strerror or e})") from None


def load_bench(path) -> dict:
    res = load_json(path, "`quantzoo bench kernels`")
    check_kernels_bench(res, str(path))
    return res


def ok_rows(res: dict) -> list[dict]:
    return [r for r in res["results"] if r.get("status") == "ok"]


def qwen3_layer() -> dict:
    """{(K, N): count} of one Qwen3-8B decoder layer's linears, from quantzoo.report.sizes (the
    one place the report keeps that model's shapes): what the headline figures sum."""
    from .sizes import qwen3_linears

    out: dict = {}
    for _name, n, k in qwen3_linears():
        out[(k, n)] = out.get((k, n), 0) + 1
    return out


def layer_weights(res: dict) -> tuple[dict, bool]:
    """{(k, n): count per layer} and whether that is the real Qwen3-8B layer mix: the mix of
    qwen3_layer() wherever the bench covered its four shapes, whether or not the file has
    settings.qwen3_8b_layer (older benches lack it; checks refuse one that disagrees), else
    every bench shape once."""
    layer = qwen3_layer()
    present = {(r["k"], r["n"]) for r in res["results"]}
    if set(layer) <= present:
        return layer, True
    return {s: 1 for s in sorted(present)}, False


def aggregate(res: dict, fmt: str, m: int) -> dict | None:
    """Layer-aggregated time, roofline % and x cuBLAS at one M (None if a shape is missing)."""
    weights, _ = layer_weights(res)
    rows = {(r["format"], r["k"], r["n"], r["m"]): r for r in ok_rows(res)}
    t = roof = base = 0.0
    for (k, n), c in weights.items():
        r = rows.get((fmt, k, n, m))
        b = rows.get((BASELINE, k, n, m))
        if r is None:
            return None
        t += c * r["median_us"]
        roof += c * r["roofline_us"]
        base = (base + c * b["median_us"]) if (b is not None and base is not None) else None
    return {"us": t, "pct_roofline": 100.0 * roof / t,
            "x_cublas": (base / t) if base else None}


def read_floor(res: dict, fmt: str) -> dict | None:
    """The layer at M = 1 (layer_weights) against the fastest one-launch read of each of its
    weights (rows' read_us, cuda/stream_read.cu): kernel and read times summed over the layer,
    plain (us, read_us) and under PDL (us_pdl, read_us_pdl; None where the bench lacks them).
    None when a shape's M = 1 row or its read is missing (benches from before reads were timed)."""
    weights, _ = layer_weights(res)
    rows = {(r["k"], r["n"]): r for r in ok_rows(res) if r["format"] == fmt and r["m"] == 1}
    out = {"us": 0.0, "read_us": 0.0, "us_pdl": 0.0, "read_us_pdl": 0.0, "bytes": 0}
    for (k, n), c in weights.items():
        r = rows.get((k, n))
        if r is None or not r.get("read_us"):
            return None
        out["bytes"] += c * r["weight_bytes"]
        for key in ("us", "read_us", "us_pdl", "read_us_pdl"):
            v = r.get("median_" + key if key.startswith("us") else key)
            out[key] = None if (v is None or out[key] is None) else out[key] + c * v
    return out


def sustained(res: dict) -> list[dict]:
    """The rows the bench's power probe sampled (quantzoo.bench.power), by M, then in the bench's
    format order, each with sustained_x_cublas and energy_x_cublas: cuBLAS fp16's sustained time
    and mJ per product over the format's at the same shape and M (None without a baseline)."""
    fmts = formats_in(res)
    rows = [r for r in ok_rows(res) if r.get("mj_per_call")]
    base = {(r["k"], r["n"], r["m"]): r for r in rows if r["format"] == BASELINE}
    out = []
    for r in sorted(rows, key=lambda r: (r["m"], fmts.index(r["format"]))):
        b = base.get((r["k"], r["n"], r["m"]))
        out.append(dict(r, sustained_x_cublas=b["sustained_us"] / r["sustained_us"] if b else None,
                        energy_x_cublas=b["mj_per_call"] / r["mj_per_call"] if b else None))
    return out


def eager_rows(res: dict) -> list[dict]:
    """The ok rows the bench timed from eager launches, not graph replays (its `timing`: "eager"
    under --no-graph, "eager (graph capture failed: ...)" where a capture failed): their times
    include the host's cost of each launch. A row without the field is taken as a graph one."""
    return [r for r in ok_rows(res) if r.get("timing", "graph") != "graph"]


NMSE_SANITY = 2.0   # a timed kernel's NMSE over this x its format's ceiling: not the product


def wrong_results(res: dict) -> list[str]:
    """'fmt K->N M=m: why' for each ok row whose timed kernel failed the bench's check of its
    output against x @ W.T (the row's nmse_error: NaN or inf in the output; or an nmse over
    NMSE_SANITY x the format's nmse_ceiling, which a right kernel stays under with room)."""
    from quantzoo import formats

    out = []
    for r in ok_rows(res):
        ceiling = formats.get(r["format"]).nmse_ceiling
        if r.get("nmse_error"):
            why = r["nmse_error"]
        elif r.get("nmse") is not None and ceiling and r["nmse"] > NMSE_SANITY * ceiling:
            why = f"NMSE {100 * r['nmse']:.3g} % (over twice the format's ceiling, {100 * ceiling:.3g} %)"
        else:
            continue
        out.append(f"{r['format']} {r['k']}->{r['n']} M={r['m']}: {why}")
    return out


def read_errors(res: dict) -> list[str]:
    """'fmt K->N: error' for each ok row whose one-launch read failed (its read_error; read_floor
    has no figure for that format)."""
    return [f"{r['format']} {r['k']}->{r['n']}: {r['read_error']}" for r in ok_rows(res) if r.get("read_error")]


def power_errors(res: dict) -> list[str]:
    """The power probe's errors (rows' power_error), each once."""
    return list(dict.fromkeys(r["power_error"] for r in res["results"] if r.get("power_error")))


def streaming_fit(res: dict, fmt: str, m: int = 1, key: str = "median_us") -> dict | None:
    """A straight line t = fixed + weight bytes / rate through the bench's shapes at M = m, t the
    rows' `key` (median_us; median_us_pdl: the same launches under programmatic dependent launch,
    as the runner's decode graph makes them). Least squares; None with fewer than two weight
    sizes or a slope that is not positive.
    fixed_us is what a launch costs whatever its weight's size (launch, first loads, tail) and
    rate_tbps how fast the extra bytes of a larger weight stream: at M = 1 a low % of roofline
    with a rate near copy bandwidth says the kernel is launch-bound, not stream-bound."""
    pts = [(r["weight_bytes"], r[key]) for r in ok_rows(res)
           if r["format"] == fmt and r["m"] == m and r.get("weight_bytes") and r.get(key)]
    if len({b for b, _ in pts}) < 2:
        return None
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    slope = (sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts))  # us / byte
    if slope <= 0:
        return None
    fixed = mt - slope * mb
    return {"fixed_us": fixed, "rate_tbps": 1e-6 / slope, "shapes": n,
            "max_residual_us": max(abs(fixed + slope * b - t) for b, t in pts)}


def formats_in(res: dict) -> list[str]:
    seen = []
    for r in res["results"]:
        if r["format"] not in seen:
            seen.append(r["format"])
    return seen


def status_of(res: dict, fmt: str) -> str:
    st = {r["status"] for r in res["results"] if r["format"] == fmt}
    if st == {"ok"}:
        return "ok"
    if "ok" in st:
        return "partial"
    return "missing" if "missing" in st else "error"


def first_error(res: dict, fmt: str) -> str:
    for r in res["results"]:
        if r["format"] == fmt and r["status"] != "ok":
            return r.get("error") or r["status"]
    return ""


def path_changes(res: dict, fmt: str) -> dict:
    """{shape 'K->N': [(m, path), ...]} listing the path at the smallest M and each change."""
    out = {}
    by_shape: dict = {}
    for r in ok_rows(res):
        if r["format"] == fmt:
            by_shape.setdefault(f"{r['k']}->{r['n']}", []).append((r["m"], r.get("path") or "?"))
    for shape, pts in by_shape.items():
        pts.sort()
        ch = [pts[0]]
        for m, p in pts[1:]:
            if p != ch[-1][1]:
                ch.append((m, p))
        out[shape] = ch
    return out


def crossover_text(res: dict, fmt: str) -> str:
    """'mmvq, mmq from M=16, dequant from M=64' (the bench's M grid) when every shape switches
    at the same M; per shape otherwise. 'from M<=32' where the grid's M before 32 has no ok row
    of the format and shape (the change may have come there)."""
    ch = path_changes(res, fmt)
    if not ch:
        return ""
    grid = ms_in(res)
    timed = {(f"{r['k']}->{r['n']}", r["m"]) for r in ok_rows(res) if r["format"] == fmt}

    def since(shape, m):   # 'M<=32' where the grid's M before it has no ok row: the path there is unknown
        i = grid.index(m)
        return f"M={m}" if i == 0 or (shape, grid[i - 1]) in timed else f"M<={m}"

    texts = {shape: ", ".join(p if i == 0 else f"{p} from {since(shape, m)}" for i, (m, p) in enumerate(pts))
             for shape, pts in ch.items()}
    uniq = set(texts.values())
    if len(uniq) == 1:
        return uniq.pop()
    return "; ".join(f"{s}: {t}" for s, t in texts.items())


def vs_fp16(res: dict, fmt: str) -> tuple[int | None, list[int]]:
    """(the smallest bench M at which the layer-aggregated time is slower than cuBLAS fp16, the
    bench Ms before it -- every M where it is never slower -- at which there is no comparison:
    a shape's ok row of `fmt` or of fp16 missing there). Where that list is not empty the
    first slower M is not known, nor whether there is one."""
    unknown = []
    for m in ms_in(res):
        a = aggregate(res, fmt, m)
        if a is None or a["x_cublas"] is None:
            unknown.append(m)
        elif a["x_cublas"] < 1.0:
            return m, unknown
    return None, unknown


def ms_in(res: dict) -> list[int]:
    return sorted({r["m"] for r in res["results"]})
