"""The CPU runner's float32 placement, counted before it happens (quantzoo/model/host_memory.py):
the count against what a placed model actually holds, the cgroup reader on v1 / v2 trees, and a
one-line refusal where a model would not fit, from the API and the CLI."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import helpers_models as H
from quantzoo.bench.model import make_config, random_weight, synthetic_weights
from quantzoo.formats import QuantizedTensor
from quantzoo.model import build_model, host_memory
from quantzoo.model.llm import _placement

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _arrays(t):
    return [torch.as_tensor(a) for a in (t.arrays().values() if isinstance(t, QuantizedTensor) else [t])]


def _held(m, w) -> int:
    """Bytes of every tensor the placed model holds -- linears (float or packed), the embedding
    table, every norm -- that are not its source weights' own memory: what placing allocated."""
    src = {a.data_ptr() for t in w.values() for a in _arrays(t)}
    held = [m.embed.table, m.norm] + (_arrays(m.embed.qt) if m.embed.qt is not None else [])
    for ln in m._all_linears():
        held += [ln.w] if ln.w is not None else _arrays(ln.qt)
    for layer in m.layers:
        held += [t for t in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm) if t is not None]
    seen, total = set(), 0
    for t in (torch.as_tensor(t) for t in held if t is not None):
        if t.data_ptr() not in src and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


def _model(fmt, mode, fuse=False, fp16_floats=False, tied_q8_table=False):
    cfg = make_config(2, tiny=True)
    if tied_q8_table:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    w = synthetic_weights(fmt, cfg, "cpu")
    if tied_q8_table:   # a block-format table: looked up packed, and a dequantized head beside it
        del w["lm_head.weight"]
        w["model.embed_tokens.weight"] = random_weight("q8_0", cfg.vocab_size, cfg.hidden_size, "cpu",
                                                       torch.Generator().manual_seed(1))
    if fp16_floats:   # as a GGUF's F16 norms / an fp16 HF checkpoint: numpy fp16, copied to float32
        w = {n: t.numpy().astype(np.float16) if torch.is_tensor(t) else t for n, t in w.items()}
    m = build_model(cfg, w, None, device="cpu", matmul_mode=mode, fuse=fuse)
    return cfg, w, m


CASES = [("q4_0", "cached", {}), ("q4_0", "dequant", {}), ("awq", "cached", {}), ("awq", "dequant", {}),
         ("fp16", "cached", {}), ("q8_0", "cached", {"fp16_floats": True}),
         ("q4_0", "cached", {"tied_q8_table": True}), ("q4_0", "dequant", {"tied_q8_table": True}),
         ("q4_0", "dequant", {"fuse": True}), ("fp16", "cached", {"fuse": True}),
         ("q4_1", "emulate", {"fuse": True, "fp16_floats": True})]


@pytest.mark.parametrize("fmt,mode,kw", CASES, ids=str)
def test_held_bytes_are_what_placing_allocates(fmt, mode, kw):
    """cpu_placement_bytes' held count equals what the placed model holds outside its source's
    memory, measured on the model: float32 copies of quantized linears ("cached"; awq's fp16
    lm_head too), none in "dequant" / "emulate", float32 copies of fp16 floats, the packed
    block table left as it is and its tied head dequantized, fused q/k/v and gate/up as new
    tensors (packed where the linear keeps them packed)."""
    cfg, w, m = _model(fmt, mode, **kw)
    held, transient = host_memory.cpu_placement_bytes(_placement(cfg, w, kw.get("fuse", False)), mode)
    assert held == _held(m, w)
    assert transient > 0   # every case dequantizes some weight, at load or per call


