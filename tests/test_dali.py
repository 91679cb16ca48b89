"""DALI pipelines as a feeder source: CPU-only pipelines (device_id=None) feeding 4 logical
devices. Every label is its file's index, so a batch tells which files it delivered."""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp

dali = pytest.importorskip("nvidia.dali", reason="DALI is not installed (feedpipe[dali])")
fn = pytest.importorskip("nvidia.dali.fn")
from feedpipe.dali import DaliSource  # noqa: E402
from tests.fakes import load_example  # noqa: E402

SIZE = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """19 JPEGs of various sizes: no global batch of 8 divides them."""
    root = tmp_path_factory.mktemp("images")
    generator = load_example("make_image_folder")
    made = generator.make_image_folder(root, classes=2, per_class=10, size=24, seed=3)
    return [path for path, _ in made][:19]


def indexed_images(files, *, shuffle=False, names=None, resize=True, pad=True):
    """A pipeline reading `files` with each file's index as its label."""

    @dali.pipeline_def
    def pipeline(shard_id, num_shards):
        jpegs, labels = fn.readers.file(
            files=files,
            labels=list(range(len(files))),
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=pad,
            random_shuffle=shuffle,
            name="reader",
        )
        images = fn.decoders.image(jpegs, device="cpu")
        if resize:
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        return images, labels

    return DaliSource(pipeline, names=names)


def delivered(feeder, epochs=1) -> list[list[int]]:
    """The real file indices each epoch delivered, read through the masks."""
    seen = []
    for _ in range(epochs):
        ids = []
        for batch in feeder:
            for (_, labels), mask in zip(batch.replicas, batch.masks, strict=True):
                ids += labels.numpy().ravel()[mask.numpy()].tolist()
        seen.append(ids)
    return seen


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_file_is_read_exactly_once_per_epoch_across_the_replicas(files, devices, shuffle):
    with fp.Feeder(indexed_images(files, shuffle=shuffle), 8, devices=devices) as feeder:
        assert len(feeder) == 3
        for ids in delivered(feeder, epochs=2):
            assert collections.Counter(ids) == collections.Counter(range(len(files)))


