"""`quantzoo report`: every registry format on error, size, speed and model accuracy.

    from quantzoo import report
    rep = report.build(bench=report.speed.load_bench("bench-kernels.json"))
    report.write(rep, "out/")        # report.md, report.json, CSVs, PNGs

Everything iterates the registry: a new format shows up with no edit here. Sections:

- sizes and errors (any machine): bits/weight, Qwen3-8B size (quantzoo.report.sizes), NMSE on
  the standard Gaussian workload (quantzoo.workload) for the dequantized weights and for the
  kernel's function (emulated);
- kernel speed (from a `quantzoo bench kernels` JSON made on a GPU): % of roofline and x cuBLAS
  fp16 at M = 1 / 16 / 512 for one Qwen3-8B layer, dispatch paths and crossovers, per-shape
  detail, decode roofline tok/s;
- model throughput and peak memory (from a `quantzoo bench model` JSON, when given);
- accuracy (quantzoo.report.accuracy): top-1 agreement and mean KL vs fp16 on the default model.

Without a bench file on a machine with no GPU the speed sections are left out and the report
says so. Both bench files are checked whole when read (quantzoo.report.checks): a value the
report would have to print a figure from and cannot is refused there, naming file and field.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os

from . import checks, sizes, speed

HEADLINE_M = (1, 16, 512)


def _num(v, key: str = "") -> str:
    """A number at a sensible precision for a table cell (fractions: always 3 decimals)."""
    if v is None or not math.isfinite(v):
        return "-"
    if "fraction" in key or "_over_" in key:
        return format(v, ".3f")
    if key.endswith("GiB"):
        return format(v, ".2f")
    a = abs(v)
    return format(v, ".0f" if a >= 100 else ".1f" if a >= 1 else ".3f")


def _f(v, spec: str, missing: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return format(v, spec)


# ------------------------------------------------------------------------------------------
# data


def format_rows(errors: dict | None = None) -> list[dict]:
    """One row per weight format + fp16: bits, sizes, NMSE (measured now unless given)."""
    from quantzoo import formats, workload

    x = w = y = None
    rows = []
    for fmt in formats.weight_formats() + [formats.get(speed.BASELINE)]:
        if errors is not None and fmt.name in errors:
            e = errors[fmt.name]
        else:
            if x is None:
                x, w, y = workload.gaussian(**workload.STANDARD)
            e = workload.format_errors(fmt, x, w, y)
        mb = sizes.model_bytes(fmt)
        rows.append({"format": fmt.name, "kind": fmt.kind, "bits": fmt.bits_per_weight,
                     "size_gb": mb["total"] / 1e9, "linears_gb": mb["linears"] / 1e9,
                     "embedding_format": mb["embedding_format"],
                     "decode_bytes": sizes.decode_bytes_per_token(fmt),
                     "nmse_weights": e["nmse_weights"], "nmse_kernel": e["nmse_kernel"],
                     "nmse_ceiling": fmt.nmse_ceiling})
    fp16 = next(r for r in rows if r["format"] == speed.BASELINE)
    for r in rows:
        r["x_smaller"] = fp16["size_gb"] / r["size_gb"]
    return rows


def speed_rows(bench: dict) -> list[dict]:
    rows = []
    for name in speed.formats_in(bench):
        row = {"format": name, "status": speed.status_of(bench, name)}
        for m in HEADLINE_M:
            a = speed.aggregate(bench, name, m)
            row[f"m{m}_us"] = a["us"] if a else None
            row[f"m{m}_pct_roofline"] = a["pct_roofline"] if a else None
            row[f"m{m}_x_cublas"] = a["x_cublas"] if a else None
        for tag, key in (("", "median_us"), ("_pdl", "median_us_pdl")):
            fit = speed.streaming_fit(bench, name, key=key)
            row[f"m1_fixed_us{tag}"] = fit["fixed_us"] if fit else None
            row[f"m1_stream_tbps{tag}"] = fit["rate_tbps"] if fit else None
            row[f"m1_fit_max_residual_us{tag}"] = fit["max_residual_us"] if fit else None
        fl = speed.read_floor(bench, name)
        for key in ("us", "read_us", "us_pdl", "read_us_pdl", "bytes"):
            row[f"m1_layer_{key}"] = fl[key] if fl else None
        slow, unknown = speed.vs_fp16(bench, name) if name != speed.BASELINE else (None, [])
        row["slower_than_fp16_from_m"] = slow
        # False: at some M before slow (any M, if None) no comparison, so the first slower M is not known
        row["compared_with_fp16"] = not unknown if name != speed.BASELINE else None
        row["paths"] = speed.crossover_text(bench, name)
        row["error"] = speed.first_error(bench, name) if row["status"] != "ok" else ""
        rows.append(row)
    # a registry format the bench has no row of (`quantzoo bench kernels --formats`, a bench
    # older than the format): a row that says so, not a table that leaves it out unsaid
    for name in not_benched(speed.formats_in(bench)):
        row = {"format": name, "status": "not benched"}
        row.update({k: None for k in rows[0] if k not in row} if rows else {})
        row.update(compared_with_fp16=None, paths="", error="the bench file has no row of this format")
        rows.append(row)
    return rows


def not_benched(names) -> list[str]:
    """The registry's weight formats and fp16 (checks.stored_format_names) missing from `names`."""
    return [n for n in checks.stored_format_names() if n not in names]


