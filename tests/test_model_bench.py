"""`quantzoo bench model` on CPU with a tiny shape: the harness runs end to end, every format
builds a valid random model (the bytes decode to finite weights), and the JSON holds numbers.
The real measurement (Qwen3-8B shape, CUDA graphs) runs on the GPU: bench/notes-runner.md."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quantzoo.formats import get, names


STORED = [n for n in names() if get(n).kind != "activation"]


@pytest.mark.parametrize("fmt", STORED)
def test_random_weights_are_valid(fmt):
    """Every stored format of the registry (the list was written out, and a format of no GGUF
    block layout was taken for one: an AttributeError on has_min)."""
    from quantzoo.bench.model import model_bytes, make_config, random_weight

    g = torch.Generator().manual_seed(0)
    qt = random_weight(fmt, 64, 256, "cpu", g, group_size=64)
    assert qt.format == fmt and qt.shape == (64, 256)
    w = qt.dequantize()
    assert w.shape == (64, 256) and np.isfinite(w).all() and 0 < np.abs(w).max() < 1
    assert w.std() > 1e-3   # not constant
    cfg = make_config(1, tiny=True)
    assert model_bytes(fmt, cfg, "cuda", 16)[0] > 0


def test_bench_model_cpu_smoke(tmp_path, capsys):
    from quantzoo.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--layers", "1", "--formats",
                 "q4_0,fp16", "--prompt-lens", "32", "--decode-tokens", "4", "--eager-tokens", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert [r["format"] for r in res] == ["q4_0", "fp16"]
    for r in res:
        assert "error" not in r, r
        assert r["decode_tok_s_eager"] > 0 and r["prefill_tok_s_32"] > 0
        assert r["formats"]["q_proj"] == r["format"] and r["weight_bytes"] > 0
    sbs = doc["prefill_side_by_side"]   # both models at once, round-robin
    assert sbs["reps"] == 7 and set(sbs["tok_s"]) == {"q4_0", "fp16"}
    assert sbs["tok_s"]["q4_0"]["32"] > 0 and sbs["x_fp16"]["fp16"]["32"] == 1.0
    assert "partial" not in doc   # the last write is the whole run
    cap = capsys.readouterr()
    assert "prefill 32" in cap.out and "timed round-robin" in cap.out
    assert "== q4_0: decode_tok_s_eager" in cap.err   # each format's figures as it finishes
    assert "A tiny smoke-test model (1 layers, hidden 256" in cap.out and "Qwen3-8B-shaped" not in cap.out
    assert "llama.cpp" not in cap.out   # (its H100 Qwen3-8B figures: beside a run of that shape only)
    # a report of it says so too (it passed as a GPU bench of the real shape)
    assert main(["report", "--model-bench", str(out), "--no-bench", "--no-accuracy", "--no-plots",
                 "--out", str(tmp_path / "r.md")]) == 0
    assert "**Not the Qwen3-8B shape**" in (tmp_path / "r.md").read_text()


def test_bench_model_long_context_out_of_range(capsys):
    from quantzoo.cli import main

    assert main(["bench", "model", "--tiny", "--device", "cpu", "--long-context", "5000"]) == 2
    assert "--long-context 5000: 0 (skip) up to 3960" in capsys.readouterr().err


@pytest.mark.parametrize("layers", ["0", "-2"])
def test_bench_model_layers_out_of_range(capsys, layers):
    """It was refused as "num_layers=0", a field of the model's config, not a flag."""
    from quantzoo.cli import main

    assert main(["bench", "model", "--tiny", "--device", "cpu", "--layers", layers]) == 2
    assert capsys.readouterr().err.strip() == f"quantzoo bench: error: --layers {layers}: at least 1"


def test_bench_model_eager_tokens_fit_the_cache(tmp_path, capsys):
    """The short decode's KV cache was sized from --decode-tokens alone: more --eager-tokens than
    that (here 300 against a 256-position cache) failed every format mid-run with 'position 256
    is not in the KV cache', after its graph decode had been timed."""
    from quantzoo.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--layers", "1", "--formats", "fp16",
                 "--prompt-lens", "", "--decode-tokens", "4", "--eager-tokens", "300", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert "error" not in r and r["decode_tok_s_eager"] > 0 and r["decode_cache_positions"] == 512
    capsys.readouterr()
    # too many for the model's positions: one clear error naming the flag (it used to blame
    # --long-context, which the user had not given, or fail each format in setup_cache)
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--decode-tokens", "4080"]) == 2
    assert "--decode-tokens 4080 / --eager-tokens 32" in capsys.readouterr().err
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--decode-tokens", "5000"]) == 2
    err = capsys.readouterr().err
    assert "--decode-tokens 5000" in err and "--long-context" not in err


