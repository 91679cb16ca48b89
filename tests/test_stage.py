"""Stage: devices are resolved by name and refused when unknown, and a staged tensor holds
exactly the host rows, on its own device, without the host memory being reused under it."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe.core.sampler import Step
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit
from feedpipe.core.stage import HostStager
from feedpipe.tf.batch import Batch
from feedpipe.tf.devices import resolve_devices
from feedpipe.tf.stage import Stager, to_device


def test_devices_resolve_to_full_names(devices):
    resolved = resolve_devices(devices, None)
    assert [name.split("/")[-1] for name in resolved] == [f"device:CPU:{i}" for i in range(4)]
    assert resolve_devices(["/CPU:2", "cpu:0"], None)[0].endswith("CPU:2")


def test_default_devices_are_the_gpus_else_the_first_cpu():
    resolved = resolve_devices(None, None)
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        assert resolved == tuple(d.name for d in gpus)
    else:
        assert len(resolved) == 1 and resolved[0].endswith("CPU:0")


def test_a_strategy_supplies_its_replica_devices(strategy):
    assert [d[-5:] for d in resolve_devices(None, strategy)] == [f"CPU:{i}" for i in range(4)]


def test_devices_that_disagree_with_the_strategy_are_refused(strategy):
    with pytest.raises(ValueError, match=r"`devices` lists 2 devices but `strategy` has 4"):
        resolve_devices(["/cpu:0", "/cpu:1"], strategy)


@pytest.mark.parametrize("device", ["/cpu:4", "/cpu:9", "/gpu:0", "/device:XLA:3", "nonsense"])
def test_an_unknown_device_is_refused_with_the_list_of_devices(device):
    with pytest.raises(
        ValueError,
        match=rf"`devices` names '{device}', which is not a device of "
        r"this process; the devices are .*CPU:0",
    ):
        resolve_devices(["/cpu:0", device], None)


def test_an_empty_device_list_is_refused():
    with pytest.raises(ValueError, match=r"`devices` is empty"):
        resolve_devices([], None)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.int64, np.uint8, np.bool_, np.float16, ml_dtypes.bfloat16]
)
def test_to_device_keeps_every_bit_and_lands_on_the_device(devices, dtype):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, 64, dtype=np.uint8).view(np.dtype(dtype).newbyteorder("="))
    if dtype is np.bool_:
        array = array.view(np.uint8) % 2 == 1
    array = array.reshape(4, -1)
    tensor = to_device(array, resolve_devices(devices, None)[3])
    assert tensor.device.endswith("CPU:3")
    assert tensor.dtype == tf.as_dtype(array.dtype)
    assert tensor.numpy().tobytes() == array.tobytes()


def staged_batch(devices, num_valid=5):
    spec = SampleSpec.of((np.zeros(2, np.float32), np.int64(0)))
    split = ReplicaSplit(8, 4)
    slot = HostSlot(SlotLayout(spec, split))
    slot.write_rows(0, [np.arange(16, dtype=np.float32).reshape(8, 2), np.arange(8)], 0, 8)
    freed = []
    stager = Stager(resolve_devices(devices, None), slot.layout)
    batch = stager.stage(Step(0, 0, np.arange(8), num_valid), slot.lease(freed.append))
    return batch, stager, slot, freed


def test_stager_places_each_replica_and_mask_on_its_device(devices):
    batch, *_ = staged_batch(devices)
    assert batch.num_valid == 5
    for r, ((features, labels), mask) in enumerate(zip(batch.replicas, batch.masks, strict=True)):
        assert features.device.endswith(f"CPU:{r}") and labels.device.endswith(f"CPU:{r}")
        assert mask.device.endswith(f"CPU:{r}") and mask.dtype == tf.bool
        assert labels.numpy().tolist() == [2 * r, 2 * r + 1]
        assert mask.numpy().tolist() == [2 * r < 5, 2 * r + 1 < 5]
    assert "num_valid=5" in repr(batch)


def test_staging_on_a_cpu_device_copies_nothing(devices):
    # The staged tensors are the slot's own memory: a write into the slot shows through them.
    batch, _, slot, _ = staged_batch(devices)
    for r, (_, labels) in enumerate(batch.replicas):
        slot.regions[r][1][0] = 100 + r
        assert labels.numpy()[0] == 100 + r


def test_the_slot_is_freed_only_after_every_staged_tensor_is_gone(devices):
    batch, _, slot, freed = staged_batch(devices)
    first_replica = batch.replicas[0]
    del batch
    gc.collect()
    assert freed == [], "a live tensor must keep its slot leased"
    assert first_replica[1].numpy().tolist() == [0, 1]
    del first_replica
    gc.collect()
    assert freed == [slot]


def test_masks_are_cached_per_num_valid(devices):
    _, stager, *_ = staged_batch(devices)
    assert stager.masks(Step(0, 0, None, 5)) is stager.masks(Step(1, 3, None, 5))
    assert [m.numpy().tolist() for m in stager.masks(Step(0, 0, None, 8))] == [[True, True]] * 4


def test_masks_follow_each_replicas_own_real_rows(devices):
    _, stager, *_ = staged_batch(devices)
    step = Step(0, 0, None, 5, replica_valid=(2, 1, 0, 2))
    masks = [m.numpy().tolist() for m in stager.masks(step)]
    assert masks == [[True, True], [True, False], [False, False], [True, True]]


def test_a_host_batch_marks_each_replicas_own_real_rows_with_one_read_only_mask():
    spec = SampleSpec.of((np.zeros(2, np.float32), np.int64(0)))
    layout = SlotLayout(spec, ReplicaSplit(8, 4), contiguous=True)
    stager = HostStager(layout)
    step = Step(0, 0, None, 5, replica_valid=(2, 1, 0, 2))
    first = stager.stage(step, HostSlot(layout).buffer)
    again = stager.stage(Step(1, 0, None, 5, replica_valid=(2, 1, 0, 2)), HostSlot(layout).buffer)
    assert first.real.tolist() == [True, True, True, False, False, False, True, True]
    assert again.real is first.real and not first.real.flags.writeable
    assert stager.stage(Step(0, 1, None, 5), HostSlot(layout).buffer).real is None


def test_distributed_needs_a_strategy(devices):
    batch, *_ = staged_batch(devices)
    with pytest.raises(ValueError, match=r"Batch.distributed\(\) needs a tf.distribute strategy"):
        batch.distributed()


def test_batch_exposes_its_position():
    batch = Batch((), (), 3, epoch=2, step=7)
    assert (batch.epoch, batch.step, batch.num_valid) == (2, 7, 3)


@pytest.mark.parametrize(
    ("dtype", "rule"),
    [
        (np.dtype(">f4"), "non-native byte order"),
        (np.dtype(">i8"), "non-native byte order"),
        (ml_dtypes.float8_e4m3fn, "TensorFlow cannot stage"),
        (ml_dtypes.float8_e5m2, "TensorFlow cannot stage"),
        (ml_dtypes.int4, "TensorFlow cannot stage"),
    ],
)
def test_a_field_tensorflow_cannot_hold_is_refused_at_construction_naming_it(devices, dtype, rule):
    features, labels = np.zeros((8, 3), np.float32), np.zeros((8, 2), dtype)
    with pytest.raises(TypeError, match=rf"^Field \[1\] .*{rule}"):
        fp.Feeder((features, labels), 4, devices=devices)
