"""The JAX feeder: each replica's rows on its own device, the global batch sharded over them,
every sample once per epoch in the core's order, and a plain-dict state that resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.processes import REPO_ROOT
from tests.worker_fakes import index_pairs


def test_the_feeder_of_jax_devices_stages_jax_arrays(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        assert feeder.layer.name == "jax"
        batch = next(iter(feeder))
        assert len(batch.replicas) == 4
        for device, (x, y), mask in zip(devices, batch.replicas, batch.masks, strict=True):
            assert isinstance(x, jax.Array) and x.devices() == {device}
            assert y.devices() == {device} and mask.devices() == {device}
            assert x.shape == (2, 2) and mask.shape == (2,)


def test_each_replica_gets_its_own_rows(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        for batch in feeder:
            for replica, (_, y) in enumerate(batch.replicas):
                first = batch.step * 8 + replica * 2
                assert np.asarray(y).tolist() == [first, first + 1]


def test_the_global_batch_is_sharded_along_axis_0_over_the_devices(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        (x, y), mask = batch.distributed()
        assert x.shape == (8, 2) and y.shape == (8,) and mask.shape == (8,)
        assert x.sharding == feeder.sharding
        assert [s.device for s in y.addressable_shards] == list(devices)
        assert np.asarray(y).tolist() == list(range(8))
        for shard, (_, replica_y) in zip(y.addressable_shards, batch.replicas, strict=True):
            # The replicas' arrays are the shards: no copy was made.
            assert shard.data.unsafe_buffer_pointer() == replica_y.unsafe_buffer_pointer()


def test_on_cpu_devices_a_batch_is_one_copy_of_its_slot_that_jax_wraps_as_it_is(devices):
    # One memcpy a batch: every shard of every field is a region of one aligned copy of the
    # slot, at the region's own offset; a shard JAX had copied again would lie elsewhere.
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        layout = feeder._assembly.pool(host=False).layout
        for batch in feeder:
            (x, y), _ = batch.distributed()
            base = x.addressable_data(0).unsafe_buffer_pointer() - layout.offsets[0][0]
            assert base % 64 == 0
            for replica in range(len(devices)):
                for field, array in enumerate((x, y)):
                    shard = array.addressable_data(replica)
                    assert shard.unsafe_buffer_pointer() == base + layout.offsets[replica][field]


def test_a_batch_staged_on_cpu_devices_is_ready_and_its_replicas_are_its_shards(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        for batch in feeder:
            (x, y), _ = batch.distributed()
            assert x.is_fully_replicated is False and x.is_ready() and y.is_ready()
            assert len(batch.replicas) == 4
            for replica, (rx, ry) in enumerate(batch.replicas):
                assert rx.devices() == {devices[replica]}
                assert (
                    np.asarray(ry).tolist() == np.asarray(y)[2 * replica : 2 * replica + 2].tolist()
                )
                assert (
                    rx.unsafe_buffer_pointer()
                    == x.addressable_data(replica).unsafe_buffer_pointer()
                )


def test_a_two_dimensional_mesh_takes_the_rows_in_its_device_order(devices):
    mesh = jax.sharding.Mesh(np.array(devices[::-1]).reshape(2, 2), ("data", "model"))
    with fp.Feeder(index_pairs(16), 8, devices=mesh) as feeder:
        for batch in feeder:
            (_x, y), mask = batch.distributed()
            first = batch.step * 8
            assert np.asarray(y).tolist() == list(range(first, first + 8))
            assert [s.device for s in y.addressable_shards] == list(devices[::-1])
            for shard in y.addressable_shards:
                rows = shard.index[0]
                assert np.asarray(shard.data).tolist() == list(
                    range(first + rows.start, first + rows.stop)
                )
            assert np.asarray(mask).all()


def test_a_mesh_given_is_the_sharding(devices):
    mesh = jax.sharding.Mesh(np.array(devices[::-1]), ("data",))
    with fp.Feeder(index_pairs(8), 8, devices=mesh) as feeder:
        (_x, y), _ = next(iter(feeder)).distributed()
        assert [s.device for s in y.addressable_shards] == list(devices[::-1])
        assert np.asarray(y).tolist() == list(range(8))


def test_another_sharding_moves_the_shards_there(devices):
    with fp.Feeder(index_pairs(8), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        replicated = jax.sharding.NamedSharding(feeder.layer.mesh, jax.sharding.PartitionSpec())
        (_x, y), _mask = batch.distributed(replicated)
        assert y.sharding == replicated and np.asarray(y).tolist() == list(range(8))


def test_pad_masks_exactly_the_padding_and_num_valid_counts_real_samples(devices):
    with fp.Feeder(index_pairs(10), 8, devices=devices) as feeder:
        batches = list(feeder)
        assert [b.num_valid for b in batches] == [8, 2]
        (_, y), mask = batches[1].distributed()
        assert np.asarray(mask).tolist() == [True] * 2 + [False] * 6
        assert np.asarray(y)[:2].tolist() == [8, 9]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_in_the_cores_order(devices, workers):
    length, size = 37, 8
    with fp.Feeder(
        index_pairs(length), size, devices=devices, shuffle=True, seed=3, workers=workers
    ) as feeder:
        plan = Sampler(length, size, shuffle=True, seed=3)
        for epoch in range(2):
            got = []
            for batch in feeder:
                (_, y), mask = batch.distributed()
                got += np.asarray(y)[np.asarray(mask)].tolist()
            expected = plan.order(epoch).tolist()
            assert got == expected
            assert sorted(got) == list(range(length))


def test_resume_mid_epoch_from_a_json_state_gives_the_same_stream(devices):
    source = index_pairs(40)

    def labels(batches):
        return [np.asarray(b.distributed()[0][1]).tolist() for b in batches]

    with fp.Feeder(source, 8, devices=devices, shuffle=True, seed=1) as whole:
        expected = labels(list(whole))
    with fp.Feeder(source, 8, devices=devices, shuffle=True, seed=1) as first:
        loop = iter(first)
        head = labels([next(loop), next(loop)])
        loop.close()
        state = json.loads(json.dumps(first.get_state()))
    assert state["step"] == 2
    with fp.Feeder(source, 8, devices=devices, shuffle=True, seed=1) as second:
        second.set_state(state)
        assert head + labels(list(second)) == expected


def test_a_restore_into_another_seed_names_the_field(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices, seed=1) as a:
        state = a.get_state()
    message = "the state has seed=1 but this feeder has seed=2"
    with (
        fp.Feeder(index_pairs(16), 8, devices=devices, seed=2) as b,
        pytest.raises(ValueError, match=message),
    ):
        b.set_state(state)


def test_a_global_batch_that_does_not_divide_among_the_devices_is_refused(devices):
    with pytest.raises(ValueError, match=r"`global_batch_size`=6 is not divisible by the 4"):
        fp.Feeder(index_pairs(16), 6, devices=devices)


def test_fields_passed_as_a_list_are_refused_naming_the_tuple_form(devices):
    x, y_onehot = np.zeros((1000, 10), np.float32), np.zeros((1000, 10), np.float32)
    with pytest.raises(ValueError, match=r"read as 2 samples.*fp\.Feeder\(\(x, y\), 64\)"):
        fp.Feeder([x, y_onehot], 64, devices=devices)


def test_a_global_batch_larger_than_the_dataset_warns_at_the_callers_line(devices):
    with pytest.warns(
        UserWarning,
        match=r"`global_batch_size`=64 is larger than the dataset "
        r"\(37 samples\)",
    ) as caught:
        fp.Feeder(np.zeros((37, 2), np.float32), 64, devices=devices).close()
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_global_batch_whose_slots_cannot_be_mapped_is_refused_before_allocating(devices, workers):
    # 10**12 rows of 40 bytes: terabytes of slots, more than any host has (the leak check
    # sees the worker started before the refusal closed).
    with (
        pytest.warns(UserWarning, match="larger than the dataset"),
        pytest.raises(ValueError, match=r"`global_batch_size`=1000000000000 needs .* TiB of host"),
    ):
        fp.Feeder(np.zeros((37, 10), np.float32), 10**12, devices=devices, workers=workers)


def test_a_strategy_mixed_devices_or_an_unknown_framework_are_refused(devices):
    with pytest.raises(TypeError, match=r"must be a tf\.distribute strategy"):
        fp.Feeder(index_pairs(16), 8, strategy=object())
    with pytest.raises(TypeError, match="one kind only"):
        fp.Feeder(index_pairs(16), 8, devices=[devices[0], "/cpu:0"])
    with pytest.raises(ValueError, match="`framework`='mxnet' must be one of"):
        fp.Feeder(index_pairs(16), 8, framework="mxnet")


def test_the_jax_path_never_imports_tensorflow():
    code = (
        "import sys, numpy as np, jax, feedpipe as fp\n"
        "assert 'tensorflow' not in sys.modules\n"
        "x = np.arange(20, dtype=np.float32)\n"
        "with fp.Feeder(x, 4, devices=jax.devices(), workers=1) as f:\n"
        "    total = sum(float(b.distributed()[0].sum()) for b in f)\n"
        "    f.set_state(f.get_state())\n"
        "    str(f.stats())\n"
        "assert total == x.sum(), total\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_import_feedpipe_imports_no_framework():
    code = (
        "import sys, feedpipe, feedpipe.core.state, feedpipe.core.pinned, feedpipe.feeder\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'jax', 'jaxlib', 'torch'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_jax_batch_is_an_fp_batch_and_asking_loads_no_tensorflow():
    # Runs where TensorFlow is installed and where it is not (the CI's JAX step): either way
    # fp.Batch is the framework-neutral type, and nothing loads TensorFlow.
    code = (
        "import sys, numpy as np, feedpipe as fp\n"
        "batch_type = fp.Batch\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'jax', 'jaxlib'))\n"
        "assert not heavy, heavy[:5]\n"
        "import jax\n"
        "with fp.Feeder(np.arange(8, dtype=np.float32), 4, devices=jax.devices()) as f:\n"
        "    batch = next(iter(f))\n"
        "assert isinstance(batch, fp.Batch), type(batch).__mro__\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_stats_on_cpu_devices_report_no_copies(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        list(feeder)
        stats = feeder.stats()
    assert stats.steps == 2 and stats.copies == 0 and stats.page_locked is None
    assert "copies" not in str(stats)


@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_batches_wait_and_depth_plus_two_slots_hold_them(devices, depth):
    with fp.Feeder(index_pairs(48), 8, devices=devices, depth=depth) as feeder:
        seen = []
        for _ in range(2):
            for _batch in feeder:
                time.sleep(0.01)  # the producer runs ahead until the staged batches fill up
                seen.append(feeder._assembly.pipeline.handoff.staged)
        assert max(seen) == depth
        assert feeder.stats().slots_allocated <= depth + 2
        assert feeder.stats().overflow_slots == 0


def test_a_kept_batch_keeps_its_values_while_its_slot_would_be_reused(devices):
    # Slots are written again while earlier batches are kept: those must keep their values.
    with fp.Feeder(index_pairs(64), 8, devices=devices, depth=1) as feeder:
        kept = []
        for _ in range(2):
            for batch in feeder:
                if batch.step % 2 == 0:
                    kept.append((batch.step, batch.replicas[2][1], batch.distributed()[0][1]))
        assert len(kept) == 8
        for step, replica_labels, global_labels in kept:
            assert np.asarray(replica_labels).tolist() == [step * 8 + 4, step * 8 + 5]
            assert np.asarray(global_labels).tolist() == list(range(step * 8, step * 8 + 8))


def test_on_cpu_devices_a_kept_batch_holds_no_slot(devices):
    # The regions are copied out on a CPU device, so the slot returns once its batch is staged.
    with fp.Feeder(index_pairs(64), 8, devices=devices, depth=1) as feeder:
        kept = list(feeder)
        stats = feeder.stats()
    assert len(kept) == 8
    assert stats.overflow_slots == 0 and stats.slots_allocated <= 3


def test_a_loop_on_another_thread_while_one_runs_is_refused(devices):
    with fp.Feeder(index_pairs(32), 8, devices=devices) as feeder:
        loop = iter(feeder)
        next(loop)
        errors = []
        other = threading.Thread(target=lambda: errors.append(_first_error(feeder)))
        other.start()
        other.join(10)
        assert errors and "already being iterated" in errors[0]
        loop.close()


def _first_error(feeder) -> str:
    try:
        next(iter(feeder))
    except RuntimeError as error:
        return str(error)
    return ""


def test_a_source_error_reaches_the_loop_with_its_type_and_the_sample(devices):
    class Broken:
        def __len__(self):
            return 40

        def __getitem__(self, index):
            if index == 21:
                raise KeyError(f"no record {index}")
            return np.full(3, index, np.float32)

    with fp.Feeder(Broken(), 8, devices=devices) as feeder, pytest.raises(KeyError) as caught:
        list(feeder)
    assert "no record 21" in str(caught.value)
    assert any("sample index 21" in note for note in caught.value.__notes__)