def test_bench_model_refuses_a_device_it_has_no_path_for(monkeypatch, capsys):
    from quantzoo.bench import model as bm
    from quantzoo.cli import main

    monkeypatch.setattr(bm, "bench_format", lambda *a: pytest.fail("benched on a refused device"))
    for dev, needle in (("meta", "device='meta': the runner runs on cpu, cuda or cuda:N, not on meta"),
                        ("", "device='': not a torch device (cpu, cuda, cuda:N)")):
        assert main(["bench", "model", "--tiny", "--device", dev]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("quantzoo bench: error: --device: ") and needle in err and "\n" not in err, err


@pytest.mark.parametrize("names", ["q4_0,q8_1", "q4_0, q8_1"])   # (with a space: "unknown format ' q8_1'")
def test_bench_model_refuses_an_activation_format(capsys, names):
    from quantzoo.cli import main

    assert main(["bench", "model", "--tiny", "--device", "cpu", "--formats", names]) == 2
    assert "--formats: 'q8_1' is an activation format, not a weight format" in capsys.readouterr().err


def test_bench_model_json_keeps_finished_formats(tmp_path, monkeypatch):
    """A run cut short (here: interrupted in its second format) leaves the finished formats in the
    JSON, marked partial."""
    from quantzoo.bench import model as bm
    from quantzoo.cli import main

    calls = []

    def fake(fmt, *a):
        calls.append(fmt)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return {"format": fmt, "decode_tok_s_eager": 12.5}

    monkeypatch.setattr(bm, "bench_format", fake)
    out = tmp_path / "bench.json"
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--layers", "1", "--formats", "q4_0,fp16",
                 "--prompt-lens", "", "--json", str(out)]) == 130   # (Ctrl-C: 128 + SIGINT, no traceback)
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["results"] == [{"format": "q4_0", "decode_tok_s_eager": 12.5}]


def test_bench_model_takes_a_cpu_index_as_the_cpu(tmp_path, monkeypatch):
    """--device cpu:1 benches on the CPU as "cpu" (its random weights were built as for a GPU,
    in float16 torch tensors, with the CPU paths skipped)."""
    from quantzoo.bench import model as bm
    from quantzoo.cli import main

    seen = []
    monkeypatch.setattr(bm, "bench_format", lambda fmt, cfg, args, device, bw: seen.append(device) or {"format": fmt})
    monkeypatch.setattr(bm, "render", lambda out, args: "")
    out = tmp_path / "b.json"
    assert main(["bench", "model", "--tiny", "--device", "cpu:1", "--formats", "q4_0", "--prompt-lens", "",
                 "--json", str(out)]) == 0
    assert seen == ["cpu"] and json.loads(out.read_text())["device"] == "cpu"


def test_bench_model_refuses_what_it_would_ignore_or_cannot_hold(monkeypatch, capsys):
    """--awq-group-size without awq and --long-context on the CPU (it times the CUDA graph) were
    ignored; a format named twice was benched twice (and shown twice by `quantzoo report`);
    --layers 1000000 allocated until the OOM killer ended the process."""
    from quantzoo.bench import model as bm
    from quantzoo.cli import main
    from quantzoo.model import host_memory

    groups = []
    monkeypatch.setattr(bm, "bench_format", lambda f, cfg, args, *a: groups.append(args.awq_group_size)
                        or {"format": f, "weight_bytes": 1, "decode_tok_s_eager": 1.0})
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**30)
    for args, needle in (
            (["--formats", "q4_0", "--awq-group-size", "64"], "--awq-group-size 64: no AWQ format in --formats q4_0"),
            (["--formats", "q4_0,fp16,q4_0"], "--formats q4_0,fp16,q4_0: q4_0 named twice"),
            (["--long-context", "100"], "--long-context 100: it times the graph decode, which runs on CUDA only"),
            (["--layers", "1000000"], "--layers 1000000: the fp16 model takes 3295.9 GiB of weights and 244.1 GiB "
                                      "of KV cache (256 positions) on cpu, where 1.0 GiB is free")):
        assert main(["bench", "model", "--tiny", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"quantzoo bench: error: {needle}", err
    assert groups == []
    assert main(["bench", "model", "--tiny", "--device", "cpu", "--formats", "awq", "--awq-group-size", "64",
                 "--prompt-lens", ""]) == 0
    assert groups == [64]
    # every format's model at once (the round-robin prefill): skipped where they do not fit together
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)
    got = bm.prefill_side_by_side(["q4_0", "fp16"], bm.make_config(1, True), None, "cpu", [32])
    assert got == {"skipped": "the formats' models do not fit in memory together"}
