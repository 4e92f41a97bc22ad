#!/usr/bin/env bash
# One call on the lent GPU machine: install carried wheels (gguf) and the project (no deps:
# the machine has torch/CuPy), run the GPU tier, then whatever bench commands follow.
#   bash bench/gpu_run.sh "<pytest args>" [bench command ...]
# e.g. bash bench/gpu_run.sh "-m gpu tests/test_awq_gpu.py" "python bench/awq_bench.py"
# Logs go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
rc=0
if [ -n "${1:-}" ]; then
  # eval: the pytest arguments may quote, e.g. "-m gpu tests/ -k 'q8_1 or norm'"
  eval "python3 -m pytest -p no:cacheprovider -q $1" 2>&1 | tee "$OUT/pytest.log"; rc=${PIPESTATUS[0]}
fi
shift || true
for cmd in "$@"; do
  echo "=== $cmd"; bash -c "$cmd" 2>&1 | tee -a "$OUT/bench.log"
done
exit $rc