def model_bench_rows(mb: dict) -> tuple[list[str], list[list]]:
    """Headers and rows from a `quantzoo bench model` JSON as checks.check_model_bench returns it
    (a bare list of records made the file's results): its per-format records, with the numeric
    fields whose names speak of tokens/s or rooflines, then those of memory
    (checks.model_table_key): peak_*_bytes and kv_cache_bytes shown in GiB (their headers ending
    _GiB), peak_*_over_weights_kv as the bench stores them."""
    recs = mb["results"]
    keys = []
    for r in recs:
        for k, v in r.items():
            if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool) and \
                    checks.model_table_key(k):
                keys.append(k)
    mem = [k for k in keys if k.startswith("peak_") or k.startswith("kv_cache") or "mem" in k.lower()]
    keys = [k for k in keys if k not in mem] + mem
    gib = {k: k[:-len("_bytes")] + "_GiB" for k in mem if k.endswith("_bytes")}

    def cell(r, k):
        v = r.get(k)
        return v / 2**30 if k in gib and isinstance(v, (int, float)) else v

    label = next((k for k in ("format", "name", "weights") if recs and k in recs[0]), None)
    rows = [[r.get(label, "?") if label else "?"] + [cell(r, k) for k in keys] for r in recs]
    return [label or "format"] + [gib.get(k, k) for k in keys], rows


def load_model_bench(path) -> dict:
    """A `quantzoo bench model` JSON file, checked (checks.check_model_bench): one ValueError
    naming the file and the field otherwise."""
    return checks.check_model_bench(speed.load_json(path, "`quantzoo bench model`"), str(path))


def prefill_short_long(mb: dict) -> tuple[int | None, int | None]:
    """The shortest and (where there are two or more) the longest prompt length a model bench
    timed: its records' prefill_tok_s_N and its round-robin run's keys (`quantzoo bench model
    --prompt-lens`, 512,2048 by default, 64,256 with --tiny). Its prefill_breakdown profiled the
    shortest (bench.model.bench_format)."""
    recs = mb.get("results") if isinstance(mb, dict) else mb
    lens = {int(k[len("prefill_tok_s_"):]) for r in recs or [] if isinstance(r, dict)
            for k in r if k.startswith("prefill_tok_s_") and k[len("prefill_tok_s_"):].isdigit()}
    sbs = mb.get("prefill_side_by_side") if isinstance(mb, dict) else None
    for per in ((sbs.get("tok_s") if isinstance(sbs, dict) else None) or {}).values():
        lens |= {int(n) for n in (per if isinstance(per, dict) else {}) if str(n).isdigit()}
    lens = sorted(lens)
    return (lens[0] if lens else None), (lens[-1] if len(lens) > 1 else None)


def model_vs_fp16_rows(mb: dict) -> tuple[list[str], list[list]] | None:
    """Each format's runner speed against the fp16 runner's in the same model bench: decode
    tok/s, and prefill both by the wall clock (tok/s, what a user waits; from the round-robin
    `prefill_side_by_side` where the bench has it) and by the GPU time of the profiled
    prefill of the shortest prompt (`prefill_breakdown`), the longest prompt by the wall clock
    (prefill_short_long: 512 and 2048 tokens in the default run). wall / GPU > 1 is time the GPU
    spent outside kernels: the gaps between dependent launches (1.1-1.3x at 512 tokens on the H100,
    where the host finishes in half the wall time: bench/NOTES.md, session 56), more where the
    host's Python is the bound. None without an fp16 record."""
    recs = [r for r in (mb.get("results") if isinstance(mb, dict) else mb) or []
            if isinstance(r, dict) and not r.get("error")]
    base = next((r for r in recs if r.get("format") == "fp16"), None)
    if base is None:
        return None

    def ratio(a, b):   # as text: two decimals whatever the size
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and math.isfinite(a / b)
        return format(a / b, ".2f") if ok else None

    def gpu_ms(r):
        pb = r.get("prefill_breakdown")
        us = pb[0].get("total_gpu_us") if isinstance(pb, list) and pb and isinstance(pb[0], dict) else None
        return us / 1e3 if isinstance(us, (int, float)) else None

    sbs = mb.get("prefill_side_by_side") if isinstance(mb, dict) else None
    side = sbs.get("tok_s") if isinstance(sbs, dict) else None

    def tok_s(r, n):   # the side-by-side (round-robin) figures where the bench has them, else
        if isinstance(side, dict):   # the sequential ones; never the one standing in for the other
            per = side.get(r.get("format"))
            v = per.get(str(n), per.get(n)) if isinstance(per, dict) else None
        else:
            v = r.get(f"prefill_tok_s_{n}")
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    def wall_ms(r, n):
        tps = tok_s(r, n)
        return 1e3 * n / tps if tps else None

    short, long = prefill_short_long(mb)   # (short: the one prefill_breakdown profiled)
    hdr = ["format", "decode tok/s", "decode x fp16"]
    if short:
        hdr += [f"prefill {short} wall ms", "wall x fp16", f"prefill {short} GPU ms", "GPU x fp16", "wall / GPU"]
    if long:
        hdr += [f"prefill {long} wall tok/s", f"{long} x fp16"]
    rows = []
    for r in recs:
        row = [r.get("format", "?"), r.get("decode_tok_s_graph"),
               ratio(r.get("decode_tok_s_graph"), base.get("decode_tok_s_graph"))]
        if short:
            g, w = gpu_ms(r), wall_ms(r, short)
            row += [w, ratio(wall_ms(base, short), w), g, ratio(gpu_ms(base), g), ratio(w, g)]
        if long:
            row += [tok_s(r, long), ratio(tok_s(r, long), tok_s(base, long))]
        rows.append(row)
    return hdr, rows


