#!/usr/bin/env bash
# The GPU check of the copy engine as one command, for a lent GPU machine (JAX and PyTorch, no
# TensorFlow, no package index), from the repository root with `.whl` carried (see the docstring
# of kernels_bench/gpu.py for the wheels): installs them, runs the JAX GPU tests, then
# kernels_bench.gpu (extra arguments go to it), and copies the logs and the JSON to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/feedpipe-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD KERAS_BACKEND=jax TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gpu_jax.py 2>&1 \
    | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 420 python3 -m kernels_bench.gpu "$@" 2>&1 | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}
cp kernels_bench/results/gpu*.json "$out/" 2>/dev/null
echo "tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
