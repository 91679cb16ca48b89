"""What the JAX GPU questions copy and step: feedpipe's slots, its copy engine's transfer as the
JAX feeder stages a batch, `jax.device_put`'s, and the R/S step (a jitted MLP calibrated to a
time). `gpu_copy.py` and `gpu_busy.py` copy, `gpu_busy.py` and `gpu_rs.py` step."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from kernels_bench.harness.images import NUM_CLASSES
from kernels_bench.harness.parts import calibrate_repeat


def slot_region(nbytes: int, page_lock) -> tuple[object, np.ndarray]:
    """A pooled, shared feedpipe slot of `nbytes` (one float32 field, one row), filled, and its
    region; page-locked by the pool when `page_lock` is a locker."""
    from feedpipe.core.slots import SlotLayout, SlotPool
    from feedpipe.core.sources import SampleSpec
    from feedpipe.core.split import ReplicaSplit

    layout = SlotLayout(SampleSpec.of(np.zeros(nbytes // 4, np.float32)), ReplicaSplit(1, 1))
    pool = SlotPool(layout, 1, shared=True, page_lock=page_lock)
    slot = pool.take(threading.Event())
    region = slot.regions[0][0]
    region[...] = 1.0  # touch every page before anything is timed
    return (pool, slot), region


def copy_engine(region: np.ndarray, device):
    """feedpipe's copy engine for `region`'s layout on `device`, as the JAX feeder makes it, or
    (None, why not)."""
    from feedpipe.core.copy_engine import CopyEngine, cuda_devices
    from feedpipe.core.sources import SampleSpec
    from feedpipe.jax.stage import device_fence

    if device.platform != "gpu":
        return None, f"platform {device.platform}: feedpipe's own copy streams need a CUDA GPU"
    memories, reason = cuda_devices([device.local_hardware_id])
    if memories is None:
        return None, reason
    spec = SampleSpec.of(np.zeros(region.shape[1:], region.dtype))
    return CopyEngine(memories, spec, region.shape[0], 2, [device_fence(device)]), reason


class EngineTransfer:
    """Copies `region` with the engine and imports it, as the JAX feeder stages a batch, timing
    each stage and the staging thread's CPU as the feeder's `stats()` do."""

    def __init__(self, engine, region: np.ndarray, device):
        from feedpipe.core.copy_engine import STAGES

        self.engine, self.device = engine, device
        self.region = region  # alive while its address is copied from
        self.sources = [[(region.ctypes.data, region.nbytes)]]
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self.copies = 0
        self.cpu_s = 0.0
        self.take = None

    def __call__(self) -> None:
        from feedpipe.jax.stage import importer

        cpu = time.thread_time()
        with self.engine.copy(self.sources, self.stage_s) as exports:
            if self.take is None:
                self.take = importer(exports[0][0], self.device)
            array = self.take(exports[0][0], self.device)
        self.cpu_s += time.thread_time() - cpu
        self.copies += 1
        array.block_until_ready()

    def per_copy(self) -> dict:
        """Each stage's mean ms, the fences and the staging thread's CPU ms, per copy."""
        copies = max(self.copies, 1)
        return {
            "engine_stage_ms": {k: v * 1e3 / copies for k, v in self.stage_s.items()},
            "engine_fences_per_copy": self.engine.fences / copies,
            "engine_cpu_ms_per_copy": self.cpu_s * 1e3 / copies,
            "engine_import": getattr(self.take, "__name__", None),
        }


def jax_transfer(jax, region: np.ndarray, device) -> Callable[[], None]:
    def transfer():
        jax.device_put(region, device).block_until_ready()

    return transfer


def make_train_step(repeat: int):
    """A jitted SGD step of an MLP whose hidden layer is applied `repeat` times."""
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y):
        h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w_in"])

        def layer(h, _):
            return jnp.tanh(h @ params["w_hidden"]), None

        h, _ = jax.lax.scan(layer, h, None, length=repeat)
        logits = h @ params["w_out"]
        log_p = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


def init_params(features: int, hidden: int, device, seed: int) -> dict:
    import jax

    rng = np.random.default_rng(seed)
    params = {
        "w_in": rng.standard_normal((features, hidden), np.float32) / np.sqrt(features),
        "w_hidden": rng.standard_normal((hidden, hidden), np.float32) / np.sqrt(hidden),
        "w_out": rng.standard_normal((hidden, NUM_CLASSES), np.float32) / np.sqrt(hidden),
    }
    return jax.device_put(params, device)


def run_steps(step, params, batches: Iterator, count: int) -> tuple[dict, float]:
    """Dispatches `count` steps on `batches`; seconds until the last one's parameters are ready."""
    import jax

    started = time.perf_counter()
    for _ in range(count):
        x, y = next(batches)
        params, _ = step(params, x, y)
    jax.block_until_ready(params)
    return params, time.perf_counter() - started


def calibrate_step(features, hidden, batch, device, seed, target_s) -> tuple[Callable, int, float]:
    """A step whose `repeat` makes it take about `target_s` alone on `batch`: a probe, then a
    refinement at about the target."""
    import jax

    x, y = jax.device_put(batch, device)

    def run(step, count: int) -> float:
        params = init_params(features, hidden, device, seed)
        params, _ = run_steps(step, params, itertools.repeat((x, y)), 3)  # compile, warm
        return run_steps(step, params, itertools.repeat((x, y)), count)[1]

    return calibrate_repeat(make_train_step, run, target_s, tries=3)