def build(bench: dict | None = None, model_bench: dict | None = None, *, accuracy: bool = True,
          accuracy_formats=None, accuracy_tokens: int = 512, accuracy_text: str | None = None,
          model_path=None, errors: dict | None = None, command: str | None = None, log=None) -> dict:
    """Everything the report shows, as data (write() renders it)."""
    from quantzoo import __version__
    from quantzoo.bench.timing import git_commit

    if bench is not None:
        checks.check_kernels_bench(bench)
    if model_bench is not None:
        model_bench = checks.check_model_bench(model_bench)
    rep = {"kind": "quantzoo-report", "version": 1,
           "generated_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "quantzoo": __version__, "git_commit": git_commit(), "command": command,
           "formats": format_rows(errors), "bench": bench, "model_bench": model_bench}
    rep["speed"] = speed_rows(bench) if bench is not None else None
    if bench is not None:
        copy_bps = bench["ceilings"]["copy_tbps"] * 1e12
        for r in rep["formats"]:
            r["roofline_decode_tok_s"] = copy_bps / r["decode_bytes"]
    rep["accuracy"] = None
    if accuracy:
        from . import accuracy as acc

        try:
            rep["accuracy"] = acc.accuracy(accuracy_formats, path=model_path, text=accuracy_text,
                                           max_tokens=accuracy_tokens, log=log)
        except (ImportError, FileNotFoundError, OSError) as e:
            rep["accuracy"] = {"skipped": f"{type(e).__name__}: {e}"}
    return rep


# ------------------------------------------------------------------------------------------
# markdown


def layer_text() -> str:
    """'its 7 linears (2x 4096->4096 q/o, ...)': the layer speed.aggregate sums, in words."""
    from quantzoo.bench.kernels import QWEN3_8B_SHAPES

    layer = speed.qwen3_layer()
    names = {(k, n): "/".join(s.strip().removesuffix("_proj") for s in w.split(","))
             for k, n, w, _ in QWEN3_8B_SHAPES}
    return (f"its {sum(layer.values())} linears ("
            + ", ".join(f"{c}x {k}->{n} {names.get((k, n), '?')}" for (k, n), c in layer.items()) + ")")


def timing_text(bench: dict) -> str:
    """How the bench's times were taken: graph replays, and the rows timed eagerly (speed.eager_rows)."""
    eager, ok = speed.eager_rows(bench), speed.ok_rows(bench)
    graph = ("CUDA-graph replays of back-to-back launches over weight copies rotated so that L2 cannot "
             "serve them, warm-up excluded")
    cost = ("include the host's cost of launching each kernel (~16 us from Python on the H100, more than "
            "a small product takes), so they say little of the kernel")
    hows = ", ".join(f"`{h}`" for h in dict.fromkeys(r["timing"] for r in eager))
    if not eager:
        return f"Times: median of {graph}."
    if len(eager) == len(ok):
        return f"Times: median of eager launches (the bench's `timing`: {hows}), not of graph replays: they {cost}."
    which = ", ".join(f"{r['format']} {r['k']}->{r['n']} M={r['m']}" for r in eager[:8]) + \
        (f", ... ({len(eager) - 8} more: `timing` in bench-kernels.csv)" if len(eager) > 8 else "")
    return (f"Times: median of {graph}; except {len(eager)} of the {len(ok)} timed rows ({which}), timed "
            f"from eager launches ({hows}): their times {cost}.")


