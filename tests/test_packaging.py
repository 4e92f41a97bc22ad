"""The installed layout: everything under the quantzoo namespace, CUDA sources shipped."""
import importlib.util
from pathlib import Path

import quantzoo
import quantzoo.cuda
import quantzoo.formats
import quantzoo.reference
from quantzoo.cuda_launch import source_dir

REPO = Path(__file__).resolve().parents[1]


def test_namespaced_subpackages():
    assert quantzoo.formats.__name__ == "quantzoo.formats"
    assert quantzoo.reference.__name__ == "quantzoo.reference"
    assert Path(quantzoo.formats.__file__).parent.name == "formats"


def test_no_bare_top_level_packages():
    """`import formats` must not resolve to anything installed (site-packages stays clean)."""
    for top in ("formats", "reference", "cuda"):
        spec = importlib.util.find_spec(top)
        if spec is not None:   # only the source checkout itself may provide it (cwd on sys.path)
            locs = list(spec.submodule_search_locations or [spec.origin])
            assert all(Path(p).resolve().parent == REPO for p in locs), (top, locs)


def test_cuda_sources_ship():
    shipped = sorted(p.name for p in source_dir().iterdir() if p.name.endswith((".cu", ".cuh")))
    in_repo = sorted(p.name for p in (REPO / "cuda").iterdir() if p.name.endswith((".cu", ".cuh")))
    assert shipped == in_repo


def test_kernels_md_line_counts():
    """docs/kernels.md's reading guide gives some files' lengths ("`cuda/awq_small.cu`** (407
    lines)"); they are the files' own (awq_small.cu had grown to 409)."""
    import re

    text = (REPO / "docs" / "kernels.md").read_text(encoding="utf-8")
    cited = re.findall(r"`(cuda/[\w.]+)`\**\s+\((\d+) lines\)", text)
    assert len(cited) >= 4, cited
    for path, n in cited:
        assert len((REPO / path).read_text(encoding="utf-8").splitlines()) == int(n), path
