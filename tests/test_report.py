"""`quantzoo report`: built from a recorded bench fixture and from a live CPU run.

The fixture (tests/data/bench_kernels_fixture.json, written by make_bench_fixture.py) has the
structure of real `quantzoo bench kernels` output with synthetic numbers; the report must
carry every registry format, numbers that parse and are finite, and plots that exist.
"""
import copy
import json
import math
import os
import re
import subprocess
import sys

import pytest

from quantzoo import formats, report, workload
from quantzoo.report import checks, plots, sizes, speed

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "bench_kernels_fixture.json")
REPORT_FORMATS = [f.name for f in formats.weight_formats()] + ["fp16"]


@pytest.fixture(scope="module")
def errors():
    """NMSE of every format on the standard workload, computed once for the module."""
    x, w, y = workload.gaussian(**workload.STANDARD)
    return {n: workload.format_errors(formats.get(n), x, w, y) for n in REPORT_FORMATS}


@pytest.fixture(scope="module")
def bench():
    return speed.load_bench(FIXTURE)


def md_tables(md: str) -> list[list[dict]]:
    """Every GitHub table in the markdown as a list of {header: cell} rows."""
    tables, cur, hdr = [], None, None
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if hdr is None:
                hdr, cur = cells, []
            elif set(line.replace("|", "").strip()) <= set("-: "):
                continue
            else:
                cur.append(dict(zip(hdr, cells)))
        elif hdr is not None:
            tables.append(cur)
            hdr = cur = None
    if hdr is not None:
        tables.append(cur)
    return tables


def table_with(md: str, header: str) -> list[dict]:
    for t in md_tables(md):
        if t and header in t[0]:
            return t
    raise AssertionError(f"no table with column {header!r}")


def finite(cell: str) -> float:
    v = float(cell)
    assert math.isfinite(v), cell
    return v


def check_format_table(md: str, with_speed: bool) -> None:
    t = table_with(md, "NMSE % (kernel)")
    assert [r["format"] for r in t] == REPORT_FORMATS  # every registry weight format + baseline
    for r in t:
        fmt = formats.get(r["format"])
        assert abs(finite(r["bits/weight"]) - fmt.bits_per_weight) < 1e-3
        gb = finite(r["Qwen3-8B GB"])
        assert 4.0 < gb < 17.0
        assert abs(gb - sizes.model_bytes(fmt)["total"] / 1e9) < 0.006
        nw, nk = finite(r["NMSE % (weights)"]), finite(r["NMSE % (kernel)"])
        assert 0 <= nw and 0 <= nk <= 100 * fmt.nmse_ceiling * 1.5 + 1e-4
        if fmt.kind == "weight":
            assert nw > 0 and nk >= 0.95 * nw
        assert ("roofline decode tok/s" in r) == with_speed
        if with_speed:
            assert 100 < finite(r["roofline decode tok/s"]) < 2000


def check_pngs(files: list[str]) -> None:
    for p in files:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n", p
        assert os.path.getsize(p) > 5000, p


def test_report_from_bench_fixture(tmp_path, errors, bench):
    rep = report.build(bench, accuracy=False, errors=errors)
    files = report.write(rep, str(tmp_path), plots=True)
    md = open(files["md"]).read()
    assert "test fixture, not a measurement" in md
    check_format_table(md, with_speed=True)
    t = table_with(md, "M=16 x cuBLAS")
    # every registry format: those of the fixture, then any it is older than, said to be so
    benched = speed.formats_in(bench)
    assert [r["format"] for r in t] == benched + [n for n in REPORT_FORMATS if n not in benched]
    assert set(benched) <= set(REPORT_FORMATS)
    for r in t:
        if r["format"] not in benched:
            assert r["status"] == "not benched"
            continue
        assert r["status"] == "ok"
        for m in report.HEADLINE_M:
            assert 0 < finite(r[f"M={m} % roofline"]) <= 100.0
            x = finite(r[f"M={m} x cuBLAS"])
            assert x > 0 and (x == 1.0 if r["format"] == "fp16" else True)
        assert r["dispatch path (crossovers)"]
    # the fixture's 4-bit kernels beat fp16 at M=1 and lose at M=512 (its made-up model says so)
    q4 = next(r for r in t if r["format"] == "q4_0")
    assert finite(q4["M=1 x cuBLAS"]) > 1 > finite(q4["M=512 x cuBLAS"])
    assert q4["dispatch path (crossovers)"] == "mmvq, mmq from M=16"
    assert int(q4["slower than fp16 from M"]) == speed.vs_fp16(bench, "q4_0")[0]
    # M = 1 fit: a row per format, the numbers streaming_fit gives
    fit_t = table_with(md, "streaming TB/s")
    assert sorted(r["format"] for r in fit_t) == sorted(benched)
    for r in fit_t:
        fit = speed.streaming_fit(bench, r["format"])
        assert finite(r["streaming TB/s"]) == pytest.approx(fit["rate_tbps"], abs=0.006)
        assert finite(r["fixed us per product"]) == pytest.approx(fit["fixed_us"], abs=0.006)
        assert r["PDL: fixed us"] == "-"   # the fixture has no PDL timings
    # per-shape detail: one table per shape, a cell for every bench M
    for k, n, _, _ in bench["settings"]["qwen3_8b_layer"]:
        assert f"**{k} -> {n}**" in md
    detail = [t for t in md_tables(md) if t and "M=4096" in t[0]]
    assert len(detail) == 4
    for t in detail:
        for r in t:
            for m in bench["settings"]["m"]:
                us, x = r[f"M={m}"].split()
                assert finite(us) > 0 and finite(x.strip("()")) > 0
    # files next to the markdown
    for key in ("json", "formats_csv", "speed_csv", "bench_json"):
        assert os.path.getsize(files[key]) > 0
    with open(files["json"]) as f:
        data = json.load(f)
    assert [r["format"] for r in data["formats"]] == REPORT_FORMATS
    assert speed.load_bench(files["bench_json"])["results"] == bench["results"]
    if not plots.have_matplotlib():
        pytest.skip("matplotlib missing: plots not checked")
    assert sorted(os.path.basename(p) for p in files["plots"]) == ["nmse.png", "roofline.png", "speedup.png"]
    check_pngs(files["plots"])
    for p in files["plots"]:
        assert f"]({os.path.basename(p)})" in md


def test_report_cpu_live_cli(tmp_path):
    """A live CPU run through the CLI: no speed section, and it says so."""
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "report", "--no-bench", "--no-accuracy",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report.md").read_text()
    assert "CPU only: no kernel speed." in md
    assert "## Kernel speed" not in md
    check_format_table(md, with_speed=False)
    with open(tmp_path / "formats.csv") as f:
        lines = f.read().splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == REPORT_FORMATS
    if plots.have_matplotlib():
        check_pngs([str(tmp_path / "nmse.png")])
        assert not (tmp_path / "roofline.png").exists()


def test_report_names_a_missing_kernel(errors, bench):
    """A format whose kernel module is missing shows up as such; the others are unaffected."""
    b = copy.deepcopy(bench)
    for r in b["results"]:
        if r["format"] == "q5_1":
            for key in list(r):
                if key not in ("format", "k", "n", "m"):
                    del r[key]
            r.update(status="missing", error="ModuleNotFoundError: No module named 'quantzoo.kernels.gguf'")
    md = report.render(report.build(b, accuracy=False, errors=errors))
    t = {r["format"]: r for r in table_with(md, "M=16 x cuBLAS")}
    assert t["q5_1"]["status"] == "missing" and t["q5_1"]["M=1 % roofline"] == "-"
    assert "No module named 'quantzoo.kernels.gguf'" in md
    assert finite(t["q5_0"]["M=1 x cuBLAS"]) == pytest.approx(
        speed.aggregate(bench, "q5_0", 1)["x_cublas"], abs=0.006)


