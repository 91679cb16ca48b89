"""On a real GPU: a DALI pipeline with GPU stages hands its outputs over on each replica's GPU,
never through host memory, and they equal what the same pipeline gives alone (skipped without
a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import feedpipe as fp

tf = pytest.importorskip("tensorflow", reason="the TensorFlow GPU tests need TensorFlow")

from tests.fakes import load_example  # noqa: E402

pytestmark = pytest.mark.gpu
dali = pytest.importorskip("nvidia.dali", reason="DALI is not installed (feedpipe[dali])")
fn = pytest.importorskip("nvidia.dali.fn")
from feedpipe.dali import DaliSource  # noqa: E402

DLPACK_CUDA = 2
SIZE = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("images")
    made = load_example("make_image_folder").make_image_folder(root, 2, 12, 24, seed=5)
    return [path for path, _ in made]


def gpu_pipeline(files):
    """nvJPEG decoding ("mixed") and a GPU resize: every output is in GPU memory."""

    @dali.pipeline_def
    def pipeline(shard_id, num_shards):
        jpegs, labels = fn.readers.file(
            files=files,
            labels=list(range(len(files))),
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=True,
            name="reader",
        )
        images = fn.resize(fn.decoders.image(jpegs, device="mixed"), size=(SIZE, SIZE))
        return images, labels.gpu()

    return pipeline


def test_gpu_outputs_are_staged_on_each_replicas_gpu_without_a_host_round_trip(files, monkeypatch):
    from feedpipe.tf import stage

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    handed_over = []
    import_to_device = stage.import_to_device

    def recording(tensor, device):
        handed_over.append(tensor.__dlpack_device__()[0])
        return import_to_device(tensor, device)

    monkeypatch.setattr(stage, "import_to_device", recording)
    pipeline = gpu_pipeline(files)
    source = DaliSource(pipeline, seed=7)
    with fp.Feeder(source, 4 * len(gpus), devices=gpus) as feeder:
        batch = next(iter(feeder))
        assert set(handed_over) == {DLPACK_CUDA}
        assert feeder.stats().slots_allocated == 0
        for r, (images, labels) in enumerate(batch.replicas):
            assert images.device == gpus[r] and labels.device == gpus[r]
            alone = pipeline(
                shard_id=r,
                num_shards=len(gpus),
                batch_size=4,
                num_threads=2,
                device_id=r,
                seed=7 + r,
            )
            alone.build()
            want_images, want_labels = (out.as_cpu().as_array() for out in alone.run())
            assert np.array_equal(images.numpy(), want_images)
            assert np.array_equal(labels.numpy(), want_labels)
            del alone
        del batch


def test_a_kept_gpu_batch_from_dali_keeps_its_values(files):
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    with fp.Feeder(DaliSource(gpu_pipeline(files)), 2 * len(gpus), devices=gpus) as feeder:
        kept = next(iter(feeder))
        expected = [leaf.numpy().copy() for replica in kept.replicas for leaf in replica]
        for _ in range(3):  # more batches than DALI's queues and the feeder's ring hold
            for _batch in feeder:
                pass
        got = [leaf.numpy() for replica in kept.replicas for leaf in replica]
        assert all(np.array_equal(g, w) for g, w in zip(got, expected, strict=True))
        del kept
