#!/usr/bin/env bash
# The GPU checks as one command of about 6 minutes, for a lent GPU machine (JAX and PyTorch, no
# TensorFlow, no package index), from the repository root with `.whl` carried (see the
# docstring of kernels_bench/gpu.py for the wheels):
#   jax:     installs the wheels, runs the JAX GPU tests, then kernels_bench.gpu: the questions
#            of gpu_copy.py, gpu_busy.py, gpu_rs.py and gpu_fit.py in one process, into
#            gpu.json (extra arguments go to it, e.g. --parts rs; about 4 minutes at 4
#            repetitions);
#   torch:   runs the PyTorch GPU tests, then kernels_bench.torch_gpu ($TORCH_GPU_ARGS go to
#            it; about 2 minutes);
#   startup: kernels_bench.startup with 8 workers (the first batch against PyDataset's, a
#            second feeder's, a source holding 1 GB; under a minute);
#   gather:  kernels_bench.gather on the machine's cores (the feeder's gather of in-memory
#            arrays against the host's own; about 15 seconds).
# GPU_RUN picks the parts (default "jax,torch,startup,gather"). Each part's timeout keeps the whole
# under the lent machines' 10 minutes a command. The logs and the JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/feedpipe-gpu}
mkdir -p "$out"
parts=",${GPU_RUN:-jax,torch,startup,gather},"
wants() { [[ $parts == *",$1,"* ]]; }
if wants jax || compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl || { echo "the carried wheels did not install"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD KERAS_BACKEND=jax TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
status=0
if wants jax; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gpu_jax.py 2>&1 \
        | tee "$out/gpu_tests.log"
    tests=${PIPESTATUS[0]}
    timeout 260 python3 -m kernels_bench.gpu --reps 4 "$@" 2>&1 | tee "$out/gpu_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/gpu*.json "$out/" 2>/dev/null
    echo "jax: tests exit $tests, benchmark exit $bench"
    status=$(( status || tests || bench ))
fi
if wants torch; then
    timeout 45 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_gpu_torch.py 2>&1 \
        | tee "$out/torch_gpu_tests.log"
    tests=${PIPESTATUS[0]}
    # shellcheck disable=SC2086  # the arguments are words
    timeout 130 python3 -m kernels_bench.torch_gpu ${TORCH_GPU_ARGS:-} 2>&1 \
        | tee "$out/torch_gpu_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/torch_gpu*.json "$out/" 2>/dev/null
    echo "torch: tests exit $tests, benchmark exit $bench"
    status=$(( status || tests || bench ))
fi
if wants startup; then
    timeout 50 python3 -m kernels_bench.startup --workers 8 2>&1 | tee "$out/startup_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/startup_w8.json "$out/" 2>/dev/null
    echo "startup: benchmark exit $bench"
    status=$(( status || bench ))
fi
if wants gather; then
    timeout 35 python3 -m kernels_bench.gather 2>&1 | tee "$out/gather_bench.log"
    bench=${PIPESTATUS[0]}
    cp kernels_bench/results/gather.json "$out/" 2>/dev/null
    echo "gather: benchmark exit $bench"
    status=$(( status || bench ))
fi
exit $status
