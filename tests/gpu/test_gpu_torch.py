"""On a real CUDA GPU, the PyTorch feeder's copies on its own streams: every sample arrives once and
bit for bit when steps are enqueued without waiting (on the default stream or a stream of the
loop's own), when batches are kept while their slots are reused, when workers make the samples,
and when batches are 64 MiB; a batch's copy runs beside a step instead of after it; and the
device memory in use stays flat over epochs.

Each "step" is a spin kernel (`torch.cuda._sleep`) and a checksum of the batch computed on the
GPU, enqueued without waiting: the GPU falls behind the loop, so the feeder's slots and torch's
cached device blocks are reused while earlier steps have yet to read their batches. A consumer
stream that did not wait for a batch's copy, or a block handed to the next copy before the step
that reads it ran, shows as a wrong checksum. PyTorch alone is needed (no TensorFlow, no JAX):
the module skips where PyTorch sees no CUDA GPU.
"""

from __future__ import annotations

import functools
import gc
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU that PyTorch sees", allow_module_level=True)

import feedpipe as fp  # noqa: E402
from feedpipe.torch.layer import OWN_STREAM  # noqa: E402
from tests.gpu.gpu_fakes import (  # noqa: E402
    MODULUS,
    Images,
    checksum_on_host,
    checksum_weights,
    expected_checksums,
)

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda", 0)
STEP_MS = 2.0
"""How long each test step's spin kernel keeps its stream busy."""


@functools.cache
def cycles_per_ms() -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # loaded and warm
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def spin(ms: float) -> None:
    """Keeps the current stream busy for about `ms` without the host waiting."""
    torch.cuda._sleep(int(ms * cycles_per_ms()))


def checksum_on_device(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`checksum_on_host`, computed where the batch sits, on the current stream."""
    bits = x.contiguous().view(torch.int32).reshape(x.shape[0], -1).to(torch.int64) & 0xFFFFFFFF
    weights = torch.from_numpy(checksum_weights(bits.shape[1])).to(x.device)
    return ((bits * weights) % MODULUS).sum(dim=1) + y.to(torch.int64)


def run_epochs(feeder, epochs: int, keep: bool = False) -> tuple[list, list]:
    """Enqueues a step per batch without waiting; returns, per epoch, each batch's checksums,
    ids and mask (on the GPU, not yet computed), and the batches themselves with `keep`."""
    results, kept = [], []
    for _ in range(epochs):
        epoch = []
        for batch in feeder:
            (x, y), mask = batch.distributed()
            spin(STEP_MS)
            epoch.append((checksum_on_device(x, y), y.clone(), mask))
            if keep:
                kept.append(batch)
            del x, y, batch
        results.append(epoch)
    return results, kept


def check_exact(source: Images, results: list) -> None:
    torch.cuda.synchronize()
    for epoch in results:
        seen = []
        for sums, y, mask in epoch:
            real = mask.cpu().numpy()
            ids = y.cpu().numpy()[real]
            assert (sums.cpu().numpy()[real] == expected_checksums(source, ids)).all(), "bytes"
            seen += ids.tolist()
        assert sorted(seen) == list(range(source.length)), "each sample once per epoch"


@pytest.mark.parametrize("stream", ["default stream", "a stream of the loop's own"])
def test_every_batch_is_exact_with_steps_enqueued_without_waiting(stream):
    source = Images(300, (32, 32, 3))
    loop_stream = torch.cuda.Stream(GPU) if stream != "default stream" else None
    with fp.Feeder(source, 64, devices=[GPU], shuffle=True, seed=1) as feeder:
        assert feeder.describe().copy_path == OWN_STREAM, feeder.describe().copy_path_reason
        with torch.cuda.stream(loop_stream):
            results, _ = run_epochs(feeder, 2)
        check_exact(source, results)
        assert feeder.stats().copy_path == OWN_STREAM


def test_kept_batches_stay_exact_while_their_slots_are_reused():
    source = Images(640, (16, 16, 3))
    with fp.Feeder(source, 32, devices=[GPU], depth=2, shuffle=True) as feeder:
        results, kept = run_epochs(feeder, 2, keep=True)
        check_exact(source, results)
        assert len(kept) == 40  # ten times the slots a depth of 2 uses
        for batch in kept:
            (x, y), _ = batch.distributed()
            ids = y.cpu().numpy()
            host = checksum_on_host(x.cpu().numpy(), ids)
            assert (host == expected_checksums(source, ids)).all()


def test_workers_deliver_every_sample_once_bit_for_bit():
    source = Images(257, (24, 24, 3))
    with fp.Feeder(source, 32, devices=[GPU], workers=4, shuffle=True) as feeder:
        results, _ = run_epochs(feeder, 2)
        check_exact(source, results)


def test_64_mib_batches_arrive_exact():
    source = Images(24, (512, 512, 16))  # 16 MiB a sample, 4 a batch: 6 batches, 4 slots
    with fp.Feeder(source, 4, devices=[GPU]) as feeder:
        results, _ = run_epochs(feeder, 1)
        check_exact(source, results)


def test_device_memory_in_use_stays_flat_over_three_epochs():
    source = Images(512, (64, 64, 3))
    in_use = []
    with fp.Feeder(source, 64, devices=[GPU], shuffle=True) as feeder:
        for _ in range(3):
            results, _ = run_epochs(feeder, 1)
            check_exact(source, results)
            del results
            gc.collect()
            # By now the feeder has staged `depth` batches of the next epoch and waits for room:
            # the same batches on the device after every epoch.
            time.sleep(0.5)
            torch.cuda.empty_cache()  # frees the blocks whose streams' events have passed
            in_use.append(torch.cuda.memory_allocated(GPU))
    assert in_use[2] <= in_use[0] + 2**20, f"bytes allocated after each epoch: {in_use}"


def test_a_batch_is_staged_while_a_long_step_still_runs():
    """The copy runs beside the step: a batch whose copy is issued after a step of about a second
    was enqueued arrives before that step ends."""
    source = Images(64, (8, 8, 3))
    with fp.Feeder(source, 8, devices=[GPU], depth=1) as feeder:
        batches = iter(feeder)
        next(batches)  # the hand-off (depth 1) holds the second batch, staged before the step
        spin(1000.0)
        step_done = torch.cuda.Event()
        step_done.record()
        next(batches)  # room: the third batch's copy is issued now, behind the enqueued step
        third = next(batches)
        step_still_running = not step_done.query()
        torch.cuda.synchronize()
        (x, y), _ = third.distributed()
        assert y.cpu().tolist() == list(range(16, 24))
        assert np.array_equal(x.cpu().numpy(), np.stack([source[i][0] for i in range(16, 24)]))
        del x, y, third, batches
    assert step_still_running, "the third batch's copy waited for the running step"