def test_batches_have_the_declared_shapes_dtypes_and_devices(files, devices):
    with fp.Feeder(indexed_images(files), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        for device, (images, labels) in zip(devices, batch.replicas, strict=True):
            assert images.shape == (2, SIZE, SIZE, 3) and images.dtype == tf.uint8
            assert labels.shape == (2, 1) and labels.dtype == tf.int32
            assert tf.DeviceSpec.from_string(images.device).device_index == int(device[-1])
        del batch


def buffer_address(tensor: tf.Tensor) -> int:
    """Where a host tensor's values live, read through DLPack."""

    class Exported:
        def __dlpack__(self, **_):
            return tf.experimental.dlpack.to_dlpack(tensor)

        def __dlpack_device__(self):
            return (1, 0)

    return np.from_dlpack(Exported()).ctypes.data


def test_host_outputs_are_staged_in_dalis_own_memory_without_a_copy(files, devices, monkeypatch):
    from feedpipe.tf import stage

    dali_addresses = []
    import_to_device = stage.import_to_device

    def recording(tensor, device):
        dali_addresses.append(tensor.data_ptr())
        return import_to_device(tensor, device)

    monkeypatch.setattr(stage, "import_to_device", recording)
    with fp.Feeder(indexed_images(files), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        staged = [buffer_address(leaf) for replica in batch.replicas for leaf in replica]
        # the staging thread runs ahead: later batches may already be recorded after this one
        assert staged == dali_addresses[: len(staged)]
        assert feeder.stats().slots_allocated == 0
        del batch


def test_a_kept_batch_keeps_its_values_while_the_pipelines_run_on(files, devices):
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices, depth=1) as feeder:
        kept = [next(iter(feeder))]
        expected = [[leaf.numpy().copy() for leaf in replica] for replica in kept[0].replicas]
        for _ in range(3):  # more epochs than DALI's queues hold batches
            kept += list(feeder)
        values = [[leaf.numpy() for leaf in replica] for replica in kept[0].replicas]
        for got, want in zip(values, expected, strict=True):
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
        del kept


@pytest.mark.clock
@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_dali_batches_wait_staged(files, devices, depth):
    # 19 files, 5 batches an epoch: while the step holds an epoch's first batch, DALI and the
    # producer run ahead until the ring is full, however long a loaded machine makes that.
    with fp.Feeder(indexed_images(files), 4, devices=devices, depth=depth) as feeder:
        seen = []
        for _ in range(2):
            for index, _batch in enumerate(feeder):
                handoff = feeder._assembly.pipeline.handoff
                deadline = time.monotonic() + 30
                while index == 0 and handoff.staged < depth and time.monotonic() < deadline:
                    time.sleep(0.01)
                seen.append(handoff.staged)
    assert max(seen) == depth and seen[0] == depth


def test_a_closed_dali_feeder_leaves_no_thread_of_its_pipelines(files, devices):
    def threads() -> int:  # every thread of the process, DALI's C++ workers included
        return len(os.listdir("/proc/self/task"))

    counts = []
    for _ in range(3):
        with fp.Feeder(indexed_images(files), 8, devices=devices) as feeder:
            delivered(feeder)
        gc.collect()
        counts.append(threads())
    assert counts[2] == counts[1] == counts[0]


def test_the_last_batch_masks_exactly_the_rows_dali_padded(files, devices):
    with fp.Feeder(indexed_images(files), 8, devices=devices) as feeder:
        batches = list(feeder)
        last = batches[-1]
        assert sum(b.num_valid for b in batches) == len(files)
        real = np.concatenate([m.numpy() for m in last.masks])
        assert real.sum() == last.num_valid == len(files) - 16
        del batches, last


def test_drop_ends_the_epoch_at_the_last_full_step(files, devices):
    with (
        pytest.warns(UserWarning, match="leaves out the last 3 of 19"),
        fp.Feeder(indexed_images(files), 8, devices=devices, remainder="drop") as feeder,
    ):
        assert len(feeder) == 2
        for ids in delivered(feeder, epochs=2):
            assert len(ids) == len(set(ids)) == 16


def test_error_refuses_a_file_count_the_global_batch_does_not_divide(files, devices):
    with pytest.raises(ValueError, match="remainder"):
        fp.Feeder(indexed_images(files), 8, devices=devices, remainder="error")


def test_as_dataset_weighs_exactly_the_rows_dali_padded_zero(files, devices):
    with fp.Feeder(indexed_images(files), 8, devices=devices) as feeder:
        real_ids = []
        for _, labels, weights in feeder.as_dataset(pad_last=True):
            weights = weights.numpy().ravel()  # shaped [batch, 1] like the labels
            real_ids += labels.numpy().ravel()[weights > 0].tolist()
            assert weights.sum() == pytest.approx(8.0)  # the mean over the real rows
    assert sorted(real_ids) == list(range(len(files)))


def test_named_outputs_become_dict_samples(files, devices):
    source = indexed_images(files, names=("image", "label"))
    with fp.Feeder(source, 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        assert set(batch.replicas[0]) == {"image", "label"}
        del batch


def test_a_resumed_feeder_continues_the_same_stream(files, devices):
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices) as feeder:
        whole = delivered(feeder, epochs=2)
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices) as feeder:
        for step, batch in enumerate(feeder):
            if step == 0:
                state = feeder.get_state()
                del batch
                break
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices) as feeder:
        feeder.set_state(state)
        rest = delivered(feeder, epochs=2)
    assert rest[0] == whole[0][-len(rest[0]) :]
    assert rest[1] == whole[1]


