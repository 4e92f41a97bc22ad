"""Compile tier: every cuda/ source builds with nvcc for sm_80, sm_89 and sm_90.

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


def _sources() -> dict:
    out: dict[str, set] = {}
    for info in pkgutil.iter_modules(quantzoo.kernels.__path__):
        mod = importlib.import_module(f"quantzoo.kernels.{info.name}")
        for src, exprs in getattr(mod, "SOURCES", {}).items():
            out.setdefault(src, set()).update(exprs)
    return out


SOURCES = _sources()
ALL_CU = sorted(p.name for p in source_dir().iterdir() if p.name.endswith(".cu"))


def test_every_cuda_file_is_declared():
    """A .cu file no kernel module declares would never be compiled by CI or used."""
    assert sorted(SOURCES) == ALL_CU


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", ALL_CU)
def test_nvcc_compiles(src, arch, tmp_path):
    refs = ",\n".join(f"  (const void*)&{e}" for e in sorted(SOURCES[src]))
    tu = tmp_path / "tu.cu"
    tu.write_text(f'#include "{source_dir() / src}"\n'
                  f"__device__ const void* quantzoo_instances[] = {{\n{refs}\n}};\n")
    cmd = ["nvcc", "-std=c++17", f"-arch={arch}", f"-I{source_dir()}", "--cubin",
           "-Werror", "all-warnings", "-o", str(tmp_path / "out.cubin"), str(tu)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{src} for {arch}:\n{r.stderr[-4000:]}"