def test_bench_file_is_checked(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="not a `quantzoo bench kernels` JSON"):
        speed.load_bench(str(p))
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "report", "--bench", str(p), "--no-accuracy"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "not a `quantzoo bench kernels` JSON" in out.stderr


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not a `quantzoo bench kernels` JSON file (Expecting property name"),
    (None, "cannot read the `quantzoo bench kernels` file"),
    ({"ceilings": [1]}, "'ceilings' is missing or not a JSON object"),
    ({"results": [{"format": "q4_0", "k": 64, "n": 64, "m": 1, "status": "ok"}]}, "results[0] lacks median_us"),
])
def test_bad_bench_files_are_one_line_errors(tmp_path, capsys, content, needle):
    """What `quantzoo report` says of an unreadable, malformed or incomplete --bench file: exit 2
    and one line naming the file, never a traceback."""
    from quantzoo.cli import main

    p = tmp_path / "b.json"
    if content is None:
        p.mkdir()
    elif isinstance(content, str):
        p.write_text(content)
    else:
        good = {"kind": "quantzoo-bench-kernels", "machine": {}, "settings": {"m": [1]}, "results": [],
                "ceilings": {"copy_tbps": 3.0, "cublas_fp16_tflops": 700.0}}
        p.write_text(json.dumps({**good, **content}))
    assert main(["report", "--bench", str(p), "--no-accuracy", "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(p) in err and needle in err, err


def test_bad_model_bench_file_is_an_error(tmp_path, capsys):
    from quantzoo.cli import main

    p = tmp_path / "m.json"
    p.write_text("[1, 2]")
    assert main(["report", "--model-bench", str(p), "--no-bench", "--no-accuracy", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "expected a 'results' list of per-format records" in err


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/m.gguf"], "--model '/nonexistent/m.gguf': no such file or directory"),
    (["--accuracy-formats", "q4_0,q8_1"], "--accuracy-formats: 'q8_1' is an activation format"),
    # a file that is no model: it failed after the bench as "SRC=...", an argument report lacks
    (["--model", __file__], f"--model {__file__!r}: expected an HF model directory, a .gguf file or a "
                            "KuiperLLama .bin"),
    # no format named: it meant every format, silently
    (["--accuracy-formats", ","], "--accuracy-formats ',': no format named"),
    # the accuracy section's settings with --no-accuracy: they were ignored without a word
    (["--no-accuracy", "--accuracy-formats", "q4_0"], "--accuracy-formats: for the accuracy section, which "
                                                      "--no-accuracy leaves out"),
    (["--no-accuracy", "--model", "m.gguf", "--accuracy-tokens", "64"],
     "--accuracy-tokens, --model: for the accuracy section, which --no-accuracy leaves out"),
])
def test_bad_accuracy_arguments_are_errors(capsys, monkeypatch, args, needle):
    """A model path given and not found was a 'Skipped' line inside a report that exited 0. Both
    are refused before the quick kernel bench a GPU machine would run first (a stand-in GPU here)."""
    import torch

    from quantzoo.bench import kernels
    from quantzoo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "run_bench", lambda **kw: pytest.fail("the bench ran before the check"))
    assert main(["report", "--no-plots", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_a_model_without_a_tokenizer_is_named(tmp_path, capsys):
    """--model of an HF directory without tokenizer files: the error said "the model has no
    tokenizer", naming no model."""
    import helpers_models as H

    from quantzoo.cli import main

    path, _, _ = H.make_model_dir("llama-gqa", tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).unlink()
    capsys.readouterr()   # (transformers' own output while saving)
    assert main(["report", "--no-bench", "--no-plots", "--model", str(path), "--accuracy-formats", "q8_0"]) == 2
    assert capsys.readouterr().err.strip() == (f"quantzoo report: error: {path}: the model has no tokenizer; "
                                               "the accuracy section needs one")


def test_a_write_that_fails_names_out(tmp_path, capsys, monkeypatch):
    """--out passes its checks and the write still fails (a full disk; /proc, which os.access
    calls writable for root): one line naming --out, after the report was built."""
    import errno

    from quantzoo import report
    from quantzoo.cli import main

    def full(rep, out, plots=True):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r" / "report.json"))

    monkeypatch.setattr(report, "write", full)
    assert main(["report", "--no-bench", "--no-accuracy", "--no-plots", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {tmp_path / 'r'}: could not write " in err \
        and "report.json: No space left on device" in err, err


def test_layer_aggregate_by_hand():
    """% roofline and x cuBLAS for a Qwen3-8B layer: sums over 7 linears, checked by hand."""
    shapes = [(4096, 4096, "qo", 2), (4096, 1024, "kv", 2), (4096, 12288, "gu", 2), (12288, 4096, "d", 1)]
    rows = []
    for i, (k, n, _, _) in enumerate(shapes):
        for fmt, t, roof, path in (("fp16", 10.0 * (i + 1), 8.0 * (i + 1), "cublas"),
                                   ("q4_0", 4.0 * (i + 1), 2.0 * (i + 1), "mmvq")):
            rows.append({"format": fmt, "k": k, "n": n, "m": 1, "status": "ok", "median_us": t,
                         "roofline_us": roof, "path": path})
            rows.append({"format": fmt, "k": k, "n": n, "m": 64, "status": "ok", "median_us": t * 10,
                         "roofline_us": roof, "path": "mmq" if fmt == "q4_0" and k == 4096 else path})
    res = {"kind": "quantzoo-bench-kernels", "machine": {}, "results": rows,
           "ceilings": {"copy_tbps": 3.0, "cublas_fp16_tflops": 700.0},
           "settings": {"m": [1, 64], "qwen3_8b_layer": [list(s) for s in shapes]}}
    checks.check_kernels_bench(res)
    # layer weights 2,2,2,1 over shapes i = 0..3: sum_i c_i (i+1) = 2+4+6+4 = 16
    a = speed.aggregate(res, "q4_0", 1)
    assert a["us"] == pytest.approx(4.0 * 16)
    assert a["pct_roofline"] == pytest.approx(100 * 2.0 * 16 / (4.0 * 16))
    assert a["x_cublas"] == pytest.approx(10.0 / 4.0)
    assert speed.aggregate(res, "q4_0", 64)["x_cublas"] == pytest.approx(100.0 / 40.0)
    assert speed.vs_fp16(res, "q4_0")[0] is None
    assert speed.aggregate(res, "q4_0", 16) is None
    assert speed.path_changes(res, "q4_0")["4096->4096"] == [(1, "mmvq"), (64, "mmq")]
    assert speed.path_changes(res, "q4_0")["12288->4096"] == [(1, "mmvq")]
    assert "4096->4096: mmvq, mmq from M=64" in speed.crossover_text(res, "q4_0")


def test_streaming_fit_recovers_a_line():
    """streaming_fit on M = 1 times made from a known line (2 TB/s, 3.5 us fixed) plus a row of
    another M and a failed row, which it must ignore; one weight size or a falling line: None."""
    rows = [{"format": "q4_0", "k": k, "n": n, "m": 1, "status": "ok", "weight_bytes": b,
             "median_us": 3.5 + b / 2e6} for k, n, b in ((4096, 4096, 9_437_184), (4096, 1024, 2_359_296),
                                                         (4096, 12288, 28_311_552), (12288, 4096, 28_311_552))]
    rows += [dict(rows[0], m=16, median_us=99.0), dict(rows[1], status="error", median_us=1e6)]
    res = {"results": rows}
    fit = speed.streaming_fit(res, "q4_0")
    assert fit["rate_tbps"] == pytest.approx(2.0) and fit["fixed_us"] == pytest.approx(3.5)
    assert fit["shapes"] == 4 and fit["max_residual_us"] < 1e-9
    rows[2]["median_us"] += 0.4      # off the line: the residual shows it
    assert speed.streaming_fit(res, "q4_0")["max_residual_us"] > 0.1
    assert speed.streaming_fit({"results": rows[2:4]}, "q4_0") is None        # one size
    falling = [dict(r, median_us=50 - r["weight_bytes"] / 1e6) for r in rows[:4]]
    assert speed.streaming_fit({"results": falling}, "q4_0") is None
    assert speed.streaming_fit(res, "q8_0") is None
    for r in rows[:4]:   # the PDL timings: their own line
        r["median_us_pdl"] = 1.5 + r["weight_bytes"] / 2.5e6
    pdl = speed.streaming_fit(res, "q4_0", key="median_us_pdl")
    assert pdl["rate_tbps"] == pytest.approx(2.5) and pdl["fixed_us"] == pytest.approx(1.5)


def test_read_floor_by_hand(errors, bench):
    """The layer at M = 1 against the one-launch read: sums over the 7 linears, by hand, and
    the report's table carries them; a bench without reads (older files) has no such table."""
    shapes = [(4096, 4096, "qo", 2), (4096, 1024, "kv", 2), (4096, 12288, "gu", 2), (12288, 4096, "d", 1)]
    rows = [{"format": "q4_0", "k": k, "n": n, "m": 1, "status": "ok", "weight_bytes": 1000 * (i + 1),
             "median_us": 4.0 * (i + 1), "read_us": 2.5 * (i + 1), "median_us_pdl": 3.0 * (i + 1),
             "read_us_pdl": 2.0 * (i + 1)} for i, (k, n, _, _) in enumerate(shapes)]
    res = {"results": rows, "settings": {"qwen3_8b_layer": [list(s) for s in shapes]}}
    f = speed.read_floor(res, "q4_0")   # layer weights 2, 2, 2, 1: sum_i c_i (i + 1) = 16
    assert f == pytest.approx({"us": 64.0, "read_us": 40.0, "us_pdl": 48.0, "read_us_pdl": 32.0,
                               "bytes": 16000})
    del rows[1]["read_us_pdl"], rows[1]["median_us_pdl"]
    f = speed.read_floor(res, "q4_0")
    assert f["read_us"] == pytest.approx(40.0) and f["us_pdl"] is None and f["read_us_pdl"] is None
    del rows[2]["read_us"]
    assert speed.read_floor(res, "q4_0") is None
    md = report.render(report.build(bench, accuracy=False, errors=errors))
    t = table_with(md, "kernel / read")
    assert sorted(r["format"] for r in t) == sorted(speed.formats_in(bench))
    copy_bps = bench["ceilings"]["copy_tbps"] * 1e12
    for r in t:
        fl = speed.read_floor(bench, r["format"])
        assert finite(r["layer us"]) == pytest.approx(fl["us"], abs=0.06)
        assert finite(r["read us"]) == pytest.approx(fl["read_us"], abs=0.06)
        assert finite(r["read % of copy"]) == pytest.approx(100 * fl["bytes"] / copy_bps / (fl["read_us"] * 1e-6), abs=0.6)
        assert finite(r["kernel / read"]) > 1.0   # the fixture's reads are faster than its kernels
        assert r["PDL: read us"] == "-"
    old = copy.deepcopy(bench)
    for r in old["results"]:
        r.pop("read_us", None)
    assert "kernel / read" not in report.render(report.build(old, accuracy=False, errors=errors))


def test_sustained_power_by_hand(errors, bench):
    """The power probe's rows: sustained and energy x cuBLAS = cuBLAS fp16's sustained time and mJ
    per product / the format's at the same shape and M, by hand and in the report's table; a
    bench without the probe (an older file) has no table, one whose probe failed says so."""
    rows = [{"format": f, "k": 4096, "n": 12288, "m": m, "status": "ok", "sustained_us": us, "mj_per_call": mj}
            for f, m, us, mj in (("q4_0", 512, 100.0, 0.070), ("fp16", 512, 87.0, 0.061), ("fp16", 1, 36.0, 0.004),
                                 ("q4_0", 1, 14.0, 0.002), ("awq", 1, 15.0, None))]
    got = speed.sustained({"results": rows})
    # by M, then in the bench's format order (first seen), the row without a sample left out
    assert [(r["format"], r["m"]) for r in got] == [("q4_0", 1), ("fp16", 1), ("q4_0", 512), ("fp16", 512)]
    assert [r["energy_x_cublas"] for r in got] == pytest.approx([2.0, 1.0, 0.061 / 0.070, 1.0])
    assert [r["sustained_x_cublas"] for r in got] == pytest.approx([36 / 14, 1.0, 0.87, 1.0])
    md = report.render(report.build(bench, accuracy=False, errors=errors))
    t = table_with(md, "energy x cuBLAS")
    assert sorted({r["format"] for r in t}) == sorted(speed.formats_in(bench))
    rows = {(r["format"], r["k"], r["n"], r["m"]): r for r in speed.ok_rows(bench)}
    for r in t:
        src = rows[(r["format"], 4096, 12288, int(r["M"]))]
        base = rows[("fp16", 4096, 12288, int(r["M"]))]
        assert finite(r["mJ per product"]) == pytest.approx(src["mj_per_call"], abs=5e-3)
        assert finite(r["energy x cuBLAS"]) == pytest.approx(base["mj_per_call"] / src["mj_per_call"], abs=5e-3)
        assert finite(r["sustained x cuBLAS"]) == pytest.approx(base["sustained_us"] / src["sustained_us"], abs=5e-3)
        assert finite(r["power W"]) == src["power_w"] and finite(r["SM clock MHz"]) == src["sm_clock_mhz"]
    assert "(700 W)" in md and "every 50 ms" in md and "for 1.5 s" in md
    old = copy.deepcopy(bench)   # as written before the probe existed
    del old["settings"]["power"], old["machine"]["power_limit"]
    new_keys = ("sustained_us", "sm_clock_mhz", "power_w", "power_capped", "clock_reasons", "clock_reason_bits",
                "power_limit_w", "mj_per_call")
    for r in old["results"]:
        for key in new_keys:
            r.pop(key, None)
    md = report.render(report.build(old, accuracy=False, errors=errors))
    assert "energy x cuBLAS" not in md and "power probe" not in md
    old["results"][0]["power_error"] = "ValueError: nvidia-smi: cannot run it"
    assert "The sustained power probe failed: ValueError: nvidia-smi: cannot run it" in \
        report.render(report.build(old, accuracy=False, errors=errors))
    part = copy.deepcopy(bench)
    part["results"][0]["power_error"] = "ValueError: nvidia-smi -i GPU-x: no clock/power sample"
    md = report.render(report.build(part, accuracy=False, errors=errors))
    assert "energy x cuBLAS" in md and "The sustained power probe failed for some rows: ValueError" in md


def test_qwen3_8b_sizes_match_outside_figures():
    """Qwen3-8B has 8.19 G parameters (its model card: 8.2B); DESIGN.md's decode rooflines at
    2.99 TB/s (computed independently from the GGUF tensor sizes): Q4_0 702, Q8_0 371,
    F16 198, AWQ g128 with fp16 lm_head 616 tok/s."""
    assert sizes.qwen3_param_count() == 8_190_735_360
    for name, tok_s in (("q4_0", 702), ("q8_0", 371), ("fp16", 198), ("awq", 616)):
        assert 2.99e12 / sizes.decode_bytes_per_token(formats.get(name)) == pytest.approx(tok_s, abs=1)
    fp16 = sizes.model_bytes(formats.get("fp16"))
    assert fp16["total"] == 2 * (sizes.qwen3_param_count() - sizes.qwen3_norm_params()) + \
        4 * sizes.qwen3_norm_params()
    assert sizes.model_bytes(formats.get("awq"))["embedding_format"] == "fp16"
    assert sizes.model_bytes(formats.get("q4_0"))["embedding_format"] == "q4_0"


def test_shipped_text():
    from quantzoo.report import accuracy

    text = accuracy.english_text()
    assert 1000 < len(text) < 5000 and text.isascii()
    assert len(text.split()) > 250


def test_report_to_md_path(tmp_path, errors, bench):
    """--out docs/name.md: the markdown there, its PNGs/CSVs in docs/name/, links relative."""
    rep = report.build(bench, accuracy=False, errors=errors)
    files = report.write(rep, str(tmp_path / "docs" / "name.md"), plots=True)
    assert files["md"] == str(tmp_path / "docs" / "name.md")
    md = (tmp_path / "docs" / "name.md").read_text()
    assert (tmp_path / "docs" / "name" / "bench-kernels.json").exists()
    assert (tmp_path / "docs" / "name" / "formats.csv").exists()
    for p in files["plots"]:
        assert os.path.dirname(p) == str(tmp_path / "docs" / "name")
        assert f"](name/{os.path.basename(p)})" in md
    assert report.out_paths("docs/R.MD") == ("docs/R.MD", "docs/R")   # (not a folder docs/R.MD/)


def test_model_bench_section(errors):
    """A `quantzoo bench model` JSON (its shape: results with tok/s fields, or an error)."""
    mb = {"results": [{"format": "q4_0", "weight_bytes": 4.26e9, "roofline_tok_s": 702.2,
                       "decode_tok_s_graph": 251.5, "decode_tok_s_eager": 60.25, "prefill_tok_s_512": 5000.0},
                      {"format": "awq", "error": "RuntimeError: out of memory"}]}
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = table_with(md, "decode_tok_s_graph")
    assert t[0]["format"] == "q4_0" and finite(t[0]["decode_tok_s_graph"]) == pytest.approx(251.5, abs=0.5)
    assert finite(t[0]["roofline_tok_s"]) == pytest.approx(702.2, abs=0.5) and t[1]["decode_tok_s_graph"] == "-"
    assert finite(t[0]["decode_tok_s_eager"]) == 60.2
    assert "`awq`: RuntimeError: out of memory" in md
    assert "Two decode bounds" not in md   # explained only where the bench measured them
    mb["results"][0].update(decode_tok_s_reads_only=610.0, decode_tok_s_ideal_linears=470.0,
                            roofline_fraction_reads_only=0.869, decode_read_config_reads_only=[2, 4])
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = table_with(md, "decode_tok_s_reads_only")
    assert finite(t[0]["decode_tok_s_ideal_linears"]) == 470.0 and finite(t[0]["roofline_fraction_reads_only"]) == 0.869
    assert "decode_read_config_reads_only" not in t[0] and "Two decode bounds" in md
    assert "persistent kernel" not in md
    mb["results"][0].update(decode_tok_s_graph_ctx4096=300.0, decode_tok_s_graph_persistent=330.0,
                            decode_persistent_phases_us={"attention": {"work_mean_us": 70.0}})
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = table_with(md, "decode_tok_s_graph_persistent")
    assert finite(t[0]["decode_tok_s_graph_persistent"]) == 330.0 and "persistent kernel" in md
    assert finite(t[0]["decode_tok_s_graph_ctx4096"]) == 300.0 and "after a 4096-token prompt" in md
    assert "decode_persistent_phases_us" not in t[0]


def test_model_bench_against_fp16(errors):
    """The model section's comparison with the fp16 runner: decode, prefill by wall clock and by
    GPU time (prefill_breakdown), and their quotient (time outside kernels: launch gaps, or the host)."""
    def rec(fmt, dec, tps512, gpu_us, tps2048):
        return {"format": fmt, "decode_tok_s_graph": dec, "prefill_tok_s_512": tps512,
                "prefill_tok_s_2048": tps2048,
                "prefill_breakdown": [{"total_gpu_us": gpu_us, "wall_us": 1.0, "kernels": 3}]}
    mb = {"results": [rec("awq", 330.0, 12800.0, 17000.0, 34000.0), rec("fp16", 165.0, 25600.0, 13600.0, 40000.0),
                      {"format": "q8_0", "error": "RuntimeError: out of memory"}]}
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = table_with(md, "prefill 512 GPU ms")
    awq, fp16 = t
    assert awq["format"] == "awq" and len(t) == 2            # the failed format has no row
    assert awq["decode tok/s"] == "330" and awq["decode x fp16"] == "2.00"
    assert finite(awq["prefill 512 wall ms"]) == pytest.approx(40.0, abs=0.05)   # 512 / 12800 s
    assert finite(awq["prefill 512 GPU ms"]) == pytest.approx(17.0, abs=0.05)
    assert awq["wall x fp16"] == "0.50" and awq["GPU x fp16"] == "0.80" and awq["wall / GPU"] == "2.35"
    assert fp16["GPU x fp16"] == "1.00" and fp16["wall / GPU"] == "1.47"
    assert awq["prefill 2048 wall tok/s"] == "34000" and awq["2048 x fp16"] == "0.85"
    assert report.model_vs_fp16_rows({"results": [rec("awq", 1.0, 1.0, 1.0, 1.0)]}) is None
    # the round-robin figures take precedence for the wall columns (JSON keys are strings)
    mb["prefill_side_by_side"] = {"reps": 7, "tok_s": {"awq": {"512": 20480.0, "2048": 36000.0},
                                                       "fp16": {"512": 25600.0, "2048": 40000.0}}}
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    awq = table_with(md, "prefill 512 GPU ms")[0]
    assert finite(awq["prefill 512 wall ms"]) == pytest.approx(25.0, abs=0.05) and awq["wall x fp16"] == "0.80"
    assert awq["2048 x fp16"] == "0.90" and "timed round-robin" in md


def test_a_tied_lm_head_is_read_every_step_too():
    """Tied or not, one decode step reads one vocab x hidden lm_head matrix (embedding rows
    excluded): the tied model's decode bytes had left it out."""
    tied = {**sizes.QWEN3_8B, "tied": True}
    for fmt in (formats.get(n) for n in formats.names()):
        if fmt.kind == "activation":
            continue
        assert sizes.decode_bytes_per_token(fmt, tied) == sizes.decode_bytes_per_token(fmt), fmt.name
        assert 2 * sizes.model_bytes(fmt, tied)["embeddings"] == sizes.model_bytes(fmt)["embeddings"], fmt.name


# ------------------------------------------------------------------------------------------
# malformed inputs: each file is checked whole at load (quantzoo.report.checks), before the
# quick bench, the accuracy run and the plots; what is refused is one line naming file and field


def model_bench_doc() -> dict:
    """A `quantzoo bench model` JSON of the real run's shape (bench/model-h100.json), made-up numbers."""
    def rec(fmt, wb, dec, p512, p2048, gpu_us):
        kv = 301989888
        return {"format": fmt, "weight_bytes": wb, "embedding_bytes": 1244659712, "formats": {"q_proj": fmt},
                "roofline_tok_s": 2.94e12 / wb, "decode_tok_s_graph": dec, "decode_tok_s_eager": dec / 3,
                "fused_layer_ops": True, "roofline_fraction": dec * wb / 2.94e12,
                "decode_breakdown": [{"name": "mmvq", "us": 1.0}],
                "peak_decode_bytes": int(1.002 * (wb + 1244659712 + kv // 8)),
                "peak_decode_over_weights_kv": 1.002, "kv_cache_bytes": kv,
                "prefill_tok_s_512": p512, "prefill_tok_s_2048": p2048,
                "prefill_breakdown": [{"total_gpu_us": gpu_us, "wall_us": 1.0, "kernels": 3}],
                "peak_gpu_bytes": int(1.04 * (wb + 1244659712 + kv)), "peak_over_weights_kv": 1.04}
    return {"config": {"arch": "qwen3", "hidden_size": 4096, "num_layers": 36, "vocab_size": 151936},
            "device": "cuda:0", "machine": {"gpu": "NVIDIA H100 (test)", "time_utc": "2026-01-01T00:00:00Z"},
            "copy_bandwidth_bytes_s": 2.94e12,
            "results": [rec("awq", 4853202944, 358.0, 33180.0, 36116.0, 13800.0),
                        rec("q4_0", 4257054720, 448.0, 38976.0, 41071.0, 12300.0),
                        rec("fp16", 15136194560, 177.0, 35197.0, 38608.0, 12300.0)],
            "prefill_side_by_side": {"reps": 7, "tok_s": {f: {"512": 30000.0 + i, "2048": 35000.0 + i}
                                                          for i, f in enumerate(("awq", "q4_0", "fp16"))}}}


def fixture_doc() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def row_index(doc, fmt="awq", k=4096, n=4096, m=1) -> int:
    return next(i for i, r in enumerate(doc["results"]) if (r["format"], r["k"], r["n"], r["m"]) == (fmt, k, n, m))


def refused(tmp_path, capsys, monkeypatch, *, bench=None, model_bench=None, raw=None) -> str:
    """Run `quantzoo report` (accuracy and plots on, a stand-in GPU) on the documents given; it
    must exit 2 with one line and build nothing: no quick bench, no accuracy run, no report."""
    import torch

    from quantzoo.bench import kernels
    from quantzoo.cli import main
    from quantzoo.report import accuracy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "run_bench", lambda **kw: pytest.fail("the quick bench ran before the check"))
    monkeypatch.setattr(accuracy, "accuracy", lambda *a, **kw: pytest.fail("the accuracy ran before the check"))
    argv = ["report", "--out", str(tmp_path / "out")]
    for flag, doc in (("--bench", bench), ("--model-bench", model_bench)):
        if doc is not None:
            p = tmp_path / f"{flag[2:]}.json"
            p.write_text(raw if raw is not None else json.dumps(doc))
            argv += [flag, str(p)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    return err


def test_a_kernels_bench_is_not_a_model_bench(tmp_path, capsys, monkeypatch):
    """A kernels JSON given as --model-bench rendered a 'Model throughput' table of its rows
    (their roofline_us) with exit 0; the other way round, the error says which flag it is for."""
    err = refused(tmp_path, capsys, monkeypatch, model_bench=fixture_doc())
    assert "model-bench.json: a `quantzoo bench kernels` JSON" in err and "give it as --bench" in err
    err = refused(tmp_path, capsys, monkeypatch, model_bench=fixture_doc()["results"])   # its rows alone
    assert "model-bench.json: record [0] (awq): no decode_tok_s_* field" in err and "--bench" in err
    err = refused(tmp_path, capsys, monkeypatch, bench=model_bench_doc())
    assert "bench.json: not a `quantzoo bench kernels` JSON" in err and "give that as --model-bench" in err


@pytest.mark.parametrize("value,shown", [("inf", "Infinity"), ("nan", "NaN"), (0, "0"), (-8.6, "-8.6"),
                                         (None, "null"), ("8.6", '"8.6"')])
def test_a_bad_kernel_time_is_refused(tmp_path, capsys, monkeypatch, value, shown):
    """median_us Infinity / NaN / 0 / negative gave 0.0 % roofline, inflated ratios, a negative
    fixed cost and cells mixing the bad time with the stored x_cublas (NaN/inf also an invalid
    report.json, found after all the work, and an error naming nothing); null or a string a
    traceback. Refused, naming the file, the row and the field."""
    doc = fixture_doc()
    i = row_index(doc, "q4_0", 4096, 1024, 16)
    doc["results"][i]["median_us"] = float(value) if value in ("inf", "nan") else value
    raw = json.dumps(doc) if value not in ("inf", "nan") else json.dumps(doc, allow_nan=True)
    err = refused(tmp_path, capsys, monkeypatch, bench=doc, raw=raw)
    assert f"bench.json: results[{i}] (q4_0 4096->1024 M=16): median_us = {shown} is not a positive number" in err


def set_path(doc, path, value):
    *head, last = path
    for p in head:
        doc = doc[p]
    if value is DELETE:
        del doc[last]
    else:
        doc[last] = value


DELETE = object()
_A0 = ("results", 0)   # the fixture's first row: awq 4096->4096 M=1 (it has read_us)


@pytest.mark.parametrize("path,value,needle", [
    (_A0 + ("roofline_us",), None, "results[0] (awq 4096->4096 M=1): roofline_us = null is not a positive number"),
    (_A0 + ("weight_bytes",), None, "results[0] (awq 4096->4096 M=1): weight_bytes is null"),
    (_A0 + ("weight_bytes",), DELETE, "results[0] (awq 4096->4096 M=1): weight_bytes is missing"),
    (_A0 + ("weight_bytes",), "8716288", 'results[0] (awq 4096->4096 M=1): weight_bytes = "8716288" is not a positive'),
    (_A0 + ("read_us",), "4.6", 'results[0] (awq 4096->4096 M=1): read_us = "4.6" is not a positive number'),
    (_A0 + ("m",), "1", 'results[0]: m = "1" is not a positive integer'),
    (_A0 + ("k",), "4096", 'results[0]: k = "4096" is not a positive integer'),
    (_A0 + ("format",), "q3_k", 'results[0]: format = "q3_k" is not a weight format of the registry'),
    (_A0 + ("format",), "q8_1", 'results[0]: format = "q8_1" is not a weight format of the registry'),
    (_A0 + ("status",), "fine", 'results[0] (awq 4096->4096 M=1): status = "fine" is not one of ok, error, missing'),
    (("results",), [], "'results' is empty: the file holds no measurement"),
    (("settings", "qwen3_8b_layer"), None, "settings.qwen3_8b_layer = null is not a list"),
    (("settings", "qwen3_8b_layer"), [[4096, 4096]],
     "settings.qwen3_8b_layer[0] = [4096, 4096] is not [K, N, names, count]"),
    (("settings", "power"), "yes", 'settings.power = "yes" is not a JSON object'),
    (("settings", "target_s"), "0.03", 'settings.target_s = "0.03" is not a positive number'),
    (("settings", "m"), "1,2", 'settings.m = "1,2" is not a list of positive integers'),
    (("ceilings_end", "copy_tbps"), 0, "ceilings_end.copy_tbps = 0 is not a positive number"),
])
def test_a_malformed_kernels_bench_is_one_line(tmp_path, capsys, monkeypatch, path, value, needle):
    """Wrong types and zeros crashed with ZeroDivisionError / TypeError / AttributeError
    tracebacks, or ended as 'not enough values to unpack (expected 4, got 2)' or a bare 'error:
    weight_bytes' naming neither file nor field; an unknown format got rows of its own and an
    empty results list gave empty tables without saying so."""
    doc = fixture_doc()
    set_path(doc, path, value)
    err = refused(tmp_path, capsys, monkeypatch, bench=doc)
    assert f"bench.json: {needle}" in err, err


@pytest.mark.parametrize("field,value,needle", [
    ("power_capped", None, "power_capped = null is not a share between 0 and 1"),
    ("sustained_us", 0, "sustained_us = 0 is not a positive number"),
    ("mj_per_call", "x", 'mj_per_call = "x" is not a positive number'),
])
def test_a_malformed_power_probe_row_is_one_line(tmp_path, capsys, monkeypatch, field, value, needle):
    doc = fixture_doc()
    i = next(i for i, r in enumerate(doc["results"]) if r.get("mj_per_call") and r["format"] == "q4_0")
    r = doc["results"][i]
    r[field] = value
    err = refused(tmp_path, capsys, monkeypatch, bench=doc)
    assert f"bench.json: results[{i}] (q4_0 {r['k']}->{r['n']} M={r['m']}): {needle}" in err, err


@pytest.mark.parametrize("path,value,needle", [
    (("machine",), "h100", 'machine = "h100" is not a JSON object'),
    (("config",), "qwen3", 'config = "qwen3" is not a JSON object'),
    (("config", "hidden_size"), "4096", 'config.hidden_size = "4096" is not a positive integer'),
    (("copy_bandwidth_bytes_s",), "2.9e12", 'copy_bandwidth_bytes_s = "2.9e12" is not a positive number'),
    (("results", 1, "error"), 123, "results[1] (q4_0): error = 123 is not a string"),
    (("results", 1, "format"), "q3_k", 'results[1]: format = "q3_k" is not a weight format of the registry'),
    (("results", 1, "format"), DELETE, "results[1] lacks format"),
    (("results", 0, "decode_tok_s_graph"), "358",
     'results[0] (awq): decode_tok_s_graph = "358" is not a positive number'),
    (("results", 2, "decode_tok_s_graph"), 0, "results[2] (fp16): decode_tok_s_graph = 0 is not a positive number"),
    (("results", 0, "decode_tok_s_graph"), -5, "results[0] (awq): decode_tok_s_graph = -5 is not a positive number"),
    (("results", 0, "peak_gpu_bytes"), "6e9", 'results[0] (awq): peak_gpu_bytes = "6e9" is not a positive number'),
    (("results", 0, "prefill_breakdown"), {"a": 1}, 'results[0] (awq): prefill_breakdown = {"a": 1} is not a list'),
    (("results", 2, "prefill_breakdown", 0, "total_gpu_us"), "13800",
     'results[2] (fp16): prefill_breakdown[0].total_gpu_us = "13800" is not a positive number'),
    (("prefill_side_by_side",), "x", 'prefill_side_by_side = "x" is not a JSON object'),
    (("prefill_side_by_side", "tok_s", "fp16", "512"), 0,
     "prefill_side_by_side.tok_s.fp16.512 = 0 is not a positive number"),
    (("results",), [], "'results' is empty: the file holds no measurement"),
    # one format twice: its row was printed twice (the kernels bench's check refused that already)
    (("results", 2, "format"), "awq", "results[2] (awq): the same format as results[0]"),
    (("partial",), "yes", 'partial = "yes" is not true or false'),
])
def test_a_malformed_model_bench_is_one_line(tmp_path, capsys, monkeypatch, path, value, needle):
    doc = model_bench_doc()
    set_path(doc, path, value)
    err = refused(tmp_path, capsys, monkeypatch, model_bench=doc)
    assert f"model-bench.json: {needle}" in err, err


def test_nan_in_a_model_bench_is_refused(tmp_path, capsys, monkeypatch):
    """NaN / Infinity tok/s printed as 'nan' in the table, then report.json could not be written
    ('Out of range float values are not JSON compliant: nan', naming nothing) after all the work."""
    doc = model_bench_doc()
    doc["results"][2]["decode_tok_s_graph"] = float("nan")
    err = refused(tmp_path, capsys, monkeypatch, model_bench=doc, raw=json.dumps(doc, allow_nan=True))
    assert "model-bench.json: results[2] (fp16): decode_tok_s_graph = NaN is not a positive number" in err


def test_a_partial_model_bench_is_said_to_be(errors):
    """A bench JSON written mid-run ("partial": true, quantzoo.bench.model) was reported like a
    finished one, its missing formats unmentioned."""
    mb = model_bench_doc()
    assert "A partial run" not in report.render(report.build(None, mb, accuracy=False, errors=errors))
    mb.update(partial=True, results=mb["results"][:1])
    del mb["prefill_side_by_side"]
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    assert '**A partial run**: the bench JSON is marked `"partial": true`' in md
    assert [r["format"] for r in table_with(md, "decode_tok_s_graph")] == ["awq"]


def test_model_bench_as_a_bare_list_of_records(tmp_path, errors):
    """A bare list of records is taken on purpose (checks.check_model_bench makes it the file's
    results); the report crashed on it (AttributeError: 'list' object has no attribute 'get')."""
    from quantzoo.cli import main

    recs = model_bench_doc()["results"]
    p = tmp_path / "recs.json"
    p.write_text(json.dumps(recs))
    md = report.render(report.build(None, recs, accuracy=False, errors=errors))
    t = table_with(md, "decode_tok_s_graph")
    assert [r["format"] for r in t] == ["awq", "q4_0", "fp16"] and t[2]["decode_tok_s_graph"] == "177"
    assert table_with(md, "decode x fp16")[0]["decode x fp16"] == "2.02"
    assert main(["report", "--model-bench", str(p), "--no-bench", "--no-accuracy", "--no-plots",
                 "--out", str(tmp_path / "r.md")]) == 0


def test_never_slower_needs_a_comparison(errors, bench):
    """'never slower than fp16 on this grid' was claimed for a format missing a shape (its
    layer aggregate is None at every M) and for every format of a file without fp16 rows."""
    def md_of(b):
        return report.render(report.build(b, accuracy=False, errors=errors))

    part = copy.deepcopy(bench)
    part["results"] = [r for r in part["results"] if not (r["format"] == "q4_0" and r["k"] == 12288)]
    md = md_of(part)
    t = {r["format"]: r for r in table_with(md, "slower than fp16 from M")}
    assert t["q4_0"]["slower than fp16 from M"] == "n/a" and t["q8_0"]["slower than fp16 from M"] != "n/a"
    q4 = next(line for line in md.splitlines() if line.startswith("- `q4_0`:"))
    assert "never slower" not in q4 and "no comparison with fp16 at any bench M" in q4
    nofp16 = copy.deepcopy(bench)
    nofp16["results"] = [r for r in nofp16["results"] if r["format"] != "fp16"]
    md = md_of(nofp16)
    assert "never" not in md and "(the bench lacks fp16 rows)" in md
    t = table_with(md, "slower than fp16 from M")
    assert {r["slower than fp16 from M"] for r in t if r["format"] in speed.formats_in(nofp16)} == {"n/a"}
    assert [r["status"] for r in t if r["format"] == "fp16"] == ["not benched"]
    # the per-shape cells take x cuBLAS from this file's fp16 rows, not the one the row stored
    detail = [t for t in md_tables(md) if t and "M=4096" in t[0]]
    assert all(c.endswith("(-)") for t in detail for r in t for h, c in r.items() if h != "format")


def test_round_robin_columns_do_not_fall_back(errors):
    """Where prefill_side_by_side has no figure for a format, its wall columns took the
    sequential prefill_tok_s_* under prose saying they were round-robin: '-' now, and said."""
    mb = model_bench_doc()
    del mb["prefill_side_by_side"]["tok_s"]["q4_0"]
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = {r["format"]: r for r in table_with(md, "prefill 512 wall ms")}
    assert t["q4_0"]["prefill 512 wall ms"] == "-" and t["q4_0"]["prefill 2048 wall tok/s"] == "-"
    assert t["q4_0"]["wall x fp16"] == "-" and t["q4_0"]["prefill 512 GPU ms"] == "12.3"
    assert finite(t["awq"]["prefill 2048 wall tok/s"]) == 35000
    assert "timed round-robin" in md and "'-' where the round-robin run has no figure for a format" in md
    # without the round-robin run the sequential figures are used, and the prose says so
    mb["prefill_side_by_side"] = {"skipped": "the formats' models do not fit on the GPU together"}
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    assert table_with(md, "prefill 512 wall ms")[1]["prefill 2048 wall tok/s"] == "41071"
    assert "timed round-robin" not in md and "the bench's round-robin run is not in this file" in md
    assert "it was skipped: the formats' models do not fit on the GPU together" in md


def test_model_section_prose_from_missing_fields(errors):
    """No copy_bandwidth_bytes_s gave '(nan TB/s, ...)'."""
    mb = model_bench_doc()
    del mb["copy_bandwidth_bytes_s"]
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    assert "nan" not in md.lower() and "the file does not record its value" in md
    assert "Measured on NVIDIA H100 (test)" in md


def test_model_table_shows_peak_memory(errors):
    """bench model measures peak memory (peak_*_bytes, kv_cache_bytes, peak_*_over_weights_kv);
    the report's key filter left every one of them out."""
    mb = model_bench_doc()
    md = report.render(report.build(None, mb, accuracy=False, errors=errors))
    t = table_with(md, "peak_gpu_GiB")
    for row, rec in zip(t, mb["results"]):
        assert finite(row["peak_gpu_GiB"]) == pytest.approx(rec["peak_gpu_bytes"] / 2**30, abs=0.006)
        assert finite(row["peak_decode_GiB"]) == pytest.approx(rec["peak_decode_bytes"] / 2**30, abs=0.006)
        assert finite(row["kv_cache_GiB"]) == pytest.approx(0.28, abs=0.006)
        assert row["peak_over_weights_kv"] == "1.040" and row["peak_decode_over_weights_kv"] == "1.002"
    assert "Peak GPU memory" in md
    hdr, _ = report.model_bench_rows(mb)
    assert hdr[-5:] == ["peak_decode_GiB", "peak_decode_over_weights_kv", "kv_cache_GiB", "peak_gpu_GiB",
                        "peak_over_weights_kv"]


# ------------------------------------------------------------------------------------------
# the layer the headline sums, the prompt lengths the model table names, formats not benched


QWEN3_LAYER = {(4096, 4096): 2, (4096, 1024): 2, (4096, 12288): 2, (12288, 4096): 1}


def test_layer_mix_is_the_qwen3_8b_one_whatever_the_file_says(tmp_path, capsys, monkeypatch, errors):
    """The headline sums one Qwen3-8B layer (2, 2, 2, 1 over the four shapes) and says so in
    words. A file whose settings.qwen3_8b_layer said otherwise was summed with its counts under
    that same text (every headline figure moved, nothing said); a file without the key (a bench
    from before it was written) was summed once per shape and said 'not to cover all four
    Qwen3-8B shapes', which it did."""
    from quantzoo.bench.kernels import QWEN3_8B_SHAPES

    base, old = fixture_doc(), fixture_doc()
    del old["settings"]["qwen3_8b_layer"]
    checks.check_kernels_bench(old)
    assert speed.layer_weights(old) == speed.layer_weights(base) == (QWEN3_LAYER, True)
    mds = [report.render(report.build(d, None, accuracy=False, errors=errors)) for d in (base, old)]
    assert "did not cover" not in mds[1] and "one Qwen3-8B decoder layer" in mds[1]
    assert table_with(mds[0], "M=1 % roofline") == table_with(mds[1], "M=1 % roofline")
    assert "**4096 -> 1024** (k_proj, v_proj)" in mds[1]   # the per-shape headings keep their names
    doc = fixture_doc()
    doc["settings"]["qwen3_8b_layer"][0][3] = 3
    err = refused(tmp_path, capsys, monkeypatch, bench=doc)
    assert "bench.json: settings.qwen3_8b_layer = [[4096, 4096, 3], [4096, 1024, 2]" in err, err
    assert err.endswith("is not one Qwen3-8B decoder layer's linears (2x 4096->4096, 2x 4096->1024, "
                        "2x 4096->12288, 1x 12288->4096)"), err
    # one source for the mix, the words and the bench's shapes
    assert speed.qwen3_layer() == QWEN3_LAYER == {(k, n): c for k, n, _, c in QWEN3_8B_SHAPES}
    assert report.layer_text() == ("its 7 linears (2x 4096->4096 q/o, 2x 4096->1024 k/v, "
                                   "2x 4096->12288 gate/up, 1x 12288->4096 down)")


def test_prefill_columns_name_the_prompt_lengths_the_bench_timed(errors):
    """`quantzoo bench model --prompt-lens` (64,256 with --tiny) sets the lengths; its
    prefill_breakdown profiles the shortest. The comparison with fp16 named its columns 512 and
    2048 whatever the file held: the GPU ms of a 64-token prefill was shown as 'prefill 512 GPU
    ms' beside wall columns of '-', with prose about 512- and 2048-token prefills."""
    doc = model_bench_doc()
    for r in doc["results"]:
        r["prefill_tok_s_64"], r["prefill_tok_s_256"] = r.pop("prefill_tok_s_512"), r.pop("prefill_tok_s_2048")
    doc["prefill_side_by_side"]["tok_s"] = {f: {"64": 6400.0 * (i + 1), "256": 25600.0}
                                            for i, f in enumerate(("awq", "q4_0", "fp16"))}
    md = report.render(report.build(None, doc, accuracy=False, errors=errors))
    t = table_with(md, "prefill 64 GPU ms")
    awq = t[0]
    assert awq["format"] == "awq" and finite(awq["prefill 64 GPU ms"]) == pytest.approx(13.8, abs=0.05)
    assert finite(awq["prefill 64 wall ms"]) == pytest.approx(10.0, abs=0.05)      # 64 / 6400 s
    assert awq["wall x fp16"] == "0.33" and awq["256 x fp16"] == "1.00"   # fp16: 3x the tok/s
    assert finite(awq["prefill 256 wall tok/s"]) == 25600.0
    assert not any("512" in h or "2048" in h for h in awq)
    assert "The 64-token prefill by the wall clock" in md and "The 256-token columns" in md
    assert "512-token" not in md and "2048-token" not in md
    # one prompt length: no second pair of columns; none (--prompt-lens ''): decode alone
    for r in doc["results"]:
        del r["prefill_tok_s_256"]
    doc["prefill_side_by_side"]["tok_s"] = {f: {"64": 6400.0} for f in ("awq", "q4_0", "fp16")}
    hdr, _ = report.model_vs_fp16_rows(doc)
    assert hdr == ["format", "decode tok/s", "decode x fp16", "prefill 64 wall ms", "wall x fp16",
                   "prefill 64 GPU ms", "GPU x fp16", "wall / GPU"]
    for r in doc["results"]:
        del r["prefill_tok_s_64"], r["prefill_breakdown"]
    del doc["prefill_side_by_side"]
    hdr, rows = report.model_vs_fp16_rows(doc)
    assert hdr == ["format", "decode tok/s", "decode x fp16"] and rows[0] == ["awq", 358.0, "2.02"]
    md = report.render(report.build(None, doc, accuracy=False, errors=errors))
    assert "(x fp16 above 1: faster than fp16).\n" in md


def test_a_format_the_bench_lacks_is_said_to_be_missing(errors):
    """A bench without some registry format (`quantzoo bench kernels --formats q4_0,fp16`, a
    file older than the format) gave speed tables that left the format out without a word,
    while the size table above them lists every format; the model bench (awq, q4_0, q8_0, fp16
    by design) did the same for q4_1, q5_0 and q5_1."""
    doc = fixture_doc()
    doc["results"] = [r for r in doc["results"] if r["format"] not in ("awq", "q5_1")]
    md = report.render(report.build(doc, model_bench_doc(), accuracy=False, errors=errors))
    t = table_with(md, "M=1 % roofline")
    benched = speed.formats_in(doc)   # (the fixture's own, in its order: every format it has)
    assert [r["format"] for r in t] == benched + [n for n in REPORT_FORMATS if n not in benched]
    assert {"awq", "q5_1"} <= {r["format"] for r in t[len(benched):]}
    for r in t[len(benched):]:
        assert r["status"] == "not benched" and r["M=1 % roofline"] == "-" and r["slower than fp16 from M"] == "-"
    assert "- `awq`: not benched — the bench file has no row of this format" in md
    assert "'n/a' where" not in md   # (the prose for a format benched with gaps)
    in_model_bench = {r["format"] for r in model_bench_doc()["results"]}
    assert ("Not in this model bench: " + ", ".join(f"`{n}`" for n in REPORT_FORMATS if n not in in_model_bench)
            + " (`quantzoo bench model` runs ") in md
    full = report.render(report.build(fixture_doc(), None, accuracy=False, errors=errors))
    for n in REPORT_FORMATS:   # (a format newer than the fixture is not benched there)
        assert (f"- `{n}`: not benched" in full) == (n not in speed.formats_in(fixture_doc())), n


@pytest.mark.parametrize("version", [2, "1", None, True])
def test_a_bench_of_another_schema_version_is_refused(tmp_path, capsys, monkeypatch, version):
    """The bench writes "version": 1 and the report never read it: a file of another schema
    was rendered as if it were version 1. (A file without the field is taken as version 1.)"""
    doc = fixture_doc()
    doc["version"] = version
    err = refused(tmp_path, capsys, monkeypatch, bench=doc)
    assert f"bench.json: version = {json.dumps(version)} is not 1, the `quantzoo bench kernels` schema" in err, err
    del doc["version"]
    checks.check_kernels_bench(doc)


def test_a_crossover_next_to_an_untimed_m_is_not_pinned_on_it():
    """The path change was reported at the first M with an ok row of the new path: with the
    q4_0 4096->1024 row at M=16 failed, 'mmq from M=32' -- a threshold said to lie between 16
    and 32 when the bench only knows it lies between 8 and 32."""
    doc = fixture_doc()
    assert speed.crossover_text(doc, "q4_0") == "mmvq, mmq from M=16"
    i = row_index(doc, "q4_0", 4096, 1024, 16)
    doc["results"][i] = {k: doc["results"][i][k] for k in ("format", "k", "n", "m")}
    doc["results"][i].update(status="error", error="RuntimeError: boom")
    checks.check_kernels_bench(doc)
    txt = speed.crossover_text(doc, "q4_0")
    assert "4096->1024: mmvq, mmq from M<=32;" in txt and "4096->4096: mmvq, mmq from M=16;" in txt, txt


def test_rows_timed_eagerly_are_not_called_graph_replays(errors):
    """A bench run with --no-graph, or a row whose graph capture failed (the bench then times
    eager launches and says so in the row's `timing`), was described as 'median of CUDA-graph
    replays': eager times carry the host's ~16 us launch cost, more than a 4-bit GEMV takes."""
    doc = fixture_doc()
    full = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert "Times: median of CUDA-graph replays of back-to-back launches" in full and "eager" not in full
    i = row_index(doc, "q4_0", 4096, 1024, 1)
    doc["results"][i]["timing"] = "eager (graph capture failed: RuntimeError: boom)"
    md = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert ("except 1 of the %d timed rows (q4_0 4096->1024 M=1), timed from eager launches"
            % len(speed.ok_rows(doc))) in md, md
    assert "(plain launches in a graph, or eager where said above)" in md
    for r in doc["results"]:
        r["timing"] = "eager"
    md = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert "CUDA-graph replays" not in md and "Times: median of eager launches" in md
    doc["results"][i]["timing"] = 7   # (a field the report reads: checked as the others are)
    with pytest.raises(ValueError, match=r"results\[%d\] \(q4_0 4096->1024 M=1\): timing = 7 is not a string" % i):
        checks.check_kernels_bench(doc, "bench")


def test_a_failed_one_launch_read_is_said_to_be(errors):
    """Where the bench's one-launch read of a weight failed (the row ok, with read_error and no
    read_us), its format left the 'against the fastest one-launch read' table without a word:
    the error was in no part of the report."""
    doc = fixture_doc()
    i = row_index(doc, "q4_0", 4096, 1024, 1)
    del doc["results"][i]["read_us"]
    doc["results"][i]["read_error"] = "CUDARuntimeError: cudaErrorLaunchOutOfResources"
    md = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert "q4_0" not in [r["format"] for r in table_with(md, "kernel / read")]
    assert ("The one-launch read failed (so the formats of these rows have no row above): "
            "q4_0 4096->1024: CUDARuntimeError: cudaErrorLaunchOutOfResources") in md, md
    for r in doc["results"]:   # no read at all: no table, the failure still said
        r.pop("read_us", None)
        r.pop("read_us_pdl", None)
        r["read_error"] = "boom" if r["m"] == 1 else None
    doc["results"] = [{k: v for k, v in r.items() if v is not None} for r in doc["results"]]
    md = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert "kernel / read" not in md and "The one-launch read failed: " in md and "boom" in md
    doc["results"][i]["read_error"] = 3
    with pytest.raises(ValueError, match=r"results\[%d\] \(q4_0 4096->1024 M=1\): read_error = 3 is not a string" % i):
        checks.check_kernels_bench(doc, "bench")


def test_a_timed_kernel_that_computed_garbage_is_said_to_have(errors):
    """The bench checks the output of each kernel it times against x @ W.T (its row's nmse, or
    nmse_error where the output held NaN or inf); the report never read either, so the time of
    a kernel that wrote NaN or the wrong product stood in its tables as a speed like any other."""
    doc = fixture_doc()
    clean = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert "did not compute the product" not in clean
    i, j = row_index(doc, "q4_0", 4096, 1024, 16), row_index(doc, "awq", 4096, 4096, 1)
    del doc["results"][i]["nmse"]
    doc["results"][i]["nmse_error"] = "NMSE is nan (1024 non-finite outputs)"
    doc["results"][j]["nmse"] = 1.3   # (a wrong product: 130 %, the ceiling is 1.2 %)
    k = row_index(doc, "q8_0", 4096, 1024, 1)
    doc["results"][k]["nmse"] = 1.9 * formats.get("q8_0").nmse_ceiling   # (within twice its ceiling: not said)
    md = report.render(report.build(doc, None, accuracy=False, errors=errors))
    assert ("**Rows whose timed kernel did not compute the product** (the bench's check of each timed "
            "kernel's output against x @ W.T in fp32 with the unquantized W): awq 4096->4096 M=1: NMSE 130 % "
            "(over twice the format's ceiling, 1.2 %); q4_0 4096->1024 M=16: NMSE is nan (1024 non-finite "
            "outputs).") in md, md
    assert "q8_0 4096->1024" not in md
    for v, shown in ((float("nan"), "NaN"), (-0.1, "-0.1"), ("0.1", '"0.1"')):
        doc["results"][j]["nmse"] = v
        with pytest.raises(ValueError, match=r"results\[%d\] \(awq 4096->4096 M=1\): nmse = %s is not a "
                                             r"non-negative number" % (j, re.escape(shown))):
            checks.check_kernels_bench(doc, "bench")
