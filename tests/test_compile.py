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