def _tree(root, proc_cgroup, files):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def test_cgroup_headroom_reads_v1_and_v2_trees(tmp_path):
    """The smallest limit - (usage - inactive file pages) over every level of the process's
    memory cgroup, v2 (nested, no cgroup namespace: the root's memory.max absent) and v1;
    unlimited levels ("max", v1's 2^63 - 4096) skipped; None with no limit or no file."""
    v2 = _tree(tmp_path / "v2", "0::/user.slice/job.scope\n", {
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/memory.current": "5000000000\n",
        "sys/fs/cgroup/user.slice/job.scope/memory.max": "8000000000\n",
        "sys/fs/cgroup/user.slice/job.scope/memory.current": "3000000000\n",
        "sys/fs/cgroup/user.slice/job.scope/memory.stat": "anon 1000000000\ninactive_file 1500000000\nfile 2000000000\n",
    })
    assert host_memory.cgroup_headroom(v2) == 8_000_000_000 - (3_000_000_000 - 1_500_000_000)
    v1 = _tree(tmp_path / "v1", "12:pids:/x\n11:memory:/jobs/7\n1:name=systemd:/x\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(2**63 - 4096),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": "9000000000",
        "sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": "6000000000",
        "sys/fs/cgroup/memory/jobs/memory.usage_in_bytes": "5000000000",
        "sys/fs/cgroup/memory/jobs/7/memory.limit_in_bytes": "4000000000",
        "sys/fs/cgroup/memory/jobs/7/memory.usage_in_bytes": "1000000000",
        "sys/fs/cgroup/memory/jobs/7/memory.stat": "cache 5\ntotal_inactive_file 400000000\n",
    })
    assert host_memory.cgroup_headroom(v1) == min(6_000_000_000 - 5_000_000_000, 4_000_000_000 - 600_000_000)
    assert host_memory.cgroup_headroom(_tree(tmp_path / "none", "0::/\n", {
        "sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "7\n"})) is None
    assert host_memory.cgroup_headroom(str(tmp_path / "missing")) is None


def test_available_bytes_reads_this_machine():
    total = host_memory._stat("/proc/meminfo", "MemTotal:")
    if total is None:
        pytest.skip("no /proc/meminfo (not Linux): the check is skipped there")
    total *= 1024
    assert host_memory.available_bytes() <= total


def test_a_model_past_the_memory_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """Placing more than is available raises MemoryError naming the sizes and the mode that needs
    less -- before any float32 copy is made -- and `run model` prints it as one line (exit 2);
    matmul_mode="dequant" then fits."""
    cfg = make_config(1, tiny=True)
    w = synthetic_weights("q4_0", cfg, "cpu")
    held, transient = host_memory.cpu_placement_bytes(_placement(cfg, w, False), "cached")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: held + transient - 1)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    with pytest.raises(MemoryError, match=rf"the model takes {mib(held)} of float32 on the CPU \(matmul_mode='cached'\) "
                                          rf"and {mib(transient)} more while dequantizing its largest weight; "
                                          rf"{mib(held + transient - 1)} of memory is available; use matmul_mode='dequant'"):
        build_model(cfg, w, None, device="cpu")
    with pytest.raises(MemoryError, match="the model takes"):   # a cpu index is the CPU (it skipped the check)
        build_model(cfg, w, None, device="cpu:1")
    build_model(cfg, w, None, device="cpu", matmul_mode="dequant")

    from quantzoo.cli import main

    path, _, _ = H.make_model_dir("qwen3-gqa-hd64-tied", tmp_path, dtype="float16")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1)
    capsys.readouterr()
    assert main(["run", "model", "--model", str(path), "--device", "cpu", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.rsplit("\r", 1)[-1].strip()   # after the cleared load progress bar
    assert err.startswith("quantzoo run: error: the model takes") and "\n" not in err, err
    assert err.endswith("use a GPU"), err   # an fp16 checkpoint: its float32 copies whatever the mode


def test_a_kv_cache_past_the_memory_is_refused_in_one_line(monkeypatch):
    """A long generation's KV cache was allocated blindly: torch's allocator traceback (100 GB
    asked), or the OOM killer. Now counted first (2 x layers x kv heads x positions x head_dim x
    4 bytes on the CPU) and refused in one line; the model stays usable."""
    from quantzoo.bench.model import synthetic_model

    cfg = dataclasses.replace(make_config(2, tiny=True), max_position=1 << 20)
    m = synthetic_model("q8_0", cfg, "cpu")
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000 * per_position)
    m.generate([1, 2, 3], max_new_tokens=4)   # a cache of 256 positions fits
    with pytest.raises(MemoryError, match=rf"a KV cache for 4352 positions takes {4352 * per_position / 2**20:.1f} MiB;"
                                          r" \S+ MiB of memory is available on cpu \(ask for fewer tokens"):
        m.generate([1, 2, 3], max_new_tokens=4100)
    assert len(m.generate([1, 2, 3], max_new_tokens=4)) == 4
