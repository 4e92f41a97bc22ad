"""The report's inputs checked once, at load: a `quantzoo bench kernels` JSON (--bench) and a
`quantzoo bench model` JSON (--model-bench).

Each check walks every field the report reads and raises one ValueError naming the file (`what`)
and the field, e.g.

    bench-kernels.json: results[12] (q4_0 4096->1024 M=1): median_us = Infinity is not a positive number

so that the report never prints a figure made from a value it should have refused, and never
fails halfway (after the accuracy run, or with a half-written report.json) on one. Values are
shown as JSON spells them (null, NaN, Infinity, "text"). Fields the report does not read are
not checked.
"""
from __future__ import annotations

import json
import math

KERNELS_KIND = "quantzoo-bench-kernels"
KERNELS_VERSION = 1   # quantzoo.bench.kernels.run_bench's "version"
BASELINE = "fp16"
STATUSES = ("ok", "error", "missing")

# an ok row of a kernels bench: times and sizes the report divides by (positive where present)
OK_REQUIRED = ("median_us", "roofline_us")
OK_OPTIONAL = ("median_us_pdl", "read_us", "read_us_pdl", "weight_bytes", "tflops")
# the power probe's fields (quantzoo.bench.power): all of them where any is
PROBE_POSITIVE = ("sustained_us", "mj_per_call", "power_w", "sm_clock_mhz")
PROBE_KEYS = PROBE_POSITIVE + ("power_capped",)


def _show(v) -> str:
    s = json.dumps(v, allow_nan=True, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v) -> bool:
    return _is_num(v) and math.isfinite(v) and v > 0


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _bad(where: str, field: str, v, need: str):
    raise ValueError(f"{where}: {field} = {_show(v)} {need}")


def _need_positive(where: str, d: dict, key: str, prefix: str = "", optional: bool = False) -> None:
    v = d.get(key)
    if optional and v is None:
        return
    if not _positive(v):
        _bad(where, prefix + key, v, "is not a positive number")


def _need_str(where: str, d: dict, key: str, prefix: str = "") -> None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        _bad(where, prefix + key, v, "is not a string")


def stored_format_names() -> list[str]:
    """What a bench row may name: the registry's weight formats and the fp16 baseline."""
    from quantzoo import formats

    return [f.name for f in formats.weight_formats()] + [BASELINE]


def _check_format(where: str, fmt, known: list[str]) -> None:
    if not isinstance(fmt, str) or fmt not in known:
        _bad(where, "format", fmt, f"is not a weight format of the registry ({', '.join(known)})")


# ------------------------------------------------------------------------------------------
# `quantzoo bench kernels`


