"""tf.data service as the feeder's per-sample workers: a dispatcher and worker processes on
loopback make each sample once per epoch, in the plan's order, with the values a local run makes.
"""

from __future__ import annotations

import _thread
import contextlib
import http.server
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.experimental.ops import testing

import feedpipe as fp
from feedpipe._internals.tf import dataset_graph
from feedpipe.core.handoff import Handoff
from feedpipe.core.sources import as_source
from feedpipe.service import client as service_module
from feedpipe.service import producer as producer_module
from tests.service_cluster import service_cluster
from tests.test_fit_checkpoints import InterruptAfter

pytestmark = pytest.mark.slow  # each starts tf.data service servers


def records(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Small per-sample records (the kind a service source holds): a feature row and a label."""
    labels = np.arange(length, dtype=np.int64)
    return np.repeat(labels.astype(np.float32)[:, None], 3, axis=1), labels


def scaled(sample):
    features, label = sample
    return tf.reverse(features, [0]) * 2.0 + 1.0, label


def jittered(sample, seed):
    """Random per sample, but a function of its seed alone: the same on any worker."""
    features, label = sample
    return features + tf.random.stateless_uniform((3,), seed), label


def feeder(address, length, global_batch, devices, transform, shuffle=True) -> fp.Feeder:
    """A feeder of `records(length)` through `transform`, on the service at `address` (or
    here, for None)."""
    return fp.Feeder(
        records(length),
        global_batch,
        devices=devices,
        transform=transform,
        service=address,
        shuffle=shuffle,
        seed=3,
    )


def stream_of(batch) -> list[tuple]:
    """One step as [(epoch, step, labels, features, masks)]."""
    features, labels = (
        tf.concat(list(field), 0).numpy() for field in zip(*batch.replicas, strict=True)
    )
    masks = tf.concat(list(batch.masks), 0).numpy()
    return [(batch.epoch, batch.step, labels.tolist(), features.tolist(), masks.tolist())]


def stream(feeder, epochs: int) -> list[tuple]:
    """Every step of `epochs` epochs."""
    return [step for _ in range(epochs) for batch in feeder for step in stream_of(batch)]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A dispatcher and 2 worker processes on loopback, for the whole module."""
    with service_cluster(workers=2, logs=tmp_path_factory.mktemp("service")) as cluster:
        yield cluster


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("epochs", [1, 2])
def test_each_sample_once_per_epoch_in_the_local_order_and_values(
    service, devices, shuffle, epochs
):
    """21 samples in batches of 4 on 2 replicas: a padded last batch."""

    def feed(address):
        return feeder(address, 21, 4, devices[:2], scaled, shuffle=shuffle)

    with feed(None) as local:
        expected = stream(local, epochs)
    with feed(service.address) as remote:
        got = stream(remote, epochs)
    assert got == expected
    for epoch in range(epochs):
        real = [
            label
            for e, _, labels, _, masks in got
            if e == epoch
            for label, real in zip(labels, masks, strict=True)
            if real
        ]
        assert sorted(real) == list(range(21))


def test_a_seeded_transform_gives_the_local_values_on_any_worker(service, devices):
    """The stateless seed is a function of (seed, epoch, index): the service's run equals the
    local one, and the values differ from sample to sample and from epoch to epoch."""

    def run(address):
        with feeder(address, 12, 4, devices[:1], jittered, shuffle=True) as one:
            return stream(one, 2)

    remote = run(service.address)
    assert remote == run(None)
    noise = [np.asarray(f)[:, 0] - np.asarray(labels) for _, _, labels, f, _ in remote]
    assert len({round(float(v), 6) for step in noise for v in step}) == 24


def test_a_transform_that_asks_for_a_numpy_rng_is_refused(service):
    def with_rng(sample, rng):
        return sample

    with pytest.raises(TypeError, match=r"name its second parameter `seed`"):
        fp.Feeder(records(8), 4, transform=with_rng, service=service.address)


def test_stats_say_how_long_the_producer_waited_for_the_service(service, devices):
    # 4 elements of 64 rows: the first makes the first batch (start-up, not counted).
    with slow_feeder(service.address, 256, devices) as remote:
        stream(remote, 1)
        stats = remote.stats()
    assert 0 < stats.service_wait_s <= stats.producer_busy_s
    assert "waiting for tf.data service" in str(stats)
    with feeder(None, 16, 8, devices[:1], scaled) as local:
        stream(local, 1)
        assert local.stats().service_wait_s == 0


def test_a_restore_mid_epoch_continues_the_stream(service, devices):
    """A state taken after 2 steps, restored in a new feeder against the same service."""

    def feed():
        return feeder(service.address, 21, 4, devices[:2], scaled)

    with feed() as whole:
        expected = stream(whole, 2)
    with feed() as first:
        batches = iter(first)
        next(batches)
        next(batches)
        state = first.get_state()
        del batches
    with feed() as resumed:
        resumed.set_state(state)
        assert stream(resumed, 2) == expected[2:]  # the rest of epoch 0 (a new job), then 1


def regression(sample):
    """`scaled`, with the label as the float target of a regression."""
    features, label = scaled(sample)
    return features, tf.cast(label, tf.float32) / 8.0


def fitted(address, fits: list[int], interrupt_after: int | None = None) -> tuple[list, list]:
    """A model trained by `model.fit(feeder.as_dataset())` over 21 shuffled records in batches
    of 4 (a padded last batch), one fit per entry of `fits` (its epochs), the first ended by
    Ctrl-C after step `interrupt_after` where given: its weights and the feeder's state after
    each fit."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    states = []
    with feeder(address, 21, 4, ["/cpu:0"], regression) as feed:
        for number, epochs in enumerate(fits):
            callbacks = [feed.fit_callback()]
            if number == 0 and interrupt_after is not None:
                callbacks.append(InterruptAfter(interrupt_after))
            with contextlib.suppress(KeyboardInterrupt):
                model.fit(feed.as_dataset(), epochs=epochs, verbose=0, callbacks=callbacks)
            states.append((feed.get_state()["epoch"], feed.get_state()["step"]))
    return [w.numpy() for w in model.weights], states


def test_model_fit_on_as_dataset_trains_as_on_the_local_feeder(service):
    """Two epochs of fit over the service end on the weights a local feeder's fit ends on."""
    weights, states = fitted(service.address, [2])
    local_weights, local_states = fitted(None, [2])
    assert states == local_states == [(2, 0)]
    for got, expected in zip(weights, local_weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_fit_on_the_service_interrupted_by_ctrl_c_and_run_again_goes_on(service):
    """Ctrl-C after step 2 ends the fit with 3 steps trained; running the cell again trains the
    rest of the epoch and the next, each batch once: the weights of a local run doing the same,
    and no job's reader left behind."""
    weights, states = fitted(service.address, [2, 1, 1], interrupt_after=2)
    local_weights, local_states = fitted(None, [2, 1, 1], interrupt_after=2)
    assert states == local_states == [(0, 3), (1, 0), (2, 0)]
    for got, expected in zip(weights, local_weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    wait_for_the_readers_to_end(within_s=10.0)


def test_ctrl_c_while_the_loop_waits_for_the_service_and_the_next_loop_goes_on(
    service, devices, monkeypatch
):
    """Ctrl-C lands as the loop asks for the batch after step 1, inside the feeder's wait for
    it (elements of 8 rows: the later steps' rows are still being made): the next loop takes
    the rest of the epoch, so the two loops together are the uninterrupted stream. The
    interrupt is sent from the wait itself: a timer raced the rows, which on a loaded machine
    were sometimes all made before it fired."""
    monkeypatch.setattr(service_module, "ROWS_PER_ELEMENT", 8)
    armed, waiting_for = threading.Event(), Handoff._get

    def interrupted_wait(handoff, thread, stop):
        if armed.is_set():
            armed.clear()
            _thread.interrupt_main()  # what Ctrl-C does: raised in this thread's next bytecode
        return waiting_for(handoff, thread, stop)

    monkeypatch.setattr(Handoff, "_get", interrupted_wait)
    expected = local_stream(128, devices)
    got = []
    with slow_feeder(service.address, 128, devices) as remote:
        with contextlib.suppress(KeyboardInterrupt):
            for batch in remote:
                got += stream_of(batch)
                if batch.step == 1:
                    armed.set()
        interrupted_at = len(got)
        got += stream(remote, 1)
    assert interrupted_at == 2
    assert got == expected
    wait_for_the_readers_to_end(within_s=10.0)


def test_a_python_transform_is_refused_naming_the_service_limit(service):
    def python(sample):
        return tf.py_function(lambda v: v, [sample[0]], tf.float32), sample[1]

    def numpy_calls(sample):
        return np.asarray(sample[0]) * 2, sample[1]

    for transform in (python, numpy_calls):
        with pytest.raises(TypeError, match=r"tf\.data service workers run TensorFlow graphs only"):
            fp.Feeder(records(8), 4, transform=transform, service=service.address)


def test_a_python_transform_is_refused_in_one_message_naming_it_and_the_fix(service):
    """One sentence: the argument and its value, the cause once (AutoGraph's message already
    starts with its type), the service's rule and the fix; no traceback of the trace."""

    def root(sample):  # Python's math on a tensor: TypeError, raised through AutoGraph
        return math.sqrt(sample[0][0]), sample[1]

    def numpy_calls(sample):
        return np.asarray(sample[0]) * 2, sample[1]

    for transform, cause in ((root, "TypeError"), (numpy_calls, "NotImplementedError")):
        with pytest.raises(TypeError) as refused:
            fp.Feeder(records(8), 4, transform=transform, service=service.address)
        message = str(refused.value)
        assert message.startswith(f"`transform`={transform.__name__} cannot be traced into a ")
        assert message.count(f"{cause}:") == 1, message
        assert "\n" not in message and "in user code" not in message, message
        assert "tf.data service workers run TensorFlow graphs only" in message
        assert message.endswith("use workers=N to run Python per sample in worker processes.")


def test_an_unreachable_dispatcher_is_a_clear_error(devices):
    from tests.cluster import free_ports

    (port,) = free_ports(1)
    with pytest.raises(ConnectionError, match=r"no tf.data service dispatcher answered there"):
        fp.Feeder(records(8), 4, transform=scaled, service=f"grpc://localhost:{port}")
    with pytest.raises(ValueError, match=r"is not a dispatcher address"):
        fp.Feeder(records(8), 4, transform=scaled, service="localhost")


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    """A plain HTTP server on a free loopback port, in a thread (what a wrong port may hold),
    as a service address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"grpc://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


def test_a_server_that_is_not_a_dispatcher_is_refused_naming_the_address(devices):
    """An HTTP server accepts the connection but is no dispatcher: TensorFlow would wait for
    one without end; the feeder asks the dispatcher itself and refuses the address at once."""
    with http_server() as address:
        started = time.monotonic()
        with pytest.raises(
            ConnectionError,
            match=rf"`service`='{re.escape(address)}': no tf.data service dispatcher answered",
        ):
            fp.Feeder(records(8), 4, devices=devices[:1], transform=scaled, service=address)
        assert time.monotonic() - started < 5.0


def fails_on_77(sample):
    features, label = sample
    tf.debugging.assert_none_equal(label, tf.constant(77, label.dtype), message="77 is bad")
    return features, label


def test_a_transform_error_on_the_service_names_the_sample_as_a_local_run_does(service, devices):
    """TensorFlow's error from a service worker names the worker, never the sample: the loop
    gets it with its type and message, and the note a local run's error has."""
    for address in (None, service.address):
        with (
            feeder(address, 128, 8, devices[:1], fails_on_77) as one,
            pytest.raises(tf.errors.InvalidArgumentError, match="77 is bad") as raised,
        ):
            stream(one, 1)
        notes = getattr(raised.value, "__notes__", [])
        assert any("sample index 77 of epoch 0" in note for note in notes), (address, notes)


def test_a_transform_whose_shape_varies_is_refused(service):
    def ragged(sample):
        features, label = sample
        return features[: tf.cast(label % 3, tf.int32) + 1], label

    with pytest.raises(ValueError, match="varies from sample to sample"):
        fp.Feeder(records(8), 4, transform=ragged, service=service.address)


ROW_BYTES = 3 * 4 + 8
"""Bytes of one row of `records` through `scaled`: 3 float32 features and an int64 label."""
ROW_S = 0.03
"""How often a service worker sends a row in `slow_feeder`s."""


@contextlib.contextmanager
def slow_feeder(address, length: int, devices) -> Iterator[fp.Feeder]:
    """`length` records through `scaled` in batches of 8 on one device, each service worker
    sending a row every ROW_S (TensorFlow's own SleepDataset after the transform), however fast
    the machine: rows are still owed when a worker or the dispatcher is lost. A pace set by the
    work done instead (matmuls) was no pace on a fast machine: every row was made before the
    first arrived."""
    rows = service_module.ServiceWork._rows

    def paced(work, *args, **kwargs):
        return rows(work, *args, **kwargs).apply(testing.sleep(int(ROW_S * 1e6)))

    with (
        mock.patch.object(service_module.ServiceWork, "_rows", paced),
        feeder(address, length, 8, devices[:1], scaled) as made,
    ):
        yield made


def local_stream(length: int, devices) -> list[tuple]:
    """The one-epoch stream of `slow_feeder`, made here."""
    with feeder(None, length, 8, devices[:1], scaled) as local:
        return stream(local, 1)


def wait_for_the_readers_to_end(within_s: float = 60.0) -> None:
    """Waits until no job's reader thread is left (an abandoned one ends once TensorFlow's
    blocked read returns)."""
    deadline = time.monotonic() + within_s
    while readers := [t for t in threading.enumerate() if t.name == "feedpipe-service-job"]:
        if time.monotonic() > deadline:
            frames = sys._current_frames()
            stacks = ["".join(traceback.format_stack(frames[t.ident])) for t in readers]
            pytest.fail("an abandoned job's reader did not end:\n" + "\n".join(stacks))
        time.sleep(0.1)


def at_the_first_rows(monkeypatch, act) -> list[float]:
    """Calls `act()` once, as the feeder reads the service's first rows, and returns a list
    that then holds when (`time.monotonic`). Acting after the first step instead, on a loaded
    machine the service had sometimes made every row of the epoch by then."""
    acted, arrived = [], producer_module._Rows.arrived

    def acting(rows, positions, leaves):
        if not acted:
            act()
            acted.append(time.monotonic())
        return arrived(rows, positions, leaves)

    monkeypatch.setattr(producer_module._Rows, "arrived", acting)
    return acted


def test_a_service_worker_killed_mid_epoch_loses_no_row(tmp_path, devices, monkeypatch):
    """A worker SIGKILLed as the feeder reads the first rows (`at_the_first_rows`; elements of
    8 rows, so that it is mid-epoch): the rows it held never come and its job never ends
    (TensorFlow 2.21), so once no row came for STALL_S the feeder asks a new job for the
    missing rows; the epoch is still each sample once, in the local order and values."""
    monkeypatch.setattr(producer_module, "STALL_S", 2.0)
    monkeypatch.setattr(service_module, "ROWS_PER_ELEMENT", 8)
    ports = []

    def kill():
        victim = cluster.workers[0]
        ports.append(cluster.ports[victim.pid])
        cluster.kill_worker(victim.pid)

    at_the_first_rows(monkeypatch, kill)
    expected = local_stream(128, devices)
    with service_cluster(workers=2, logs=tmp_path) as cluster:
        with slow_feeder(cluster.address, 128, devices) as remote:
            got = [row for batch in remote for row in stream_of(batch)]
            jobs = remote._assembly.producer.jobs
        (port,) = ports
        # The abandoned job ends once a worker serves at the lost one's address again.
        cluster.add_worker(port=port)
        wait_for_the_readers_to_end()
    assert got == expected
    assert jobs >= 2, "the rows the dead worker held were asked for again"


def test_a_stopped_service_worker_keeps_the_rows_held_bounded_and_loses_no_row(
    tmp_path, devices, monkeypatch
):
    """One of two workers stopped (SIGSTOP) for 10 s as the first rows arrive: the rows the
    feeder holds outside the slots stay within HELD_BYTES (32 rows) past the open steps (the other
    worker's rows of the whole epoch were kept), the stats say the producer waited for a
    lagging worker, and once it goes on (SIGCONT) the epoch is each sample once, in the local
    order and values. It is stopped as the feeder reads the first rows (see
    `at_the_first_rows`)."""
    monkeypatch.setattr(service_module, "ROWS_PER_ELEMENT", 8)
    monkeypatch.setattr(service_module, "HELD_BYTES", 32 * ROW_BYTES)

    def stop():
        os.kill(victim, signal.SIGSTOP)
        resume.start()

    at_the_first_rows(monkeypatch, stop)
    held, arrived = [], producer_module._Rows.arrived

    def counted(rows, positions, leaves):
        kept = arrived(rows, positions, leaves)
        held.append(len(rows.kept))
        return kept

    monkeypatch.setattr(producer_module._Rows, "arrived", counted)
    expected = local_stream(256, devices)
    with service_cluster(workers=2, logs=tmp_path) as cluster:
        victim = cluster.workers[0].pid
        resume = threading.Timer(10.0, os.kill, (victim, signal.SIGCONT))
        try:
            with slow_feeder(cluster.address, 256, devices) as remote:
                got = []
                for batch in remote:
                    got += stream_of(batch)
                stats = remote.stats()
        finally:
            resume.cancel()
            os.kill(victim, signal.SIGCONT)
        wait_for_the_readers_to_end()
    assert got == expected
    open_steps = 2 * 8  # ServiceProducer.slots_in_flight steps of 8 rows
    assert max(held) <= 32 + open_steps, f"{max(held)} rows held outside the slots"
    assert stats.service_lag_wait_s > 0
    assert "lagging tf.data service worker" in str(stats)


def rss_peak_while(work) -> tuple[int, int]:
    """This process's RSS (bytes) before `work()` and its highest while it runs, sampled
    every 20 ms with psutil."""
    import psutil

    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.02)

    before = process.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return before, peak[0]


def test_a_stopped_service_worker_grows_the_trainer_by_the_slots_and_the_stated_cap_at_most(
    tmp_path, devices, monkeypatch
):
    """128 MB of arrays (2048 rows of 64 KiB, row i all i) through `x * 2` in batches of 64,
    one of two workers stopped (SIGSTOP) for 10 s as the first rows arrive: the trainer's RSS
    grows by at most its slots and `MEMORY_CAP_BYTES`, and the epoch is each sample once, in
    order, with its value. Before, every job carried the whole arrays in its graph (+386 MB
    to start one) and the rows held were counted in rows (2048 of them: 128 MB)."""
    rows, floats, global_batch, depth = 2048, 16384, 64, 2
    values = np.ascontiguousarray(
        np.broadcast_to(np.arange(rows, dtype=np.float32)[:, None], (rows, floats))
    )
    labels = np.arange(rows, dtype=np.int64)

    def double(sample):
        features, label = sample
        return features * 2.0, label

    def stop():
        os.kill(victim, signal.SIGSTOP)
        resume.start()

    at_the_first_rows(monkeypatch, stop)
    got, wrong = [], []

    def epoch():
        for batch in remote:
            features, label = (field.numpy() for field in batch.replicas[0])
            real = batch.masks[0].numpy()
            got.extend(label[real].tolist())
            if not np.all(features[real] == 2.0 * label[real, None]):
                wrong.append(batch.step)

    with service_cluster(workers=2, logs=tmp_path) as cluster:
        victim = cluster.workers[0].pid
        resume = threading.Timer(10.0, os.kill, (victim, signal.SIGCONT))
        try:
            with fp.Feeder(
                (values, labels),
                global_batch,
                devices=devices[:1],
                transform=double,
                service=cluster.address,
                depth=depth,
            ) as remote:
                before, peak = rss_peak_while(epoch)
        finally:
            resume.cancel()
            os.kill(victim, signal.SIGCONT)
        wait_for_the_readers_to_end()
    assert got == labels.tolist()
    assert not wrong, f"steps {wrong} held other values"
    batch_bytes = global_batch * (floats * 4 + 8)
    # Host slots (depth + 1 + the 2 being filled), and on a CPU device its staged batches and
    # the one the loop holds.
    slots = (depth + 3) * batch_bytes + (depth + 1) * batch_bytes
    cap = service_module.MEMORY_CAP_BYTES
    assert peak - before <= slots + cap, (
        f"RSS grew by {(peak - before) / 2**20:.0f} MiB; slots {slots / 2**20:.0f} MiB and "
        f"the stated cap {cap / 2**20:.0f} MiB"
    )


def test_a_service_worker_added_mid_epoch_loses_no_row(tmp_path, devices):
    """A second worker joins after the first step (the consumer waits for it to serve, so the
    job is still under way) and takes a share of the job's work."""
    expected = local_stream(256, devices)
    with service_cluster(workers=1, logs=tmp_path) as cluster:
        with slow_feeder(cluster.address, 256, devices) as remote:
            got = []
            for batch in remote:
                got += stream_of(batch)
                if batch.step == 0:
                    cluster.add_worker()
        wait_for_the_readers_to_end()
    assert got == expected


@pytest.mark.parametrize("journal", [True, False], ids=["fault_tolerant", "no_work_dir"])
def test_a_dispatcher_restarted_mid_epoch_loses_no_row(tmp_path, devices, monkeypatch, journal):
    """The dispatcher SIGKILLed after step 1 and started again at its address: with a journal
    it knows its jobs again; without one it has forgotten them (TensorFlow raises NotFound) and
    the feeder asks a new job for the rows it is owed. Either way each sample comes once."""
    monkeypatch.setattr(producer_module, "STALL_S", 2.0)
    expected = local_stream(256, devices)
    work_dir = tmp_path / "journal" if journal else None
    with service_cluster(workers=2, logs=tmp_path, work_dir=work_dir) as cluster:
        with slow_feeder(cluster.address, 256, devices) as remote:
            got = []
            for batch in remote:
                got += stream_of(batch)
                if batch.step == 1:
                    cluster.kill_dispatcher()
                    cluster.restart_dispatcher()
        wait_for_the_readers_to_end()
    assert got == expected


def test_a_dispatcher_lost_for_good_fails_within_the_bound(tmp_path, devices, monkeypatch):
    """No row for DISPATCHER_LOST_S while the dispatcher does not answer: a ConnectionError
    naming it and the step, after whole batches only; never a hang, never a short epoch. The
    dispatcher is killed as the feeder reads the first rows (see `at_the_first_rows`)."""
    monkeypatch.setattr(producer_module, "STALL_S", 1.0)
    monkeypatch.setattr(producer_module, "DISPATCHER_LOST_S", 4.0)
    killed = at_the_first_rows(monkeypatch, lambda: cluster.kill_dispatcher())
    expected = local_stream(256, devices)
    with service_cluster(workers=2, logs=tmp_path) as cluster:
        with slow_feeder(cluster.address, 256, devices) as remote:
            got = []
            with pytest.raises(ConnectionError, match=r"dispatcher at .* has not answered") as lost:
                for batch in remote:
                    got += stream_of(batch)
            waited = time.monotonic() - killed[0]
        assert "of epoch 0" in str(lost.value)
        # The bound: DISPATCHER_LOST_S without a row, noticed within a wait slice and a
        # connect, and the jobs' release (RELEASE_S).
        assert waited < 4.0 + 3.0 + 5.0, f"raised {waited:.1f} s after the dispatcher died"
        cluster.restart_dispatcher()  # the abandoned reader's blocked read returns
        wait_for_the_readers_to_end()
    assert got == expected[: len(got)] and len(got) < len(expected)


def test_a_dispatcher_that_stops_answering_fails_within_the_bound(tmp_path, devices, monkeypatch):
    """A dispatcher stopped (SIGSTOP) mid-epoch still accepts connections (the kernel does)
    but answers nothing: no row for DISPATCHER_LOST_S, then a ConnectionError naming it, never
    new jobs without end. A timer starts it again after 40 s, so a feeder that waits for it
    goes on and the test fails instead of hanging. It is stopped as the feeder reads the first
    rows (see `at_the_first_rows`)."""
    monkeypatch.setattr(producer_module, "STALL_S", 1.0)
    monkeypatch.setattr(producer_module, "DISPATCHER_LOST_S", 4.0)

    def stop():
        os.kill(pid, signal.SIGSTOP)
        guard.start()

    stopped = at_the_first_rows(monkeypatch, stop)
    with service_cluster(workers=2, logs=tmp_path) as cluster:
        pid = cluster.dispatcher.pid
        guard = threading.Timer(40.0, os.kill, (pid, signal.SIGCONT))
        try:
            with slow_feeder(cluster.address, 256, devices) as remote:
                with pytest.raises(ConnectionError, match=rf"{cluster.address} has not answered"):
                    for _ in remote:
                        pass
                waited = time.monotonic() - stopped[0]
        finally:
            guard.cancel()
            os.kill(pid, signal.SIGCONT)
        wait_for_the_readers_to_end()
    # DISPATCHER_LOST_S without a row, an unanswered check (ANSWER_S), the jobs' release.
    assert waited < 4.0 + 2.0 + 3.0 + 5.0, f"raised {waited:.1f} s after the dispatcher stopped"


def test_a_jobs_splits_grow_with_its_rows_within_the_bounds():
    """The dispatcher pays per split, so a large job's splits are large; a small job's still
    number `SPLITS_PER_JOB`, and rows so wide that `SPLITS_HELD` splits would pass
    `HELD_BYTES` go fewer to a split."""
    work = service_module.ServiceWork(as_source(records(64)), scaled, seed=0)
    per_job = service_module.SPLITS_PER_JOB
    assert work.split_rows(1) == service_module.ROWS_PER_SPLIT
    assert work.split_rows(per_job * 100) == 100
    assert work.split_rows(10**7) == service_module.MAX_ROWS_PER_SPLIT
    wide = (np.zeros((4, 256, 256), np.float32), np.arange(4))  # 256 KiB rows, and a label
    held = service_module.HELD_BYTES // (service_module.SPLITS_HELD * (256 * 256 * 4 + 8))
    assert service_module.ServiceWork(as_source(wide), None, 0).split_rows(10**7) == held


@pytest.mark.parametrize("transform", [scaled, jittered])
def test_a_jobs_graph_carries_its_source_rows_and_little_else(transform):
    """Every byte of a job's graph costs the dispatcher CPU and goes to every worker, so a
    row's tag and place are worked out on the worker: the graph holds the source rows, and
    each row's sample index where `transform` takes a seed (for its seed)."""
    length = 4096
    features, labels = records(length)
    work = service_module.ServiceWork(as_source((features, labels)), transform, seed=0)
    indices = np.random.default_rng(0).permutation(length)
    graph = dataset_graph(work._rows(indices, epoch=1, job=7))
    source_bytes = features.nbytes + labels.nbytes
    per_row = 8 if transform is jittered else 0
    assert graph.ByteSize() < source_bytes + per_row * length + 16384


def test_rows_of_another_job_served_under_a_reused_task_number_are_left_out():
    """A dispatcher restarted without a journal numbers its tasks from the start again, and a
    worker still holding a forgotten job's task of that number serves its rows to the new job
    (wrong samples at three rows of one step, in one CI simulation): a job takes only rows
    carrying its own number."""
    positions = np.array([5, 9, 12, 20])

    def served(number):
        other = (number + 1) % (1 << 31)
        for job, tags in ((other, [0, 1]), (number, [2, 0]), (other, [3]), (number, [1, 3])):
            tagged = (job << service_module.JOB_SHIFT) | np.array(tags, np.int64)
            yield tf.constant(tagged), tf.constant(np.array(tags, np.float32) * 10)

    job = producer_module._Job(served, positions)
    items = []
    while (item := job.get()) is not producer_module._Job.END:
        if item is not None:
            items.append([value.tolist() for value in item])
    job.thread.join(5.0)
    assert items == [[[12, 5], [20.0, 0.0]], [[9, 20], [10.0, 30.0]]]


@pytest.mark.parametrize(
    ("message", "forgotten"),
    [
        # How TensorFlow 2.21 ends what the client is told when it asks the restarted
        # dispatcher about a job it forgot.
        (
            "... not found. The dispatcher is not configured to be fault tolerant, so this "
            "could be caused by a dispatcher restart.",
            True,
        ),
        # What a worker passes on when the restarted dispatcher no longer knows the job's
        # iteration (the no_work_dir restart test met it in CI).
        (
            "Failed to get element from worker localhost:38175: Failed to get an element, with "
            "a nonretryable error: Failed to get element: Failed to get split: Iteration id "
            "2000 not found",
            True,
        ),
        # The transform's own NotFound (a missing file) is the user's error, never asked again.
        ("/data/cats/001.jpg; No such file or directory", False),
    ],
)
def test_a_job_forgotten_by_a_restarted_dispatcher_is_told_from_the_transforms_errors(
    message, forgotten
):
    assert producer_module._forgotten(tf.errors.NotFoundError(None, None, message)) is forgotten


def test_a_file_the_transform_cannot_find_reaches_the_loop_and_is_not_asked_again(
    service, devices, tmp_path, monkeypatch
):
    """TensorFlow's NotFound for a missing file, raised on a service worker, is the user's
    error: it reaches the loop naming the file, from the first job (a job a restarted
    dispatcher forgot would be asked for again, for up to DISPATCHER_LOST_S without a row),
    and no job's reader is left behind."""
    monkeypatch.setattr(producer_module, "DISPATCHER_LOST_S", 5.0)
    paths = [tmp_path / f"{index}.txt" for index in range(16)]
    for path in paths[:11] + paths[12:]:
        path.write_text(path.stem)

    def read(sample):
        path, label = sample
        return tf.strings.length(tf.io.read_file(path)), label

    arrays = (np.array([str(path) for path in paths]), np.arange(16))
    with fp.Feeder(
        arrays, 4, devices=devices[:1], transform=read, service=service.address
    ) as remote:
        with pytest.raises(tf.errors.NotFoundError, match=r"11\.txt") as missing:
            for _ in remote:
                pass
        jobs = remote._assembly.producer.jobs
    assert jobs == 1
    assert any("sample index 11 of epoch 0" in note for note in missing.value.__notes__)
    wait_for_the_readers_to_end(within_s=10.0)
