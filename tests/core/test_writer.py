"""The per-sample work, wherever it runs: each sample is checked against the first (a wrong one
names its index and field), written to its global row across the replicas' regions, given an
rng or seed drawn from (seed, epoch, index) alone, and an error in user code keeps its type and
gets a note naming the sample."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from feedpipe.core.sampler import Step
from feedpipe.core.skips import ErrorPolicy
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.sources import ArraySource, GeneratorSource, MapSource
from feedpipe.core.split import ReplicaSplit
from feedpipe.core.writer import (
    RNG,
    SEED,
    RowStream,
    SampleWriter,
    first_look,
    raise_noted,
    randomness,
    sample_seeds,
)
from tests.worker_fakes import (
    BadSample,
    FailingSource,
    FailsOn,
    IndexSource,
    SourceBroke,
    StopIterationSource,
    WrongShapeAt,
    index_arrays,
    index_sample,
    sharded_range,
    to_channels_last,
)


def writer_of(source, transform=None, seed=0, axes=None) -> SampleWriter:
    spec, _ = first_look(source, transform, seed)
    return SampleWriter(source, spec, transform, seed, axes)


def slot_of(writer: SampleWriter, global_batch: int = 6, replicas: int = 3) -> HostSlot:
    return HostSlot(SlotLayout(writer.out_spec, ReplicaSplit(global_batch, replicas)))


def labels(slot: HostSlot) -> list[int]:
    """The label field of every global row, in row order."""
    return [int(v) for replica in slot.regions for v in replica[-1]]


def note(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


def test_a_sample_of_another_shape_names_its_index_its_field_and_both_shapes():
    writer = writer_of(MapSource(WrongShapeAt(8, at=5)))
    with pytest.raises(ValueError) as info:
        writer.read(5, epoch=1)
    assert str(info.value).startswith(
        "Field [0] of sample 5 has shape (4,) and dtype float32, but the first sample had "
        "shape (3,) and dtype float32; make every sample the same shape and dtype"
    )
    assert "while checking sample index 5 of epoch 1" in note(info.value)


def test_a_sample_of_another_dtype_names_its_index_and_field():
    def label_int32_at_3(sample):
        return (sample[0], np.int32(sample[1])) if int(sample[1]) == 3 else sample

    writer = writer_of(MapSource(IndexSource(8)), transform=label_int32_at_3)
    assert len(writer.read(2, epoch=0)) == 2
    with pytest.raises(ValueError) as info:
        writer.read(3, epoch=0)
    assert str(info.value).startswith(
        "Field [1] of sample 3 has shape () and dtype int32, but the first sample had shape () "
        "and dtype int64"
    )


def test_a_sample_of_another_structure_names_both_structures():
    writer = writer_of(MapSource(IndexSource(8)), transform=lambda s: s[0] if s[1] == 4 else s)
    with pytest.raises(ValueError, match=r"^Sample 4 has structure .*, but the first sample had"):
        writer.read(4, epoch=0)


def test_a_source_error_keeps_its_type_and_gets_a_note_naming_thread_and_sample():
    writer = writer_of(MapSource(FailingSource(8, fail_at=6)))
    with pytest.raises(SourceBroke) as info:
        writer.read(6, epoch=2)
    assert info.value.args == ("sample 6 is broken",)
    thread = threading.current_thread().name
    assert f"raised in {thread} while producing sample index 6 of epoch 2." in note(info.value)


def test_a_stop_iteration_from_user_code_becomes_an_error_that_says_so():
    writer = writer_of(MapSource(StopIterationSource(8, at=3)))
    with pytest.raises(
        RuntimeError, match=r"^User code raised StopIteration\('no more rows'\)"
    ) as info:
        writer.read(3, epoch=0)
    assert isinstance(info.value.__cause__, StopIteration)
    assert "while producing sample index 3 of epoch 0" in note(info.value)


def test_an_error_reading_sample_zero_says_it_was_learning_the_structure():
    with pytest.raises(SourceBroke) as info:
        first_look(MapSource(FailingSource(8, fail_at=0)), None, seed=0)
    assert "while reading sample 0 to learn the structure" in note(info.value)


def test_under_skip_the_structure_is_learned_from_the_first_sample_that_reads_within_budget():
    failing = MapSource(FailingSource(8, fail_at=0))
    spec, _ = first_look(failing, None, seed=0, policy=ErrorPolicy("skip", 1))
    assert [leaf.shape for leaf in spec.leaves] == [(3,), ()]
    with pytest.raises(BadSample) as info:
        first_look(
            MapSource(IndexSource(8)), FailsOn({0, 1}), seed=0, policy=ErrorPolicy("skip", 1)
        )
    assert "sample 1 is corrupt" in str(info.value)
    assert 'errors="skip" would skip 2 samples of epoch 0 (indices 0, 1)' in note(info.value)
    assert "max_skipped=1 allows (1 per epoch)" in note(info.value)


@pytest.mark.parametrize(
    ("transform", "kind"),
    [
        (lambda sample: sample, None),
        (lambda sample, rng: sample, RNG),
        (lambda sample, random_state: sample, RNG),
        (lambda sample, seed: sample, SEED),
        (lambda sample, rng, extra: sample, None),
    ],
    ids=["sample", "rng", "any-other-name", "seed", "three-arguments"],
)
def test_the_second_parameters_name_chooses_rng_or_seed(transform, kind):
    assert randomness(transform) == kind


def test_a_seed_is_a_function_of_seed_epoch_and_index_alone():
    np.testing.assert_array_equal(
        sample_seeds(7, 2, np.array([0, 5])), [[7, 2 << 40], [7, (2 << 40) + 5]]
    )


def test_a_transforms_rng_draws_depend_on_seed_epoch_and_index_not_on_the_reading_order():
    def draw(sample, rng):
        return np.float64(rng.uniform()), sample[1]

    def read(order, epoch=1, seed=3):
        writer = writer_of(MapSource(IndexSource(8)), transform=draw, seed=seed)
        return {index: float(writer.read(index, epoch)[0]) for index in order}

    forwards = read([2, 5, 7])
    assert forwards == read([7, 5, 2])
    assert forwards != read([2, 5, 7], epoch=2)
    assert forwards != read([2, 5, 7], seed=4)


@pytest.mark.parametrize(
    "source",
    [ArraySource(index_arrays(20)), MapSource(IndexSource(20))],
    ids=["arrays-gathered-at-once", "map-style-one-by-one"],
)
def test_rows_are_written_to_their_global_rows_across_the_replicas(source):
    writer = writer_of(source)
    slot = slot_of(writer)
    slot.buffer[...] = 0
    writer.fill_rows(slot, 0, 1, np.array([10, 11, 12, 13]))  # rows 1..4: replicas 0, 1 and 2
    assert labels(slot) == [0, 10, 11, 12, 13, 0]
    for row, index in enumerate([10, 11, 12, 13], start=1):
        np.testing.assert_array_equal(slot.row(0, row)[0], index_sample(index)[0])


def test_a_partial_batch_is_padded_by_repeating_its_real_rows_in_order():
    writer = writer_of(MapSource(IndexSource(20)))
    slot = slot_of(writer)
    writer.fill(slot, Step(0, 4, np.array([17, 18, 19, 16]), 4))
    assert labels(slot) == [17, 18, 19, 16, 17, 18]


def test_transposed_fields_are_written_in_the_asked_layout():
    writer = writer_of(
        MapSource(IndexSource(6)), transform=to_channels_last, axes=[(2, 0, 1), None]
    )
    assert [leaf.shape for leaf in writer.out_spec.leaves] == [(4, 2, 3), ()]
    slot = slot_of(writer, global_batch=2, replicas=1)
    writer.fill_rows(slot, 0, 0, np.array([3, 5]))
    for row, index in enumerate([3, 5]):
        expected = to_channels_last((None, index))["image"].transpose(2, 0, 1)
        np.testing.assert_array_equal(slot.row(0, row)[0], expected)


def test_a_stream_fills_whole_batches_then_the_count_of_its_last_rows():
    writer = writer_of(GeneratorSource(sharded_range(10)))
    rows = RowStream(writer, epoch=0, block_rows=4)
    counts, seen = [], []
    for _ in range(4):
        slot = slot_of(writer, global_batch=4, replicas=2)
        counts.append(rows.read_into(slot))
        seen.append(labels(slot)[: counts[-1]])
    assert counts == [4, 4, 2, 0]
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []]


def test_a_resumed_stream_skips_exactly_the_rows_taken():
    writer = writer_of(GeneratorSource(sharded_range(10)))
    rows = RowStream(writer, epoch=0, block_rows=4)
    rows.skip(6)
    slot = slot_of(writer, global_batch=4, replicas=2)
    assert rows.read_into(slot) == 4
    assert labels(slot) == [6, 7, 8, 9]


def test_a_streams_error_names_the_sample_it_reached():
    def broken(shard, num_shards):
        yield from sharded_range(6)(shard, num_shards)
        raise SourceBroke("generator broke after 6")

    writer = writer_of(GeneratorSource(broken))
    rows = RowStream(writer, epoch=3, block_rows=4)
    assert rows.read_into(slot_of(writer, global_batch=4, replicas=2)) == 4
    with pytest.raises(SourceBroke) as info:
        rows.read_into(slot_of(writer, global_batch=4, replicas=2))
    assert info.value.args == ("generator broke after 6",)
    assert "while producing sample index 6 of epoch 3" in note(info.value)


class Unreprable:
    def __repr__(self):
        raise ValueError("this __repr__ is broken")


def test_a_stop_iteration_carrying_a_value_whose_repr_raises_is_named():
    with pytest.raises(RuntimeError, match=r"raised StopIteration\(Unreprable\)") as raised:
        raise_noted(StopIteration(Unreprable()), "producing sample", 3, 0)
    assert "index 3 of epoch 0" in raised.value.__notes__[0]