def check_kernels_bench(res, what: str = "bench") -> None:
    """That `res` is a `quantzoo bench kernels` JSON whose every field the report reads holds
    what the bench writes; one ValueError naming `what` and the field otherwise."""
    if not isinstance(res, dict) or res.get("kind") != KERNELS_KIND:
        hint = ""
        if isinstance(res, (dict, list)) and looks_like_model_bench(res):
            hint = " (it looks like a `quantzoo bench model` JSON: give that as --model-bench)"
        raise ValueError(f"{what}: not a `quantzoo bench kernels` JSON (kind != '{KERNELS_KIND}'){hint}")
    v = res.get("version", KERNELS_VERSION)   # (files from before the field: the same schema)
    if v != KERNELS_VERSION or isinstance(v, bool):
        _bad(what, "version", v, f"is not {KERNELS_VERSION}, the `quantzoo bench kernels` schema this "
             "quantzoo reads (a newer quantzoo wrote it?)")
    for key, kind in (("machine", dict), ("ceilings", dict), ("settings", dict), ("results", list)):
        if not isinstance(res.get(key), kind):
            raise ValueError(f"{what}: {key!r} is missing or not a JSON {'object' if kind is dict else 'array'}")
    for top in ("ceilings", "ceilings_end"):
        c = res.get(top)
        if top == "ceilings_end" and c is None:
            continue
        if not isinstance(c, dict):
            _bad(what, top, c, "is not a JSON object")
        for key in ("copy_tbps", "cublas_fp16_tflops"):
            _need_positive(what, c, key, f"{top}.")
    for key in ("gpu", "driver", "torch", "cupy", "git_commit", "time_utc"):
        _need_str(what, res["machine"], key, "machine.")
    _need_str(what, res, "FIXTURE")
    s = res["settings"]
    ms = s.get("m")
    if not isinstance(ms, list) or not ms or not all(_positive_int(m) for m in ms):
        if ms is None:
            raise ValueError(f"{what}: settings.m (the bench's M values) is missing")
        _bad(what, "settings.m", ms, "is not a list of positive integers (the bench's M values)")
    if "qwen3_8b_layer" in s:
        layer = s["qwen3_8b_layer"]
        if not isinstance(layer, list):
            _bad(what, "settings.qwen3_8b_layer", layer, "is not a list of [K, N, names, count] entries")
        for j, e in enumerate(layer):
            if not (isinstance(e, list) and len(e) == 4 and _positive_int(e[0]) and _positive_int(e[1])
                    and isinstance(e[2], str) and _positive_int(e[3])):
                _bad(what, f"settings.qwen3_8b_layer[{j}]", e,
                     "is not [K, N, names, count] (positive integers K, N and count)")
        from .speed import qwen3_layer

        mix: dict = {}
        for k, n, _names, c in layer:
            mix[(k, n)] = mix.get((k, n), 0) + c
        real = qwen3_layer()
        if mix != real:   # the report sums its headline over qwen3_layer() and says so
            _bad(what, "settings.qwen3_8b_layer", [[k, n, c] for (k, n), c in mix.items()],
                 "is not one Qwen3-8B decoder layer's linears ("
                 + ", ".join(f"{c}x {k}->{n}" for (k, n), c in real.items()) + ")")
    if s.get("power") is not None:
        if not isinstance(s["power"], dict):
            _bad(what, "settings.power", s["power"], "is not a JSON object")
        for key in ("seconds", "interval_ms"):
            _need_positive(what, s["power"], key, "settings.power.", optional=True)
    _need_positive(what, s, "target_s", "settings.", optional=True)
    if not res["results"]:
        raise ValueError(f"{what}: 'results' is empty: the file holds no measurement")
    known = stored_format_names()
    seen = {}
    for i, r in enumerate(res["results"]):
        where = f"{what}: results[{i}]"
        if not isinstance(r, dict):
            _bad(what, f"results[{i}]", r, "is not a JSON object (a result row)")
        need = ("format", "k", "n", "m", "status") + (OK_REQUIRED if r.get("status") == "ok" else ())
        missing = [k for k in need if k not in r]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        _check_format(where, r["format"], known)
        for key in ("k", "n", "m"):
            if not _positive_int(r[key]):
                _bad(where, key, r[key], "is not a positive integer")
        where = f"{where} ({r['format']} {r['k']}->{r['n']} M={r['m']})"
        key = (r["format"], r["k"], r["n"], r["m"])
        if key in seen:
            raise ValueError(f"{where}: the same format, shape and M as results[{seen[key]}]")
        seen[key] = i
        if r["status"] not in STATUSES:
            _bad(where, "status", r["status"], f"is not one of {', '.join(STATUSES)}")
        for k in ("path", "error", "power_error", "timing", "read_error", "nmse_error"):
            _need_str(where, r, k)
        if r["status"] != "ok":
            continue
        for k in OK_REQUIRED:
            _need_positive(where, r, k)
        for k in OK_OPTIONAL:
            _need_positive(where, r, k, optional=True)
        v = r.get("nmse")   # (the bench writes null, with nmse_error, where it is not a number)
        if v is not None and not (_is_num(v) and math.isfinite(v) and v >= 0):
            _bad(where, "nmse", v, "is not a non-negative number")
        if r.get("weight_bytes") is not None and not _positive_int(r["weight_bytes"]):
            _bad(where, "weight_bytes", r["weight_bytes"], "is not a positive integer")
        if r.get("read_us") is not None and r.get("weight_bytes") is None:
            raise ValueError(f"{where}: weight_bytes is {'null' if 'weight_bytes' in r else 'missing'} "
                             "(the row has read_us, a read of those bytes)")
        if any(r.get(k) is not None for k in PROBE_KEYS):   # the power probe sampled this row
            for k in PROBE_POSITIVE:
                _need_positive(where, r, k)
            v = r.get("power_capped")
            if not (_is_num(v) and 0 <= v <= 1):
                _bad(where, "power_capped", v, "is not a share between 0 and 1")
            _need_positive(where, r, "power_limit_w", optional=True)


# ------------------------------------------------------------------------------------------
# `quantzoo bench model`

RECORDS = "expected a 'results' list of per-format records (objects)"


def model_table_key(key: str) -> bool:
    """Whether a record's field is one the report's model table shows (and so checks): tokens/s,
    rooflines, memory (peak_*_bytes, kv_cache_bytes, peak_*_over_weights_kv)."""
    k = key.lower()
    return any(s in k for s in ("tok", "mem", "gib", "gb", "roofline", "peak", "kv_cache"))


