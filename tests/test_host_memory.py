"""The CPU runner's float32 placement, counted before it happens (quantzoo/model/host_memory.py):
the count against what a placed model actually allocated, and a one-line refusal where it would
not fit, from the API and the CLI."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers_models as H
from quantzoo.bench.model import make_config, synthetic_weights
from quantzoo.formats import QuantizedTensor
from quantzoo.model import build_model, host_memory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pairs(cfg, w):
    emb = "model.embed_tokens.weight"
    return [(w[n], n == emb) for n in cfg.expected_shapes()] + ([(w[emb], False)] if cfg.tie_word_embeddings else [])


def _source_ptrs(w) -> set:
    ptrs = set()
    for t in w.values():
        data = t.data if isinstance(t, QuantizedTensor) else t
        for d in (data.values() if isinstance(data, dict) else [data]):
            ptrs.add(torch.as_tensor(d).data_ptr())
    return ptrs


def _allocated(m, w) -> int:
    """Bytes of the placed model's float tensors (linears, embedding table) that are not the
    source's own memory: what placing it allocated."""
    src = _source_ptrs(w)
    held = [ln.w for ln in m._all_linears() if ln.w is not None]
    held += [m.embed.table] if m.embed.table is not None else []
    seen, total = set(), 0
    for t in held:
        if t.data_ptr() not in src and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


@pytest.mark.parametrize("fmt", ["q4_0", "awq", "fp16"])
@pytest.mark.parametrize("mode", ["cached", "dequant"])
def test_counted_bytes_are_what_placing_allocates(fmt, mode):
    """cpu_placement_bytes equals the float32 bytes a placed model holds outside its source
    weights: every quantized linear's copy in "cached" mode (awq: its fp16 lm_head too), none in
    "dequant" (the floats here are float32 already); the q4_0 embedding stays packed."""
    cfg = make_config(2, tiny=True)
    w = synthetic_weights(fmt, cfg, "cpu")
    m = build_model(cfg, w, None, device="cpu", matmul_mode=mode)
    counted = host_memory.cpu_placement_bytes(_pairs(cfg, w), mode)
    assert counted == _allocated(m, w)
    assert (counted > 0) == (mode == "cached")


def test_fp16_floats_and_a_tied_head_are_counted():
    """fp16 float tensors are copied to float32, and a tied lm_head over a quantized table is a
    second, dequantized copy: both counted, as the placed model holds them."""
    from quantzoo.bench.model import random_weight

    cfg = make_config(1, tiny=True)
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    w = synthetic_weights("q8_0", cfg, "cpu")
    del w["lm_head.weight"]
    w["model.embed_tokens.weight"] = random_weight("q8_0", cfg.vocab_size, cfg.hidden_size, "cpu",
                                                   torch.Generator().manual_seed(1))
    for n in [n for n in w if n.endswith("norm.weight")]:
        w[n] = w[n].half()
    m = build_model(cfg, w, None, device="cpu")
    counted = host_memory.cpu_placement_bytes(_pairs(cfg, w), "cached")
    norms = sum(4 * t.numel() for n, t in w.items() if n.endswith("norm.weight"))
    assert counted == _allocated(m, w) + norms
    assert counted >= 4 * cfg.vocab_size * cfg.hidden_size   # the tied head's copy


def test_available_bytes_reads_this_machine():
    avail = host_memory.available_bytes()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert avail is not None and 0 < avail <= total


def test_a_model_past_the_memory_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """Placing more than is available raises MemoryError naming both sizes and the mode that
    needs less -- before any float32 copy is made -- and `run model` prints it as one line
    (exit 2); matmul_mode="dequant" then fits."""
    cfg = make_config(1, tiny=True)
    w = synthetic_weights("q4_0", cfg, "cpu")
    need = host_memory.cpu_placement_bytes(_pairs(cfg, w), "cached")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need - 1)
    mib = f"{need / 2**20:.1f} MiB"
    with pytest.raises(MemoryError, match=rf"the model takes {mib} of float32 on the CPU \(matmul_mode='cached'\), "
                                          rf"{mib} of memory is available; use matmul_mode='dequant'"):
        build_model(cfg, w, None, device="cpu")
    build_model(cfg, w, None, device="cpu", matmul_mode="dequant")

    from quantzoo.cli import main

    path, _, _ = H.make_model_dir("qwen3-gqa-hd64-tied", tmp_path, dtype="float16")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1)
    capsys.readouterr()
    assert main(["run", "model", "--model", str(path), "--device", "cpu", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.rsplit("\r", 1)[-1].strip()   # after the cleared load progress bar
    assert err.startswith("quantzoo run: error: the model takes") and "\n" not in err, err