def _table(rows, headers) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def render(rep: dict, plots: list[str] | None = None, md_dir: str | None = None) -> str:
    """The markdown; plot links are relative to md_dir (the markdown's folder)."""
    L = []
    bench = rep["bench"]
    L.append("# quantzoo report: every format on error, size, speed and accuracy\n")
    L.append(f"Generated {rep['generated_utc']} by quantzoo {rep['quantzoo']} "
             f"(commit `{rep['git_commit'] or 'unknown'}`)" +
             (f" with `{rep['command']}`" if rep.get("command") else "") + ".\n")
    if bench is None:
        L.append("**CPU only: no kernel speed.** No kernel bench was given and no CUDA GPU is "
                 "present, so the kernel speed and roofline tables are left out (error, size and "
                 "accuracy are CPU work). Run `quantzoo bench kernels` on a CUDA GPU and pass "
                 "`--bench bench-kernels.json` to fill them in.\n")
    else:
        m = bench["machine"]
        c = bench["ceilings"]
        if bench.get("FIXTURE"):
            L.append(f"**This bench file is a test fixture, not a measurement:** {bench['FIXTURE']}.\n")
        L.append(f"Speed figures come from `quantzoo bench kernels` run on "
                 f"**{m.get('gpu') or 'a GPU not recorded'}** (driver {m.get('driver') or '?'}, torch "
                 f"{m.get('torch') or '?'}, CuPy {m.get('cupy') or 'not recorded'}, commit "
                 f"`{m.get('git_commit') or 'not recorded'}`, {m.get('time_utc') or 'time not recorded'}). "
                 "Ceilings measured in that "
                 f"run: device copy **{c['copy_tbps']:.2f} TB/s** (read + write) and cuBLAS fp16 "
                 f"{c.get('cublas_size', '?')}^3 **{c['cublas_fp16_tflops']:.0f} TFLOP/s**"
                 + (f" (at the end of the run: {bench['ceilings_end']['copy_tbps']:.2f} TB/s, "
                    f"{bench['ceilings_end']['cublas_fp16_tflops']:.0f} TFLOP/s)" if bench.get("ceilings_end") else "")
                 + ". Error, size and accuracy columns are computed on the machine that built the report.\n")

    # --- sizes and errors
    L.append("## Formats: size and error\n")
    rows = []
    for r in rep["formats"]:
        rows.append([r["format"], r["kind"], _f(r["bits"], ".3f"), _f(r["size_gb"], ".2f"),
                     _f(r["x_smaller"], ".2f"), r["embedding_format"],
                     _f(100 * r["nmse_weights"], ".4f"), _f(100 * r["nmse_kernel"], ".4f"),
                     _f(100 * r["nmse_ceiling"], ".4f")]
                    + ([_f(r.get("roofline_decode_tok_s"), ".0f")] if bench is not None else []))
    L.append(_table(rows, ["format", "kind", "bits/weight", "Qwen3-8B GB", "x smaller than fp16",
                           "embedding + lm_head as", "NMSE % (weights)", "NMSE % (kernel)",
                           "NMSE % ceiling"]
                    + (["roofline decode tok/s"] if bench is not None else [])))
    s = __import__("quantzoo.workload", fromlist=["STANDARD"]).STANDARD
    L.append(f"\nQwen3-8B GB: bytes / 1e9 of its {sizes.qwen3_param_count() / 1e9:.2f} G parameters "
             "(36 layers of q/k/v/o/gate/up/down, untied 151936 x 4096 embedding and lm_head, norms) "
             "stored as `quantzoo quantize` writes them: GGUF formats keep every 2-D weight in the "
             "format and norms in F32; AWQ keeps embedding, lm_head and norms in fp16. "
             f"NMSE: ||y - y_exact||^2 / ||y_exact||^2 on the standard workload (W ~ N(0, {s['sigma']}^2) "
             f"{s['n']}x{s['k']}, x ~ N(0, 1), M = {s['m']}, y_exact in float64 with the unquantized W); "
             "'weights' uses the dequantized W in float64, 'kernel' what the CUDA kernel computes "
             "(Q8_1 activations for GGUF formats, fp16 arithmetic for AWQ), emulated bit-faithfully "
             "in numpy; 'ceiling' is the bound the GPU tests hold each kernel to."
             + (" Roofline decode tok/s: the copy bandwidth measured in the kernel bench over the weight "
                "bytes one Qwen3-8B decode step reads (every linear + lm_head + norms, embedding rows "
                "excluded; KV cache and activations not counted)."
                if bench is not None else "") + "\n")

    # --- speed
    if bench is not None:
        _, real = speed.layer_weights(bench)
        eager = speed.eager_rows(bench)
        L.append("## Kernel speed\n")
        hdr = ["format", "status"]
        for m in HEADLINE_M:
            hdr += [f"M={m} % roofline", f"M={m} x cuBLAS"]
        hdr += ["slower than fp16 from M", "dispatch path (crossovers)"]
        rows = []
        for r in rep["speed"]:
            row = [r["format"], r["status"]]
            for m in HEADLINE_M:
                row += [_f(r[f"m{m}_pct_roofline"], ".1f"), _f(r[f"m{m}_x_cublas"], ".2f")]
            row += ["-" if r["format"] == speed.BASELINE or r["status"] == "not benched" else
                    "n/a" if not r["compared_with_fp16"] else
                    (str(r["slower_than_fp16_from_m"]) if r["slower_than_fp16_from_m"] else "never"),
                    r["paths"] or (r["error"][:80] if r["error"] else "")]
            rows.append(row)
        L.append(_table(rows, hdr))
        L.append("\n" + (f"Each figure is for **one Qwen3-8B decoder layer**: {layer_text()} summed. "
                         if real else "Figures sum the bench's shapes once each (the bench did not "
                                      "cover all four Qwen3-8B shapes). ")
                 + "% roofline = the time the ceilings allow (max of bytes / copy bandwidth and flops / "
                   "cuBLAS fp16 TFLOP/s, bytes = stored weight + fp16 x and y) over the measured time; "
                   "x cuBLAS = cuBLAS fp16 time / format time (above 1 is faster). 'slower than fp16 "
                   "from M' is the first bench M at which the layer is slower than cuBLAS fp16"
                   + ("; 'n/a' where, at an M before it, the bench lacks an ok row of the format or of "
                      "fp16 for a shape (so that the first such M is not known)"
                      if any(r["compared_with_fp16"] is False for r in rep["speed"]) else "") + ". "
                   + timing_text(bench) + "\n")
        bad = [r for r in rep["speed"] if r["status"] != "ok"]
        for r in bad:
            L.append(f"- `{r['format']}`: {r['status']} — {r['error']}")
        if bad:
            L.append("")
        wrong = speed.wrong_results(bench)
        if wrong:
            L.append("**Rows whose timed kernel did not compute the product** (the bench's check of each timed "
                     "kernel's output against x @ W.T in fp32 with the unquantized W): " + "; ".join(wrong[:8])
                     + (f"; ... ({len(wrong) - 8} more: `nmse` in bench-kernels.csv)" if len(wrong) > 8 else "")
                     + ". Their times, and the figures here that sum them, are those of a broken kernel.\n")

        fits = [r for r in rep["speed"] if r["m1_stream_tbps"] is not None]
        if fits:
            copy_tbps = bench["ceilings"]["copy_tbps"]
            L.append("### M = 1: fixed cost per launch and streaming rate\n")
            pct = lambda v: None if v is None else 100 * v / copy_tbps  # noqa: E731
            L.append(_table([[r["format"]] + [c for tag in ("", "_pdl") for c in (
                              _f(r[f"m1_fixed_us{tag}"], ".2f"), _f(r[f"m1_stream_tbps{tag}"], ".2f"),
                              _f(pct(r[f"m1_stream_tbps{tag}"]), ".0f"), _f(r[f"m1_fit_max_residual_us{tag}"], ".2f"))]
                             for r in fits],
                            ["format", "fixed us per product", "streaming TB/s", "streaming % of copy",
                             "fit max residual us", "PDL: fixed us", "PDL: streaming TB/s",
                             "PDL: % of copy", "PDL: fit max residual us"]))
            L.append("\nA straight line, time = fixed + weight bytes / streaming rate, fitted by least "
                     "squares to the M = 1 times of the bench's shapes: as the tables above launch them "
                     + ("(plain launches in a graph, or eager where said above)" if any(r["m"] == 1 for r in eager)
                        else "(plain launches in a graph)") + ", and 'PDL' the same graph under programmatic dependent "
                     "launch, as the runner's decode step launches them (each kernel starts while the one "
                     "before drains; '-' where the bench did not time it). The fixed part is paid by every "
                     "product (one ops.matmul: for GGUF formats at M = 1 two launches, the Q8_1 quantize "
                     "and the mmvq) whatever its weight's size "
                     "(launch, first loads, the last blocks' tail); the rate is how fast a larger weight's "
                     "extra bytes stream (copy bandwidth counts a device copy's reads and writes; a "
                     "read-only stream may exceed it a little). A rate near copy bandwidth with a low M = 1 "
                     "% roofline means the kernel is bound by its launch, not by how it streams. cuBLAS "
                     "(fp16) launches take no PDL: its two column groups time the same launches.\n")
        floors = [r for r in rep["speed"] if r["m1_layer_read_us"]]
        if floors:
            copy_bps = bench["ceilings"]["copy_tbps"] * 1e12
            L.append("### M = 1 against the fastest one-launch read of the same bytes\n")
            cols = []
            for r in floors:
                row = [r["format"]]
                for tag in ("", "_pdl"):
                    us, rd = r[f"m1_layer_us{tag}"], r[f"m1_layer_read_us{tag}"]
                    row += [_f(us, ".1f"), _f(rd, ".1f"),
                            _f(None if not rd else 100 * r["m1_layer_bytes"] / copy_bps / (rd * 1e-6), ".0f"),
                            _f(None if not (us and rd) else us / rd, ".2f")]
                cols.append(row)
            L.append(_table(cols, ["format", "layer us", "read us", "read % of copy", "kernel / read",
                                   "PDL: layer us", "PDL: read us", "PDL: read % of copy", "PDL: kernel / read"]))
            L.append("\n" + ("One Qwen3-8B layer at M = 1 (its 7 linears summed, as above)" if real else
                            "The bench's shapes at M = 1, summed once each (as above),")
                     + " against `read`: cuda/stream_read.cu reading each linear's weight bytes in one launch and doing "
                     "nothing else, the fastest of a sweep of its launch shapes, timed the same way "
                     "(rotated copies, graph replays; 'PDL' as the decode graph launches). An M = 1 "
                     "product per linear (GGUF formats: a Q8_1 quantize launch and the mmvq launch) "
                     "does all of that and its math besides, so 'read % of copy' is about as much of "
                     "the copy bandwidth as such kernels can be shown to reach, and 'kernel / read' "
                     "how far the format's kernels are from that floor. Per shape: `read_us` in "
                     "bench-kernels.csv.\n")
        rerrs = speed.read_errors(bench)
        if rerrs:
            L.append("The one-launch read failed" + (" (so the formats of these rows have no row above)" if floors else "")
                     + ": " + "; ".join(rerrs[:8]) + (f"; ... ({len(rerrs) - 8} more)" if len(rerrs) > 8 else "") + "\n")
        sus = speed.sustained(bench)
        if sus:
            k, n = sus[0]["k"], sus[0]["n"]
            L.append(f"### Sustained: SM clock, power and energy per product ({k} -> {n})\n")
            L.append(_table([[r["format"], str(r["m"]), _f(r["sustained_us"], ".1f"), _f(r["median_us"], ".1f"),
                              _f(r["sm_clock_mhz"], ".0f"), _f(r["power_w"], ".0f"),
                              _f(100 * r["power_capped"], ".0f"), _f(r["mj_per_call"], ".2f"),
                              _f(r["sustained_x_cublas"], ".2f"), _f(r["energy_x_cublas"], ".2f")] for r in sus],
                            ["format", "M", "sustained us", "bench us", "SM clock MHz", "power W",
                             "% samples at power cap", "mJ per product", "sustained x cuBLAS", "energy x cuBLAS"]))
            pw = bench["settings"].get("power") or {}
            limits = sorted({r["power_limit_w"] for r in sus if r.get("power_limit_w")})
            target = bench["settings"].get("target_s")
            L.append("\nEach format's launches on this shape replayed back to back"
                     + (f" for {pw['seconds']:g} s" if pw.get("seconds") else "") + " while nvidia-smi "
                     "sampled the SM clock, the board power and the driver's clock-event reasons"
                     + (f" every {pw['interval_ms']} ms" if pw.get("interval_ms") else "") + " (over the "
                     "second half: the median clock, the mean power). 'sustained us' is the wall time "
                     "per launch over the whole stretch, 'bench us' the tables' timing"
                     + (f" (~{1e3 * target:g} ms a row)" if target else "") + "; 'mJ per product' is the "
                     "mean power x the sustained time. '% samples at power cap': how often the driver "
                     "held the clock down to stay under the card's power limit"
                     + (f" ({', '.join(f'{v:g} W' for v in limits)})" if limits else "") + ". Where every "
                     "product runs at the cap, at the same power, its time and its energy are one ratio "
                     "to cuBLAS: what sets it is the energy a kernel spends per product, not its cycles "
                     "alone, and a kernel that leaves the tensor cores idle part of the time gets a "
                     "higher clock, not its time back.\n")
        errs = speed.power_errors(bench)
        if errs:
            L.append("The sustained power probe failed" + (" for some rows" if sus else "") + ": "
                     + "; ".join(errs) + "\n")
        L.append("### Per shape: median time in us (x cuBLAS fp16)\n")
        ms = speed.ms_in(bench)
        ok = {(r["format"], r["k"], r["n"], r["m"]): r for r in speed.ok_rows(bench)}
        shapes = []
        for r in bench["results"]:
            if (r["k"], r["n"]) not in shapes:
                shapes.append((r["k"], r["n"]))
        from quantzoo.bench.kernels import QWEN3_8B_SHAPES   # (the file's own list, if any, is the same: checks)

        what = {(k, n): w for k, n, w, _ in QWEN3_8B_SHAPES}
        for (k, n) in shapes:
            L.append(f"**{k} -> {n}**" + (f" ({what[(k, n)]})" if (k, n) in what else "") + "\n")
            rows = []
            for name in speed.formats_in(bench):
                row = [name]
                for m in ms:
                    r, b = ok.get((name, k, n, m)), ok.get((speed.BASELINE, k, n, m))
                    row.append("n/a" if r is None else   # x cuBLAS from this file's rows, as above
                               f"{r['median_us']:.1f} ({_f(b['median_us'] / r['median_us'] if b else None, '.2f')})")
                rows.append(row)
            L.append(_table(rows, ["format"] + [f"M={m}" for m in ms]))
            L.append("")
        L.append("Every row (TFLOP/s, weight TB/s, % of copy bandwidth, % of cuBLAS, path, NMSE of "
                 "the timed kernel vs float32) is in `bench-kernels.csv`.\n")

        L.append("### Dispatch crossovers\n")
        L.append("The path each format's dispatch (`choose_path(m, qt)`) took, with the first bench M "
                 "at which it changed (so a threshold lies between that M and the previous one on the "
                 "grid), and the first M at which the aggregate above is slower than cuBLAS fp16.\n")
        for name in speed.formats_in(bench):
            txt = speed.crossover_text(bench, name)
            if not txt:
                continue
            slow, unknown = speed.vs_fp16(bench, name) if name != speed.BASELINE else (None, [])
            if name == speed.BASELINE:
                vs = ""
            elif unknown:
                at = "any bench M" if len(unknown) == len(speed.ms_in(bench)) else "M=" + ", ".join(map(str, unknown))
                vs = (f"; no comparison with fp16 at {at} (the bench lacks "
                      + ("fp16 rows" if speed.BASELINE not in speed.formats_in(bench) else
                         "an ok row of this format or of fp16 for a shape there")
                      + (f"), slower than fp16 at M={slow}" if slow else ")"))
            else:
                vs = f"; slower than fp16 from M={slow}" if slow else "; never slower than fp16 on this grid"
            L.append(f"- `{name}`: {txt}{vs}")
        L.append("")

    # --- model bench (checks.check_model_bench has seen it: build())
    mb = rep.get("model_bench")
    if mb:
        L.append("## Model throughput (`quantzoo bench model`)\n")
        if mb.get("partial"):
            L.append("**A partial run**: the bench JSON is marked `\"partial\": true`, written before the run "
                     "finished (cut short): the formats it had not reached, and its round-robin prefill, are "
                     "missing.\n")
        hdr, rows = model_bench_rows(mb)
        mm = mb.get("machine") or {}
        from quantzoo.bench.model import QWEN3_8B

        cfg = mb.get("config") or {}
        if cfg.get("hidden_size", QWEN3_8B["hidden_size"]) != QWEN3_8B["hidden_size"]:
            L.append(f"**Not the Qwen3-8B shape**: this bench JSON holds a tiny smoke-test model "
                     f"({cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, device "
                     f"{mb.get('device')}); its figures say nothing of speed.\n")
        elif mm:
            bw = mb.get("copy_bandwidth_bytes_s")
            L.append(f"Measured on {mm.get('gpu') or 'a GPU not recorded'} "
                     f"({mm.get('time_utc') or 'time not recorded'}), "
                     "from the runner's own bench JSON; a Qwen3-8B-shaped model with random weights, its decoder "
                     "linears in the format (embedding and lm_head as that bench stores them). roofline_tok_s: the "
                     + (f"copy bandwidth measured in that run ({bw / 1e12:.2f} TB/s, not the kernel bench's)"
                        if bw else "copy bandwidth of that run (the file does not record its value)")
                     + " over the bytes of every linear + lm_head (norms not counted), "
                     "so it differs from the size table's roofline decode tok/s. A read-only stream may "
                     "exceed a copy's rate a little: a roofline_fraction above 1 is possible.\n")
        L.append(_table([[_num(v, h) if isinstance(v, (int, float)) else ("-" if v is None else str(v))
                          for h, v in zip(hdr, r)] for r in rows], hdr))
        if any(h.startswith("peak_") for h in hdr):
            L.append("\nPeak GPU memory (torch's peak allocation, GiB = 2^30 bytes), per phase of the run: "
                     "`peak_decode_GiB` over the decode timings (a KV cache of the decode's own positions), "
                     "`peak_gpu_GiB` over the prefills (a cache of the longest prompt's positions, whose size is "
                     "`kv_cache_GiB`, and that prompt's activations); each `*_over_weights_kv` is that peak over "
                     "the weights (linears, embedding and lm_head) + that phase's KV cache, so 1.000 means "
                     "nothing else was held.\n")
        if any("decode_tok_s_reads_only" in h for h in hdr):
            L.append("\nTwo decode bounds from the same run (the fastest one-launch read of a buffer, "
                     "cuda/stream_read.cu, standing in for every linear): `*_ideal_linears`, the "
                     "runner's decode graph with each linear's product replaced by a read of as many "
                     "bytes as its weight, the per-layer ops (norms, RoPE, attention, SwiGLU, Q8_1 "
                     "quantize) unchanged -- about what this runner could reach with GEMVs as fast as "
                     "a read; `*_reads_only`, a graph of those reads alone, one per linear of a step -- "
                     "about what launching one kernel per linear allows even with per-layer ops for "
                     "free. What lies between the decode and those bounds is the GEMVs' own cost; what "
                     "lies between them and the roofline, the per-layer ops and each launch's fixed "
                     "cost.\n")
        ctx = next((h for h in hdr if h.startswith("decode_tok_s_graph_ctx")), None)
        if ctx:
            n_ctx = ctx[len("decode_tok_s_graph_ctx"):]
            per_token = 36 * 8 * 128 * 2 * 2   # Qwen3-8B: layers x KV heads x head dim x (K, V) x fp16
            at = f": {int(n_ctx) * per_token / 1e9:.2g} GB a step at {n_ctx} tokens" if n_ctx.isdigit() else ""
            L.append(f"\n`{ctx}`: the graph decode after a {n_ctx}-token prompt, where each step's "
                     f"attention also reads the whole KV cache (for the Qwen3-8B shape {per_token / 1e3:.0f} KB "
                     f"a token{at}).\n")
        if any("decode_tok_s_graph_persistent" in h for h in hdr):
            L.append("\n`decode_tok_s_graph_persistent` (GGUF formats): the same decode through the "
                     "experimental persistent kernel (cuda/decode_persistent.cu: every decoder layer of "
                     "a step in one resident launch, bit-equal to the default decode, opt-in with "
                     "`persistent=True`); the bench JSON's `decode_persistent_phases_us` says where "
                     "one of its steps spends its time.\n")
        for r in mb["results"]:
            if r.get("error"):
                L.append(f"\n- `{r.get('format')}`: {r['error'][:200]}")
        missing = not_benched([r.get("format") for r in mb["results"]])
        if missing:
            from quantzoo.bench.model import FORMATS as MODEL_FORMATS

            L.append("\nNot in this model bench: " + ", ".join(f"`{n}`" for n in missing)
                     + " (`quantzoo bench model` runs " + ", ".join(MODEL_FORMATS) + ").\n")
        vs = model_vs_fp16_rows(mb)
        if vs:
            sbs = mb.get("prefill_side_by_side") or {}
            sb = "tok_s" in sbs
            lens = {str(n) for per in (sbs.get("tok_s") or {}).values() for n in per}
            gaps = sb and any(str(n) not in sbs["tok_s"].get(r[0], {}) for r in vs[1] for n in lens)
            short, long = prefill_short_long(mb)   # (the columns' prompt lengths: model_vs_fp16_rows)
            txt = "\nAgainst the fp16 runner of the same run (x fp16 above 1: faster than fp16)"
            if short:
                txt += (f". The {short}-token prefill by the wall clock" +
                        (" (every format's model held at once and timed round-robin, so that the host's "
                         "drift within the run falls on all of them alike)" if sb else
                         f" (the table above's prefill_tok_s_{short}, each format timed after the other: the "
                         "bench's round-robin run is not in this file"
                         + (f", it was skipped: {sbs['skipped'][:200]}" if sbs.get("skipped") else "") + ")") +
                        " and by the GPU time of its profiled run (the sum of its kernels' times); wall / "
                        "GPU above 1 is time outside kernels: the gaps between dependent launches (1.1-1.3 on "
                        "the H100 at 512 tokens, where the host is done in half the wall time), and well "
                        "above that where the host's Python sets the time (it moves up to 2x between runs "
                        "on the lent machine)")
            if long:
                txt += (f". The {long}-token columns are "
                        + (f"the same round-robin wall figures (not the table above's prefill_tok_s_{long}, "
                           "timed one format after another)" if sb else f"the table above's prefill_tok_s_{long}"))
            L.append(txt + ("; '-' where the round-robin run has no figure for a format" if gaps else "") + ".\n")
            L.append(_table([[_num(v) if isinstance(v, (int, float)) else ("-" if v is None else str(v))
                              for v in r] for r in vs[1]], vs[0]))
        L.append("")

    # --- accuracy
    acc = rep.get("accuracy")
    if acc is not None:
        L.append("## Accuracy on a real model\n")
        if "skipped" in acc:
            L.append(f"Skipped: {acc['skipped']}\n")
        else:
            ref = acc["reference"]
            L.append(f"Model: {acc['model']} ({acc['arch']}, {acc['layers']} layers, hidden "
                     f"{acc['hidden']}), its weights dequantized and rounded to fp16 = the reference; "
                     f"each format stores that fp16 model as `quantzoo quantize` would. Text: the "
                     f"shipped `quantzoo/data/english.txt`, {acc['tokens']} tokens, teacher-forced; "
                     f"{acc['mode']}. Reference perplexity on the text: {ref['ppl']:.2f}.\n")
            rows = [[r["format"], r["linears"], r["embedding"], _f(100 * r["top1"], ".1f"),
                     _f(r["kl_mean"], ".4f"), _f(r["kl_max"], ".3f"), _f(r["ppl"], ".2f")]
                    for r in acc["rows"]]
            L.append(_table(rows, ["format", "linears", "embedding (tied lm_head)", "top-1 agreement %",
                                   "mean KL (nats)", "max KL (nats)", "perplexity"]))
            L.append("\ntop-1 agreement: share of positions whose most likely next token equals the "
                     "fp16 model's; KL: KL(p_fp16 || p_format) of the next-token distributions. "
                     "Read with care: the default model was itself stored as Q4_1 linears and a Q8_0 "
                     "embedding, so requantizing into q4_1 (linears) or q8_0 (embedding) lands on "
                     "nearly the same grid and loses less than a format would on an unquantized "
                     "model; 5-bit formats must round a 4-bit grid onto theirs. GGUF formats also "
                     "quantize the tied embedding / lm_head (as their files do), AWQ keeps it fp16. "
                     "Gaussian NMSE above has no such bias.\n")

    if plots:
        L.append("## Plots\n")
        for p in plots:
            link = os.path.relpath(p, md_dir) if md_dir is not None else os.path.basename(p)
            L.append(f"![{os.path.splitext(os.path.basename(p))[0]}]({link.replace(os.sep, '/')})\n")
    L.append("## How to regenerate\n")
    L.append("On a CUDA machine: `quantzoo bench kernels --out DIR` (writes DIR/bench-kernels.json and "
             ".csv); then, anywhere: `quantzoo report --bench DIR/bench-kernels.json --out REPORT` "
             "(REPORT a folder, or a .md path whose PNGs and CSVs go to the folder of the same "
             "name). Without `--bench` on a CPU-only machine the report has no kernel speed section; "
             "on a GPU it runs the quick bench first.\n")
    return "\n".join(L).rstrip() + "\n"


