"""The report's accuracy section on CPU: the default SmolLM2 model in two formats, a short text."""
import math

import pytest


@pytest.fixture(scope="module")
def result(default_model_file):
    from quantzoo.report import accuracy

    text = accuracy.english_text()[:400]
    return accuracy.accuracy(["q8_0", "q4_0"], text=text, max_tokens=64)


@pytest.mark.slow
def test_kl_and_top1_on_the_default_model(result):
    assert result["arch"] == "llama" and result["layers"] == 30 and result["hidden"] == 576
    assert 40 <= result["tokens"] <= 64
    ref = result["reference"]
    assert ref["top1"] == 1.0 and ref["kl_mean"] == 0.0
    assert 1.5 < ref["ppl"] < 200  # a real language model on English text, not noise (~49k vocab)
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows) == {"q8_0", "q4_0"}
    for r in rows.values():
        for k in ("top1", "kl_mean", "kl_max", "ppl"):
            assert math.isfinite(r[k]), (r["format"], k)
        assert 0 <= r["top1"] <= 1 and 0 < r["kl_mean"] <= r["kl_max"]
        assert r["embedding"] == r["format"]  # GGUF formats store the tied embedding too
    # 8-bit is close to fp16, 4-bit measurably further (seen on the full text: KL 0.0012 vs 0.38)
    assert rows["q8_0"]["kl_mean"] < 0.02 and rows["q8_0"]["top1"] >= 0.9
    assert rows["q4_0"]["kl_mean"] > 5 * rows["q8_0"]["kl_mean"]
    assert rows["q4_0"]["ppl"] > rows["q8_0"]["ppl"] * 0.98


@pytest.mark.slow
def test_accuracy_section_renders(result):
    from quantzoo import report

    rep = {"kind": "quantzoo-report", "generated_utc": "now", "quantzoo": "0", "git_commit": None,
           "command": None, "formats": [], "bench": None, "speed": None, "model_bench": None,
           "accuracy": result}
    md = report.render(rep)
    assert "## Accuracy on a real model" in md
    line = next(l for l in md.splitlines() if l.startswith("| q4_0"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[3]) == pytest.approx(100 * result["rows"][1]["top1"], abs=0.06)
    assert float(cells[4]) == pytest.approx(result["rows"][1]["kl_mean"], abs=6e-5)


def test_awq_group_size_for_smollm2_dims():
    """576 = 4.5 x 128: AWQ must fall back to group 64 (DESIGN.md section 5)."""
    from quantzoo.model.config import ModelConfig
    from quantzoo.report.accuracy import awq_group_size

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_layers=1,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                      max_position=64, tie_word_embeddings=True, qk_norm=False)
    assert awq_group_size(cfg) == 64
    cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads = 1024, 16, 4
    assert awq_group_size(cfg) == 128


def test_accuracy_takes_no_more_tokens_than_the_context(tmp_path):
    """The report's accuracy run cuts its text at the model's context (it built a model one
    position longer than the text, past the context for a long text)."""
    import helpers_models as H
    from quantzoo.report import accuracy

    src, _, _ = H.make_model_dir("qwen3-gqa-hd64-tied", tmp_path)
    r = accuracy.accuracy(["q8_0"], path=src, text="ab cd " * 400, max_tokens=100_000)
    assert r["tokens"] == 512 and r["rows"][0]["top1"] > 0.5


def test_compare_on_hand_made_distributions():
    """compare()'s numbers on distributions worked out by hand: KL is KL(ref || this) (0.5108
    here; the other direction would read 0.3681), top-1 counts argmax agreements, perplexity is
    exp of the mean negative log-probability of each next id."""
    import torch

    from quantzoo.report.accuracy import compare

    ref = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]], dtype=torch.float64).log()
    this = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4]], dtype=torch.float64).log()
    ids = [0, 1, 0]
    r = compare(ref, this, ids)
    kl0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl2 = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    assert r["kl_max"] == pytest.approx(kl0, abs=1e-12) and kl0 == pytest.approx(0.5108, abs=1e-4)
    assert r["kl_mean"] == pytest.approx((kl0 + 0 + kl2) / 3, abs=1e-12)
    # rows 0 (ref's tie goes to index 0, as does this) and 1 agree; row 2 does not
    assert r["top1"] == pytest.approx(2 / 3)
    # next ids 1 (from row 0: p 0.1) and 0 (from row 1: p 0.9)
    assert r["ppl"] == pytest.approx(math.exp(-(math.log(0.1) + math.log(0.9)) / 2), rel=1e-12)


def test_convert_stores_what_the_gguf_export_stores():
    """A weight whose in_features is not whole blocks is F16 in a GGUF export (llama.cpp's
    fallback): the accuracy section's conversion keeps it so, and says so, where it had called
    the format's quantize on it and failed."""
    import numpy as np

    from quantzoo.report.accuracy import convert

    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(np.float16).astype(np.float32) for n, s in (
        ("model.embed_tokens.weight", (100, 64)), ("model.layers.0.mlp.up_proj.weight", (200, 64)),
        ("model.layers.0.mlp.down_proj.weight", (64, 200)), ("model.norm.weight", (64,)))}
    out, info = convert(w, None, "q4_0")
    down, up = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(out[down], w[down]) and not np.array_equal(out[up], w[up])
    assert info == {"linears": "q4_0 (1 F16: in_features not whole blocks)", "embedding": "q4_0"}
    # hidden 80: the embedding is the F16 one, and its column says fp16 (the linears' does not)
    w = {n: rng.standard_normal(s).astype(np.float16).astype(np.float32) for n, s in (
        ("model.embed_tokens.weight", (100, 80)), ("model.layers.0.mlp.down_proj.weight", (80, 64)))}
    out, info = convert(w, None, "q8_0")
    emb = "model.embed_tokens.weight"
    assert np.array_equal(out[emb], w[emb]) and not np.array_equal(out[down], w[down])
    assert info == {"linears": "q8_0", "embedding": "fp16"}