def looks_like_model_bench(mb) -> bool:
    recs = mb.get("results") if isinstance(mb, dict) else mb
    return (not (isinstance(mb, dict) and "kind" in mb) and isinstance(recs, list) and bool(recs)
            and all(isinstance(r, dict) and ("error" in r or any(k.startswith("decode_tok_s") for k in r))
                    for r in recs))


def check_model_bench(mb, what: str = "model bench") -> dict:
    """That `mb` is a `quantzoo bench model` JSON whose every field the report reads holds what
    that bench writes: a JSON object with a 'results' list of per-format records (or the bare
    list, which is taken as that object's results). Returns the object; one ValueError naming
    `what` and the field otherwise."""
    rname = "record " if isinstance(mb, list) else "results"   # how an error names a record
    if isinstance(mb, list):
        mb = {"results": mb}
    if not isinstance(mb, dict):
        raise ValueError(f"{what}: not a `quantzoo bench model` JSON: {RECORDS}, got {_show(mb)}")
    if "kind" in mb:
        if mb["kind"] == KERNELS_KIND:
            raise ValueError(f"{what}: a `quantzoo bench kernels` JSON (kind '{KERNELS_KIND}'), not a "
                             "`quantzoo bench model` one: give it as --bench")
        _bad(what, "kind", mb["kind"], "is not that of a `quantzoo bench model` JSON (which has none)")
    recs = mb.get("results")
    if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
        raise ValueError(f"{what}: model bench JSON: {RECORDS}")
    if not recs:
        raise ValueError(f"{what}: 'results' is empty: the file holds no measurement")
    known = stored_format_names()
    seen = {}
    for i, r in enumerate(recs):
        where = f"{what}: {rname}[{i}]"
        if "format" not in r:
            raise ValueError(f"{where} lacks format")
        _check_format(where, r["format"], known)
        where = f"{where} ({r['format']})"
        if r["format"] in seen:   # (the table would show it twice)
            raise ValueError(f"{where}: the same format as {rname}[{seen[r['format']]}]")
        seen[r["format"]] = i
        if "error" in r:
            if not isinstance(r["error"], str):
                _bad(where, "error", r["error"], "is not a string (the format's failure)")
        elif not any(k.startswith("decode_tok_s") for k in r):
            raise ValueError(f"{where}: no decode_tok_s_* field: not a `quantzoo bench model` record"
                             + (" (it looks like a `quantzoo bench kernels` row: give that file as --bench)"
                                if "median_us" in r else ""))
        for k, v in r.items():
            if model_table_key(k) and v is not None and not _positive(v):
                _bad(where, k, v, "is not a positive number")
        if "prefill_breakdown" in r:
            pb = r["prefill_breakdown"]
            if not isinstance(pb, list) or not all(isinstance(e, dict) for e in pb):
                _bad(where, "prefill_breakdown", pb, "is not a list of JSON objects")
            if pb:
                _need_positive(where, pb[0], "total_gpu_us", "prefill_breakdown[0].", optional=True)
    for key in ("config", "machine"):
        if mb.get(key) is not None and not isinstance(mb[key], dict):
            _bad(what, key, mb[key], "is not a JSON object")
    cfg = mb.get("config") or {}
    for key in ("hidden_size", "num_layers", "vocab_size"):
        if cfg.get(key) is not None and not _positive_int(cfg[key]):
            _bad(what, f"config.{key}", cfg[key], "is not a positive integer")
    for key in ("gpu", "time_utc"):
        _need_str(what, mb.get("machine") or {}, key, "machine.")
    _need_str(what, mb, "device")
    if not isinstance(mb.get("partial", False), bool):   # (true: a run cut short; render() says so)
        _bad(what, "partial", mb["partial"], "is not true or false")
    _need_positive(what, mb, "copy_bandwidth_bytes_s", optional=True)
    sbs = mb.get("prefill_side_by_side")
    if sbs is not None:
        if not isinstance(sbs, dict):
            _bad(what, "prefill_side_by_side", sbs, "is not a JSON object")
        _need_str(what, sbs, "skipped", "prefill_side_by_side.")
        tok_s = sbs.get("tok_s")
        if tok_s is not None:
            if not isinstance(tok_s, dict):
                _bad(what, "prefill_side_by_side.tok_s", tok_s, "is not a JSON object")
            for fmt, per in tok_s.items():
                if not isinstance(per, dict):
                    _bad(what, f"prefill_side_by_side.tok_s.{fmt}", per, "is not a JSON object")
                for n, v in per.items():
                    if not str(n).isdigit():
                        _bad(what, f"prefill_side_by_side.tok_s.{fmt}", per, "is not keyed by prompt length")
                    _need_positive(what, per, n, f"prefill_side_by_side.tok_s.{fmt}.")
    return mb