# ------------------------------------------------------------------------------------------
# files


def _write_csv(path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                        for k, v in r.items()})


# what write() puts in its folder beside the markdown (those of them the report has)
OUT_FILES = ("report.json", "formats.csv", "speed.csv", "accuracy.csv", "bench-kernels.json",
             "bench-kernels.csv", "nmse.png", "roofline.png", "speedup.png")


def out_paths(out: str) -> tuple[str, str]:
    """(markdown path, folder for the rest) for write()'s `out`."""
    if out.lower().endswith(".md"):   # (R.MD too)
        return out, out[:-3]
    return os.path.join(out, "report.md"), out


def check_out(out: str, what: str) -> None:
    """That write(rep, out) can write its files (quantzoo.paths: one ValueError naming `what`),
    checked before the report's accuracy runs and bench."""
    from ..paths import check_out_dir, check_out_file

    md_path, out_dir = out_paths(out)
    check_out_dir(out_dir, what if out_dir == out else f"{what} (the rest of the report goes in {out_dir})",
                  files=OUT_FILES)
    check_out_file(md_path, what, make_parent=True)


def write(rep: dict, out: str, *, plots: bool = True) -> dict:
    """report.md + report.json + formats/speed/accuracy CSVs (+ bench JSON/CSV) + PNGs.

    `out` is a folder (everything goes in it, the markdown as report.md) or a path ending in
    .md (the markdown there; everything else in the folder of the same name beside it)."""
    md_path, out_dir = out_paths(out)
    from . import plots as P

    os.makedirs(out_dir, exist_ok=True)
    files = {}
    pngs = []
    if plots and P.have_matplotlib():
        pngs = P.write_all(out_dir, rep["bench"], rep["formats"])
    rep["plots"] = [os.path.basename(p) for p in pngs]
    if plots and not pngs:
        rep["plots_skipped"] = "matplotlib is not installed (pip install quantzoo[plot])"
    md = render(rep, [os.path.abspath(p) for p in pngs], md_dir=os.path.dirname(os.path.abspath(md_path)))
    if rep.get("plots_skipped"):
        md += f"\n(Plots skipped: {rep['plots_skipped']}.)\n"
    files["md"] = md_path
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(files["md"], "w") as f:
        f.write(md)
    files["json"] = os.path.join(out_dir, "report.json")
    from quantzoo.bench.kernels import finite_or_none

    with open(files["json"], "w") as f:   # (NaN in a field the report does not read: null, as JSON has it)
        json.dump(finite_or_none({k: v for k, v in rep.items() if k != "bench"}), f, indent=1, allow_nan=False,
                  default=lambda o: o.item() if hasattr(o, "item") else str(o))
    files["formats_csv"] = os.path.join(out_dir, "formats.csv")
    _write_csv(files["formats_csv"], rep["formats"])
    if rep["speed"]:
        files["speed_csv"] = os.path.join(out_dir, "speed.csv")
        _write_csv(files["speed_csv"], rep["speed"])
    if rep.get("accuracy") and rep["accuracy"].get("rows"):
        files["accuracy_csv"] = os.path.join(out_dir, "accuracy.csv")
        _write_csv(files["accuracy_csv"], rep["accuracy"]["rows"])
    if rep["bench"] is not None:
        from quantzoo.bench.kernels import write_outputs

        write_outputs(rep["bench"], out_dir)
        files["bench_json"] = os.path.join(out_dir, "bench-kernels.json")
    files["plots"] = pngs
    return files


__all__ = ["build", "render", "write", "check_out", "format_rows", "speed_rows", "load_model_bench", "sizes",
           "speed", "checks"]
