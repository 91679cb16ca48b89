"""errors="skip" on TensorFlow: a skipped sample's row weighs nothing in `as_dataset()`, even
where `remainder` pads nothing, and the real rows are scaled so the mean is over real ones; a
PyDataset batch that raises is skipped, the first one, read to learn the batch size, included."""

from __future__ import annotations

import numpy as np

import feedpipe as fp
from tests.fakes import index_pydataset, real_ids
from tests.worker_fakes import FailsOn


def test_as_dataset_weighs_a_skipped_row_zero_and_scales_the_real_ones(devices):
    x = np.stack([np.arange(16)] * 2, 1).astype(np.float32)
    y = np.arange(16, dtype=np.int32)
    with fp.Feeder(
        (x, y),
        8,
        devices=devices,
        remainder="drop",
        transform=FailsOn({5}),
        errors="skip",
        max_skipped=1,
    ) as feeder:
        padded = feeder.as_dataset(pad_last=True)
        batches = [(b[1].numpy().tolist(), b[2].numpy().tolist()) for b in padded]
    labels, weights = batches[0]
    assert [w for label, w in zip(labels, weights, strict=True) if w == 0] == [0.0]
    assert weights == [float(np.float32(8 / 7))] * 5 + [0.0] + [float(np.float32(8 / 7))] * 2
    assert batches[1][1] == [1.0] * 8


def test_a_pydataset_whose_first_batch_raises_is_skipped_within_the_budget(devices):
    source = index_pydataset(12, 4, broken={0})
    with fp.Feeder(source, 8, devices=devices, errors="skip", max_skipped=4) as feeder:
        assert [i for batch in feeder for i in real_ids(batch)] == list(range(4, 12))
        assert [s.index for s in feeder.stats().skipped] == [0, 1, 2, 3]
