#!/usr/bin/env bash
# The GPU checks as one command, for a lent GPU machine (JAX and PyTorch, no TensorFlow, no
# package index), from the repository root with `.whl` carried (see the docstring of
# kernels_bench/gpu.py for the wheels):
#   jax:   installs the wheels, runs the JAX GPU tests, then kernels_bench.gpu (extra arguments
#          go to it; about 7 minutes);
#   torch: runs the PyTorch GPU tests, then kernels_bench.torch_gpu ($TORCH_GPU_ARGS go to it;
#          about 4 minutes; the wheels are installed too where `.whl` is carried, for torchdata's
#          StatefulDataLoader peer, but it runs without them).
# GPU_RUN picks the parts (default "jax,torch"; one command may run for at most 10 minutes on
# the lent machines, so run "GPU_RUN=jax" and "GPU_RUN=torch" as two commands there). The logs
# and the JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/feedpipe-gpu}
mkdir -p "$out"
parts=",${GPU_RUN:-jax,torch},"
wants() { [[ $parts == *",$1,"* ]]; }
if wants jax || compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl || { echo "the carried wheels did not install"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD KERAS_BACKEND=jax TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
status=0
if wants jax; then
    timeout 180 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gpu_jax.py 2>&1 \
        | tee "$out/gpu_tests.log"
    tests=${PIPESTATUS[0]}
    timeout 420 python3 -m kernels_bench.gpu "$@" 2>&1 | tee "$out/gpu_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/gpu*.json "$out/" 2>/dev/null
    echo "jax: tests exit $tests, benchmark exit $bench"
    status=$(( status || tests || bench ))
fi
if wants torch; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gpu_torch.py 2>&1 \
        | tee "$out/torch_gpu_tests.log"
    tests=${PIPESTATUS[0]}
    # shellcheck disable=SC2086  # the arguments are words
    timeout 360 python3 -m kernels_bench.torch_gpu ${TORCH_GPU_ARGS:-} 2>&1 \
        | tee "$out/torch_gpu_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/torch_gpu*.json "$out/" 2>/dev/null
    echo "torch: tests exit $tests, benchmark exit $bench"
    status=$(( status || tests || bench ))
fi
exit $status