def test_a_checkpointed_feeder_continues_the_same_augmented_stream_without_replay(
    files, devices, monkeypatch
):
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices) as feeder:
        whole = [b.replicas[0][0].numpy() for _ in range(2) for b in feeder]
    with fp.Feeder(indexed_images(files, shuffle=True), 8, devices=devices) as feeder:
        for step, batch in enumerate(feeder):
            if step == 1:
                state = json.loads(json.dumps(feeder.get_state()))
                del batch
                break
    assert len(state["source"]) == len(devices)
    source = indexed_images(files, shuffle=True)
    built_from = []
    build = source.build
    monkeypatch.setattr(source, "build", lambda *args: built_from.append(args[-1]) or build(*args))
    with fp.Feeder(source, 8, devices=devices) as feeder:
        feeder.set_state(state)
        rest = [b.replicas[0][0].numpy() for _ in range(2) for b in feeder]
    # Built from DALI's checkpoints, not replayed from the seed.
    assert built_from[: len(devices)] and all(built_from[: len(devices)])
    assert len(rest) == len(whole) - 2
    for got, expected in zip(rest, whole[2:], strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_pipeline_dali_cannot_checkpoint_feeds_but_get_state_says_why(files, devices):
    """DALI refuses checkpointing at build time for some readers (the FITS reader raises this
    message; it needs CUDA, so a wrapper raises it here for the readers this machine runs)."""
    pipeline = indexed_images(files).pipeline

    def uncheckpointable(**options):
        if options["enable_checkpointing"]:
            raise RuntimeError("Fits reader does not support checkpointing.")
        return pipeline(**options)

    with fp.Feeder(DaliSource(uncheckpointable), 8, devices=devices) as feeder:
        assert collections.Counter(delivered(feeder)[0]) == collections.Counter(range(len(files)))
        with pytest.raises(RuntimeError, match=r"DALI cannot checkpoint this pipeline \(Fits"):
            feeder.get_state()


def test_outputs_that_do_not_match_the_declared_names_are_refused(files):
    with pytest.raises(ValueError, match=r"returns 2 outputs but `names` declares 3"):
        indexed_images(files, names=("image", "label", "extra"))


def test_outputs_of_varying_shapes_are_a_clear_error_naming_the_output(files, devices):
    with (
        fp.Feeder(indexed_images(files, resize=False), 8, devices=devices) as feeder,
        pytest.raises(
            ValueError, match=r"Output 0 of the pipeline has samples of different shapes"
        ),
    ):
        delivered(feeder)


def test_a_reader_without_padding_is_refused(files):
    with pytest.raises(ValueError, match="pad_last_batch=True"):
        indexed_images(files, pad=False)


def test_workers_and_transforms_are_refused_for_dali(files):
    with pytest.raises(ValueError, match="DALI's own threads"):
        fp.Feeder(indexed_images(files), 8, devices=["/cpu:0"], workers=2)


def test_missing_dali_says_how_to_install(monkeypatch):
    import feedpipe.dali as module

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(ImportError, match=r"pip install feedpipe\[dali\]"):
        module.DaliSource(lambda **_: None)


def test_diagnose_suggests_dali_threads_not_workers_for_a_dali_feeder(files):
    from feedpipe.diagnostics import diagnosis

    source = DaliSource(indexed_images(files).pipeline, num_threads=1)
    with fp.Feeder(source, 8, devices=["/cpu:0"]) as feeder:
        measured = diagnosis.Diagnosis(
            "dali",
            "step",
            1024,
            (0.1,) * 5,
            (0.01,) * 5,
            (diagnosis.StepTiming(0.1, 0.01, None),) * 5,
            False,
        )
        remedies = diagnosis.rank_remedies(
            measured, feeder, cores=4, memcpy_s=1e-4, memory_bytes=2**34, image_like=True
        )
    actions = [r.action for r in remedies]
    assert any(a.startswith("more DALI threads: DaliSource(..., num_threads=4)") for a in actions)
    assert not any("workers" in a or "decode and augment" in a for a in actions), actions
