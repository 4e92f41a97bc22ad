"""Compile tier: every cuda/ source builds with nvcc for sm_80, sm_89 and sm_90, and the
Hopper-specific ones (a kernel module's ARCH_SPECIFIC) also for sm_90a, where their wgmma
bodies are compiled.

CuPy compiles at run time and needs a GPU driver, so CI (no GPU, nvcc present) compiles with
nvcc instead. Each kernel module in quantzoo.kernels declares SOURCES = {file: (name
expressions it instantiates)}; the test takes the address of each instance so the very
templates the launcher asks CuPy for are instantiated and compiled here.
"""
from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess

import pytest

import quantzoo.kernels
from quantzoo.cuda_launch import source_dir

ARCHS = ("sm_80", "sm_89", "sm_90")


def _sources() -> tuple[dict, set]:
    out: dict[str, set] = {}
    specific: set = set()
    for info in pkgutil.iter_modules(quantzoo.kernels.__path__):
        mod = importlib.import_module(f"quantzoo.kernels.{info.name}")
        for src, exprs in getattr(mod, "SOURCES", {}).items():
            out.setdefault(src, set()).update(exprs)
        specific |= set(getattr(mod, "ARCH_SPECIFIC", ()))
    return out, specific


SOURCES, ARCH_SPECIFIC = _sources()
ALL_CU = sorted(p.name for p in source_dir().iterdir() if p.name.endswith(".cu"))
BUILDS = [(src, arch) for src in ALL_CU for arch in ARCHS] + [(src, "sm_90a") for src in sorted(ARCH_SPECIFIC)]


def test_every_cuda_file_is_declared():
    """A .cu file no kernel module declares would never be compiled by CI or used."""
    assert sorted(SOURCES) == ALL_CU


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src,arch", BUILDS)
def test_nvcc_compiles(src, arch, tmp_path):
    refs = ",\n".join(f"  (const void*)&{e}" for e in sorted(SOURCES[src]))
    tu = tmp_path / "tu.cu"
    tu.write_text(f'#include "{source_dir() / src}"\n'
                  f"__device__ const void* quantzoo_instances[] = {{\n{refs}\n}};\n")
    # nvcc 13.0's -arch=sm_90a shorthand also runs a plain sm_90 pass; -gencode names one target
    target = [f"-gencode=arch=compute_{arch[3:]},code={arch}"] if arch.endswith("a") else [f"-arch={arch}"]
    cmd = ["nvcc", "-std=c++17", *target, f"-I{source_dir()}", "--cubin",
           "-Werror", "all-warnings", "-o", str(tmp_path / "out.cubin"), str(tu)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{src} for {arch}:\n{r.stderr[-4000:]}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_strip_cluster_dims_only_on_cluster_form(tmp_path):
    """awq_strip.cu for sm_90: the cluster form awq_strip_kernel<CLUSTER_WARPS, D, CLUSTER_SIZE>
    carries its cluster dims (.explicitcluster, .reqnctapercluster CLUSTER_SIZE, 1, 1: the launch
    passes none), and the one-block form awq_strip_kernel<STRIP_WARPS, D> none -- a
    __cluster_dims__(1, 1, 1) would make dispatch's 'strip' path an explicit-cluster launch."""
    import re

    from quantzoo.kernels import awq

    src = "awq_strip.cu"
    refs = ",\n".join(f"  (const void*)&{e}" for e in sorted(SOURCES[src]))
    tu = tmp_path / "tu.cu"
    tu.write_text(f'#include "{source_dir() / src}"\n'
                  f"__device__ const void* quantzoo_instances[] = {{\n{refs}\n}};\n")
    ptx = tmp_path / "out.ptx"
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", f"-I{source_dir()}", "--ptx", "-o", str(ptx), str(tu)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    entries = {}
    for m in re.finditer(r"\.entry (_Z16awq_strip_kernelI((?:Li\d+E)+)E\S*)\((.*?)\{", ptx.read_text(), re.S):
        args = tuple(int(a) for a in re.findall(r"Li(\d+)E", m.group(2)))
        head = m.group(3)
        dims = re.search(r"\.reqnctapercluster\s+(\d+),\s*(\d+),\s*(\d+)", head)
        entries[args] = (".explicitcluster" in head, tuple(map(int, dims.groups())) if dims else None)
    want = {}
    for e in SOURCES[src]:
        args = tuple(int(a) for a in re.fullmatch(r"awq_strip_kernel<(\d+), (\d+)(?:, (\d+))?>", e).groups() if a)
        want[args] = (True, (awq.CLUSTER_SIZE, 1, 1)) if len(args) == 3 else (False, None)
    assert entries == want
