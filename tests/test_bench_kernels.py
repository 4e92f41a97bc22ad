"""`quantzoo bench kernels`: argument handling and arithmetic on CPU; end to end on the GPU."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from quantzoo import formats
from quantzoo.bench import kernels, timing

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "bench_kernels_fixture.json")


def test_bench_formats_follow_the_registry():
    names = kernels.bench_formats()
    assert names == [f.name for f in formats.weight_formats()] + ["fp16"]
    assert "q8_1" not in names  # an activation format has no weight kernel to bench
    assert kernels.bench_formats(["fp16", "q4_0"]) == ["q4_0", "fp16"]
    with pytest.raises(KeyError, match="--formats: unknown format 'q3_k'; formats that store weights: awq"):
        kernels.bench_formats(["q3_k"])
    with pytest.raises(ValueError, match="activation format"):
        kernels.bench_formats(["q8_1"])


def test_parse_arguments():
    assert kernels.parse_shape("4096,11008") == (4096, 11008)
    assert kernels.parse_m("1,16,512") == [1, 16, 512]
    for bad in ("4096", "a,b", "0,4096"):
        with pytest.raises(ValueError, match="--shape"):
            kernels.parse_shape(bad)
    for bad in ("", "1,x", "0,4"):
        with pytest.raises(ValueError, match="--m"):
            kernels.parse_m(bad)


def test_metrics_by_hand():
    """4096x4096 q4_0 weight (9,437,184 bytes) at M=1 in 5 us on a 3 TB/s, 700 TFLOP/s card."""
    rec = {"m": 1, "k": 4096, "n": 4096, "median_us": 5.0, "weight_bytes": 9437184}
    m = kernels.metrics(rec, {"copy_tbps": 3.0, "cublas_fp16_tflops": 700.0})
    by = 9437184 + 2 * 4096 + 2 * 4096
    assert m["tflops"] == pytest.approx(2 * 4096 * 4096 / 5e-6 / 1e12)
    assert m["weight_tbps"] == pytest.approx(9437184 / 5e-6 / 1e12)
    assert m["pct_copy_bw"] == pytest.approx(100 * by / 5e-6 / 3e12)
    assert m["roofline_us"] == pytest.approx(by / 3e12 * 1e6)        # memory bound at M=1
    assert m["pct_roofline"] == pytest.approx(100 * by / 3e12 / 5e-6)
    big = kernels.metrics(dict(rec, m=4096, median_us=1000.0), {"copy_tbps": 3.0, "cublas_fp16_tflops": 700.0})
    assert big["roofline_us"] == pytest.approx(2 * 4096 ** 3 / 700e12 * 1e6)  # compute bound


def test_x_cublas_and_outputs(tmp_path):
    with open(FIXTURE) as f:
        res = json.load(f)
    rows = res["results"]
    for r in rows:
        r.pop("x_cublas", None)
    rows.append({"format": "q5_1", "k": 1, "n": 8, "m": 1, "status": "missing", "error": "no module"})
    kernels.add_x_cublas(rows)
    base = {(r["k"], r["n"], r["m"]): r["median_us"] for r in rows if r["format"] == "fp16"}
    for r in rows:
        if r["status"] == "ok":
            assert r["x_cublas"] == pytest.approx(base[(r["k"], r["n"], r["m"])] / r["median_us"])
        else:
            assert r["x_cublas"] is None
    jpath, cpath = kernels.write_outputs(res, str(tmp_path))
    with open(jpath) as f:
        assert json.load(f)["results"][-1]["status"] == "missing"
    with open(cpath) as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == len(rows) and list(recs[0]) == kernels.CSV_FIELDS
    for r in recs[:-1]:
        assert math.isfinite(float(r["median_us"])) and float(r["pct_roofline"]) > 0
    assert recs[-1]["status"] == "missing" and recs[-1]["median_us"] == ""
    assert "missing" in kernels.summary_table(res)


def test_timing_helpers():
    s = timing.summarize([3e-6, 1e-6, 2e-6, 4e-6, 5e-6])
    assert s["median_us"] == pytest.approx(3.0) and s["samples"] == 5
    assert s["p10_us"] == pytest.approx(1.4) and s["p90_us"] == pytest.approx(4.6)
    with pytest.raises(ValueError, match="samples"):
        timing.summarize([])
    l2 = 50 << 20
    assert timing.rotation_copies(9437184, l2_bytes=l2) == math.ceil(4 * l2 / 9437184)
    assert timing.rotation_copies(4 * 100 << 20, l2_bytes=l2) == 2         # a big weight: 2 copies
    assert timing.rotation_copies(1000, l2_bytes=l2) == 4096               # capped
    for n in (62208, 1 << 20, 9437184, 25165824):
        c = timing.rotation_copies(n, l2_bytes=l2)
        assert c * n >= min(4 * l2, 4096 * n)
    info = timing.machine_info()
    for key in ("time_utc", "torch", "numpy", "python", "git_commit", "cupy", "gpu"):
        assert key in info


def test_rotation_exceeds_l2_for_small_weights():
    """A small `--shape` (SmolLM2's 576 -> 192 in q4_0: 62,208 bytes; 576 -> 1536: 497,664) must
    still rotate over copies that L2 cannot hold: with a cap of 128 copies they came to 8 MB and
    61 MB, the first wholly inside the H100's 50 MB L2."""
    l2 = 52428800
    for nbytes in (192 * 576 * 18 // 32, 1536 * 576 * 18 // 32):
        assert timing.rotation_copies(nbytes, l2_bytes=l2) * nbytes >= 4 * l2


def test_nonfinite_nmse_keeps_the_run(tmp_path):
    """A kernel that writes NaN (what the row's NMSE check is there to show) is recorded as such,
    and the JSON is still written: json.dump(allow_nan=False) used to raise at the end of the run,
    losing every row (and the CSV) of a bench that had taken minutes."""
    import torch

    y_ref = torch.ones(2, 8)
    y = y_ref.clone().half()
    y[0, 3] = float("nan")
    got = kernels.nmse_fields(y, y_ref)
    assert got["nmse"] is None and "1 non-finite" in got["nmse_error"]
    assert kernels.nmse_fields(y_ref.half(), y_ref) == {"nmse": 0.0}
    with open(FIXTURE) as f:
        res = json.load(f)
    res["results"][0]["nmse"] = float("nan")
    res["results"][1]["x_cublas"] = float("inf")
    jpath, cpath = kernels.write_outputs(res, str(tmp_path))
    with open(jpath) as f:
        back = json.load(f)
    assert back["results"][0]["nmse"] is None and back["results"][1]["x_cublas"] is None
    assert back["results"][2] == res["results"][2]
    with open(cpath) as f:
        assert len(list(csv.DictReader(f))) == len(res["results"])


def test_awq_bench_graph_covers_every_copy(monkeypatch):
    """bench/awq_bench.py's time_graph captured a fixed 20 calls whatever the number of rotated
    weight copies: at 4096 -> 1024 (69 AWQ copies of 2.18 MB) the graph cycled over the first 20,
    42 MiB, inside the 50 MB L2 the rotation is meant to defeat."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "awq_bench.py")
    spec = importlib.util.spec_from_file_location("awq_bench_under_test", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    seen, captured = [], []

    def capture(fn, inner):
        captured.append(inner)
        for i in range(inner):
            fn(i)
        return object()

    monkeypatch.setattr(ab.timing, "capture_graph", capture)
    monkeypatch.setattr(ab.timing, "time_graph", lambda g, inner, reps, warmup: [1e-6 * inner] * reps)
    k, n = 4096, 1024
    qbytes = k * n // 2 + (k // ab.G) * (n // 8) * 4 + (k // ab.G) * n * 2
    copies = max(2, math.ceil(ab.ROT_BYTES / qbytes))
    ab.time_graph([lambda j=j: seen.append(j) for j in range(copies)])
    assert copies == 69 and set(seen) == set(range(copies))
    assert len(set(seen)) * qbytes > 52428800
    seen.clear()
    ab.time_graph([lambda: seen.append(0)] * 3)   # fewer callables than reps: still 20 calls
    assert captured[-1] == 20 and len(seen) == 20


def test_quantize_all_in_processes():
    got = kernels.quantize_all(["q4_0", "awq", "fp16"], [(256, 64), (96, 64)], seed=3, workers=2)
    w = kernels.gaussian_weight(256, 64, 3)
    for name in ("q4_0", "awq", "fp16"):
        qt, err = got[(name, 256, 64)]
        assert err is None and qt.shape == (64, 256)
        assert (qt.dequantize() == formats.get(name).quantize(w).dequantize()).all()
    qt, err = got[("awq", 96, 64)]  # 96 is not a multiple of the AWQ group size: reported
    assert qt is None and "group_size" in err


def test_bench_cli_without_gpu_or_runner():
    import torch

    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "bench", "kernels", "--quick"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "bench", "kernels", "--m", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--m" in out.stderr
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "bench", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "kernels" in out.stdout and "model" in out.stdout


@pytest.mark.gpu
@pytest.mark.gpu_alone   # its power probe's time bound failed once with 7 other workers on the GPU
def test_bench_kernels_quick_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "quantzoo.cli", "bench", "kernels", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout[-6000:])
    with open(tmp_path / "bench-kernels.json") as f:
        res = json.load(f)
    c = res["ceilings"]
    assert 0.5 < c["copy_tbps"] < 10 and 50 < c["cublas_fp16_tflops"] < 3000
    assert res["machine"]["gpu"] and res["machine"]["cupy"]
    names = kernels.bench_formats()
    assert len(res["results"]) == len(names) * len(kernels.QWEN3_8B_SHAPES) * len(kernels.QUICK_M)
    assert {r["format"] for r in res["results"]} == set(names)
    ok = [r for r in res["results"] if r["status"] == "ok"]
    assert {r["format"] for r in ok} == set(names)   # (a kernel module that fails to import: 'missing')
    for r in ok:
        for key in ("median_us", "tflops", "weight_tbps", "pct_copy_bw", "pct_roofline", "x_cublas"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["format"], key, r[key])
        assert math.isfinite(r["nmse"]) and r["nmse"] >= 0, r
        assert r["pct_copy_bw"] < 150, r      # > 100 % would mean the weight came from L2
        if r["m"] == 1:   # timed a second time under programmatic dependent launch (decode's way)
            assert 0 < r["median_us_pdl"] < 3 * r["median_us"], r
        # the kernel timed computes the format's function: NMSE vs fp32 near the format's error
        assert r["nmse"] < max(4 * formats.get(r["format"]).nmse_ceiling, 1e-5), r
    for r in res["results"]:
        assert r["status"] in ("ok", "missing"), r  # kernels that exist must not fail
    # the power probe: the largest shape at M in POWER_M, sampled by nvidia-smi (on the machine)
    k, n = res["settings"]["power"]["shape"]
    probed = [r for r in ok if (r["k"], r["n"]) == (k, n) and r["m"] in kernels.POWER_M]
    assert probed
    for r in probed:
        assert "power_error" not in r, r
        assert 100 < r["sm_clock_mhz"] < 3000 and 20 < r["power_w"] < 2000 and 0 <= r["power_capped"] <= 1, r
        assert r["power_limit_w"] is None or r["power_w"] < 1.2 * r["power_limit_w"], r
        assert 0.5 * r["median_us"] < r["sustained_us"] < 3 * r["median_us"], r
        assert r["mj_per_call"] == pytest.approx(r["power_w"] * r["sustained_us"] * 1e-3)


def test_sanitize_paths_without_a_gpu_is_one_line():
    """README's `compute-sanitizer ... python3 bench/sanitize_paths.py` on a machine without a GPU:
    it ended in a traceback from its first QuantizedTensor.to("cuda")."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script runs")
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "sanitize_paths.py")
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip() == "bench/sanitize_paths.py: needs a CUDA GPU (torch sees none here)", out.stderr


@pytest.mark.parametrize("argv,said", [
    (["0", "q4_0", "runners"], "part 'runners': expected one of ['matmul', 'layer_ops', 'runner']"),
    (["0", "q4_00"], "format 'q4_00': expected one of"),
    (["0", "fp16", "runner"], "formats ['fp16'] with parts ['runner'] check nothing"),
])
def test_sanitize_paths_refuses_a_run_that_checks_nothing(argv, said):
    """A part or format name it does not know, or a choice that leaves nothing to run (fp16 has no
    runner check): it ran nothing, printed "0 wrong" and exited 0 -- under compute-sanitizer a
    clean report of nothing. Said by name, on any machine (before the GPU's check)."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "sanitize_paths.py")
    out = subprocess.run([sys.executable, path, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "0 wrong" not in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.strip().startswith(f"bench/sanitize_paths.py: {said}"), out.stderr
