"""The JAX GPU questions as one command: on a GPU, does feedpipe copy at the link's rate beside
the running step, keep a real step fed, and feed Keras 3 on JAX as fast as in-memory arrays or
its own producers allow?

It answers no question of its own: it runs, in one process and in this order, the questions of
`gpu_copy.py` (the copy rate from feedpipe's slots), `gpu_busy.py` (a copy issued while a step
runs), `gpu_rs.py` (R/S of a real jitted step at depth 2) and `gpu_fit.py` (Keras 3's
`fit(feeder)` on JAX from a Python source), each a part (`--parts copy,busy,rs,fit`) taking its
own options, and writes their cases into one report, `kernels_bench/results/gpu.json`. Each
module's docstring states its question, its peers and its targets, and runs it alone.

On a CUDA machine with JAX (and PyTorch, optionally) but no TensorFlow and no package index,
carry as wheels what it lacks: Keras 3 (keras, namex, optree; its other needs, absl-py, rich,
h5py, ml-dtypes and packaging, are usually there) and Grain (grain, array_record, portpicker;
it also needs absl-py, cloudpickle, etils, protobuf and psutil). feedpipe itself runs from the
checkout (it needs numpy, optree and cloudpickle). From the repository root on a machine with
pip, for the GPU machine's Python (3.12 here; ~7 MB):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl keras==3.15.1 namex==0.1.0 optree==0.20.0 \
        grain==0.2.18 array_record==0.8.6 portpicker==1.6.0

Then, on the GPU machine, in the repository root with `.whl` carried beside the checkout, the
one command, which also runs the JAX GPU tests first (`tests/gpu/test_gpu_jax.py`), then
PyTorch's half (`kernels_bench.torch_gpu` and its tests), `kernels_bench.startup` with 8
workers and `kernels_bench.gather` on the machine's cores:

    bash kernels_bench/gpu_run.sh

which takes about 6 minutes, writes `kernels_bench/results/gpu.json` (4 repetitions) and the
others, and copies them with their logs to `$OUT` (`GPU_RUN=jax` runs this half alone).
`--smoke` shrinks every part (a few small batches, 2 workers, 3 repetitions, under 2 minutes)
so that it runs on CPU JAX as a check that the script works, and writes `gpu_smoke.json`
instead: its figures are labelled with the platform they came from, and on a CPU device
`jax.device_put` may wrap host memory instead of copying it, so its "copy rates" are not copy
rates. The JSON records the device, the versions, whether the slots were page-locked and, if
not, why.
"""

from __future__ import annotations

from kernels_bench import gpu_busy, gpu_copy, gpu_fit, gpu_rs
from kernels_bench.harness import jax_gpu

QUESTION = (
    "copy rate of feedpipe's copy engine from its slots / torch pinned, copy-ready time "
    "with a step running / idle, R/S of a jitted step at depth 2 (30 and 5 ms), and "
    "Keras 3 JAX fit(feeder) / min(fit(arrays), the feeder alone) beside PyDataset and "
    "Grain, on one accelerator"
)
PARTS = (gpu_copy, gpu_busy, gpu_rs, gpu_fit)


def main(argv=None) -> None:
    jax_gpu.main("gpu", __doc__, QUESTION, PARTS, argv)


if __name__ == "__main__":
    main()
