"""On a real CUDA GPU, the JAX feeder's own copy streams: every sample arrives once and bit for bit
whether steps are dispatched without waiting, batches are kept while their blocks and slots are
reused, workers make the samples, or batches are 64 MiB; over three epochs the device memory in
use stays flat; and a batch's copy runs beside a step instead of after it.

JAX alone is needed (no TensorFlow): the module skips where JAX has no GPU.
"""

from __future__ import annotations

import functools
import gc
import math
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if not any(device.platform == "gpu" for device in jax.devices()):
    pytest.skip("needs a CUDA GPU that JAX sees", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import feedpipe as fp  # noqa: E402
from feedpipe.core import dlpack  # noqa: E402
from feedpipe.core.copy_engine import OWN_STREAMS, block_limit  # noqa: E402
from tests.gpu.gpu_fakes import Images  # noqa: E402
from tests.processes import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.gpu
GPUS = jax.devices("gpu")


def checksum_on_device(x, y):
    """A wrap-around integer checksum of every bit of `x` and `y`, row by row: exact on any
    device, and computed where the batch sits."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(x.shape[0], -1)
    weights = jnp.arange(1, bits.shape[1] + 1, dtype=jnp.uint32)
    return jnp.sum(bits * weights, axis=1) + y.astype(jnp.uint32)


def checksum_on_host(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).reshape(x.shape[0], -1)
    weights = np.arange(1, bits.shape[1] + 1, dtype=np.uint32)
    return (bits * weights).sum(axis=1, dtype=np.uint32) + y.astype(np.uint32)


def expected(source: Images, ids) -> np.ndarray:
    x = np.stack([source[int(i)][0] for i in ids])
    return checksum_on_host(x, np.asarray(ids, np.int32))


def run_epochs(feeder, epochs: int, keep_every: int = 0):
    """Dispatches a checksum per batch without waiting; returns (ids, device checksums) per
    epoch and the batches kept."""
    step = jax.jit(lambda x, y, mask: (checksum_on_device(x, y), y, mask))
    results, kept = [], []
    for _ in range(epochs):
        epoch = []
        for n, batch in enumerate(feeder):
            (x, y), mask = batch.distributed()
            epoch.append(step(x, y, mask))
            if keep_every and n % keep_every == 0:
                kept.append(
                    (batch, np.asarray(y).copy(), checksum_on_host(np.asarray(x), np.asarray(y)))
                )
        results.append(epoch)
    return results, kept


def check_exact(source: Images, results) -> None:
    for epoch in results:
        seen = []
        for sums, y, mask in epoch:
            real = np.asarray(mask)
            ids = np.asarray(y)[real]
            assert (np.asarray(sums)[real] == expected(source, ids)).all(), "a batch's bytes"
            seen += ids.tolist()
        assert sorted(seen) == list(range(source.length)), "each sample once per epoch"


def test_the_feeder_copies_on_its_own_streams_and_every_batch_is_exact_without_waiting():
    source = Images(300, (32, 32, 3))
    with fp.Feeder(source, 64, devices=GPUS[:1], shuffle=True, seed=1) as feeder:
        assert feeder.describe().copy_path == OWN_STREAMS, feeder.describe().copy_path_reason
        results, _ = run_epochs(feeder, 2)
        check_exact(source, results)
        assert feeder.stats().copy_path == OWN_STREAMS


def test_kept_batches_stay_exact_while_blocks_and_slots_are_reused():
    source = Images(640, (16, 16, 3))
    with fp.Feeder(source, 32, devices=GPUS[:1], depth=2) as feeder:
        results, kept = run_epochs(feeder, 2, keep_every=7)
        check_exact(source, results)
        for batch, ids, sums in kept:
            (x, y), _ = batch.distributed()
            assert (np.asarray(y) == ids).all()
            assert (checksum_on_host(np.asarray(x), np.asarray(y)) == sums).all()


def test_workers_deliver_every_sample_once_bit_for_bit():
    source = Images(257, (24, 24, 3))
    with fp.Feeder(source, 32, devices=GPUS[:1], workers=4, shuffle=True) as feeder:
        results, _ = run_epochs(feeder, 2)
        check_exact(source, results)


def test_64_mib_batches_arrive_exact():
    source = Images(40, (512, 512, 16))  # 16 MiB a sample, 4 a batch
    with fp.Feeder(source, 4, devices=GPUS[:1]) as feeder:
        results, _ = run_epochs(feeder, 1)
        check_exact(source, results)


def test_device_memory_in_use_stays_flat_over_three_epochs():
    source = Images(512, (64, 64, 3))
    device = GPUS[0]
    in_use, blocks = [], []
    with fp.Feeder(source, 64, devices=[device], shuffle=True) as feeder:
        for _ in range(3):
            results, _ = run_epochs(feeder, 1)
            check_exact(source, results)
            del results
            gc.collect()
            in_use.append(device.memory_stats()["bytes_in_use"])
            blocks.append(feeder.stats().device_blocks)
    assert in_use[2] <= in_use[0] + 2**20, f"XLA's bytes in use grew: {in_use}"
    assert max(blocks) <= block_limit(2, 0), f"feedpipe's device blocks: {blocks}"
    gc.collect()
    assert dlpack.exports_alive() == 0


def long_step(device, seconds: float, side: int = 8192):
    """A step of about `seconds` on `device` whose dispatch returns at once, as a function of
    no argument: a chain of matmuls unrolled in one program. XLA runs a `fori_loop` from the
    host (it reads the loop's condition back each iteration), so the call that dispatched one
    returned only once the loop had ended, and nothing could be issued beside it."""
    matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)

    def chain(links: int):
        def run(m, a):
            for _ in range(links):
                m = jnp.tanh(matmul(m, a))
            return m

        return jax.jit(run)

    a = jax.device_put(jnp.eye(side, dtype=jnp.float32), device)
    one = chain(1)
    one(a, a).block_until_ready()  # compiled
    started = time.perf_counter()
    for _ in range(3):
        one(a, a).block_until_ready()
    link_s = (time.perf_counter() - started) / 3
    whole = chain(max(1, math.ceil(seconds / link_s)))
    whole(a, a).block_until_ready()  # compiled
    return functools.partial(whole, a, a)


def test_a_batch_is_staged_while_a_long_step_still_runs():
    """The copy runs beside the step: a batch whose copy is issued after a step of about a second
    was queued arrives before that step ends (through `jax.device_put` it would wait for it)."""
    device = GPUS[0]
    step = long_step(device, 1.0)
    started = time.perf_counter()
    running = step()
    dispatched_s = time.perf_counter() - started
    running.block_until_ready()
    step_s = time.perf_counter() - started
    assert dispatched_s < 0.2 * step_s and step_s > 0.3, (
        f"the test's own step is not an asynchronous step of about a second: its dispatch "
        f"returned after {dispatched_s:.3f} s of its {step_s:.3f} s, so this test cannot tell "
        "whether a copy runs beside it (this says nothing of feedpipe)"
    )
    with fp.Feeder(Images(64, (8, 8, 3)), 8, devices=[device], depth=1) as feeder:
        batches = iter(feeder)
        next(batches)  # the ring (depth 1) holds the second batch, staged before the step
        running = step()
        next(batches)  # room: the third batch's copy is issued now, behind the queued step
        third = next(batches)
        step_still_running = not running.is_ready()
        running.block_until_ready()
        del third
    assert step_still_running, "the third batch's copy waited for the running step"


def test_a_step_that_donates_a_staged_batch_fails_cleanly_instead_of_aborting():
    script = textwrap.dedent(
        """
        import jax, numpy as np, feedpipe as fp
        gpu = jax.devices("gpu")[0]
        with fp.Feeder(np.arange(64, dtype=np.float32).reshape(16, 4), 8, devices=[gpu]) as f:
            donate = jax.jit(lambda x: x * 2, donate_argnums=0)
            try:
                out = donate(next(iter(f)).replicas[0])
                print("RAN", float(out.sum()))
            except Exception as error:
                print("REFUSED", type(error).__name__, str(error).splitlines()[0][:200])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith(("RAN", "REFUSED")), done.stdout
    print(done.stdout)
