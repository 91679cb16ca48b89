"""`as_dataset()` over arrays in memory: TensorFlow's threads gather the feeder's own batches,
and they are the batches, weights and positions of the feeder's own path."""

from __future__ import annotations

import gc
import itertools
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from tests.processes import run_as_a_user


def handed_over(monkeypatch) -> None:
    """Every later feeder's `as_dataset()` hands its batches over from the feeder's thread."""
    monkeypatch.setattr("feedpipe.tf.feeder.GATHER_MAX_BYTES", -1)


def sources(length: int) -> dict:
    rows = np.arange(length)
    x = np.stack([rows, -rows], axis=1).astype(np.float32)
    return {
        "(x, y)": (x, (rows % 3).astype(np.int64)[:, None]),
        "(x, per-pixel y)": (x, np.repeat(rows, 4).reshape(length, 2, 2).astype(np.int32)),
        "dict": {"image": x, "label": rows.astype(np.int64)},
        "one array": x,
        "(x, nested y)": (x, {"a": rows.astype(np.float64), "b": x}),
    }


def two_epochs(feeder: fp.Feeder, pad_last: bool = False) -> list:
    dataset = feeder.as_dataset(pad_last=pad_last)
    return [tf.nest.map_structure(np.asarray, element) for _ in range(2) for element in dataset]


@pytest.mark.filterwarnings('ignore:remainder="drop" leaves out')
@pytest.mark.parametrize("pad_last", [False, True], ids=["real rows", "pad_last"])
@pytest.mark.parametrize("kind", list(sources(4)))
@pytest.mark.parametrize(
    ("length", "remainder", "shuffle"),
    [(40, "pad", True), (37, "pad", True), (37, "pad", False), (37, "drop", True)],
)
def test_gathered_batches_are_the_feeders_own(
    monkeypatch, kind, length, remainder, shuffle, pad_last
):
    """Rows, order, padding and weights: two epochs of each path, element for element."""
    options = {"remainder": remainder, "shuffle": shuffle, "seed": 5}
    with fp.Feeder(sources(length)[kind], 8, **options) as feeder:
        assert feeder._gathers()
        gathered = two_epochs(feeder, pad_last)
        spec = feeder.as_dataset(pad_last=pad_last).element_spec
    handed_over(monkeypatch)
    with fp.Feeder(sources(length)[kind], 8, **options) as feeder:
        assert not feeder._gathers()
        handed = two_epochs(feeder, pad_last)
        handed_spec = feeder.as_dataset(pad_last=pad_last).element_spec
    assert spec == handed_spec
    assert len(gathered) == len(handed) > 0
    for mine, theirs in zip(gathered, handed, strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, mine, theirs)


def test_a_gathered_dataset_made_after_a_restore_mid_epoch_serves_the_rest_of_it(monkeypatch):
    def rest(feeder):
        feeder.set_state(state)
        return [element[0].numpy()[:, 0].tolist() for element in feeder.as_dataset()]

    x, y = sources(37)["(x, y)"]
    with fp.Feeder((x, y), 8, shuffle=True) as feeder:
        state = next(iter(feeder)) and feeder.get_state()
        state = {**state, "epoch": 3, "step": 2}
        gathered = rest(feeder)
    handed_over(monkeypatch)
    with fp.Feeder((x, y), 8, shuffle=True) as feeder:
        assert rest(feeder) == gathered and len(gathered) == len(feeder) - 2


def test_fit_trains_alike_on_gathered_and_handed_batches(monkeypatch):
    """The padded epoch's weights included: the same weights to the last bit."""

    def trained():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        with fp.Feeder(sources(37)["(x, y)"], 8, shuffle=True) as feeder:
            model.fit(feeder.as_dataset(), epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
            assert feeder.get_state()["epoch"] == 2
        return model.get_weights()

    gathered = trained()
    handed_over(monkeypatch)
    for mine, theirs in zip(gathered, trained(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_arrays_in_memory_are_gathered_and_sources_with_work_per_sample_are_not(monkeypatch):
    x, y = sources(40)["(x, y)"]
    w = np.ones(40, np.float32)

    def gathers(source, **options) -> bool:
        with fp.Feeder(source, 8, **options) as feeder:
            return feeder._gathers()

    assert gathers((x, y)) and gathers(x) and gathers((x, y, w), remainder="drop")
    assert not gathers((x, y), transform=lambda sample: sample)
    assert not gathers((x, y), workers=1, worker_mode="thread")
    assert not gathers(fp.from_generator(lambda shard, num_shards: iter(x)))
    assert gathers((x, y, w))  # its own weights go over as they are, on real rows alone
    with fp.Feeder((x, y, w), 8) as feeder:
        assert not feeder._gathers("scale")  # as_dataset(pad_last=True) scales them
    monkeypatch.setattr("feedpipe.tf.feeder.GATHER_MAX_BYTES", x.nbytes + y.nbytes - 1)
    assert not gathers((x, y))  # a second copy of the data would cost too much memory


@pytest.mark.parametrize("length", [40, 37])
def test_a_padded_feeders_x_y_gets_a_sample_weight_whether_or_not_an_epoch_pads(length):
    with fp.Feeder(sources(length)["(x, y)"], 8) as feeder:
        assert feeder._gathers() and len(feeder.as_dataset(pad_last=True).element_spec) == 3


def test_a_dataset_made_after_a_look_at_another_serves_the_whole_epoch(as_dataset_path):
    with fp.Feeder(sources(40)["(x, y)"], 8) as feeder:
        look = iter(feeder.as_dataset())
        next(look)  # as Keras may take, to build a model: it trains nothing
        assert len(list(feeder.as_dataset())) == len(feeder)


def test_a_batch_waiting_in_a_pass_that_set_state_ended_is_refused():
    with fp.Feeder(sources(40)["(x, y)"], 8) as feeder:
        state = feeder.get_state()
        loop = iter(feeder.as_dataset())
        assert next(loop)[0].numpy()[:, 0].tolist() == list(range(8))
        feeder.set_state(state)
        with pytest.raises(tf.errors.OpError, match=r"was superseded.*one consumer"):
            next(loop)
        assert [batch.step for batch in feeder] == list(range(5))  # from the state restored


def test_an_untracked_pass_moves_the_feeder_on_only_once_its_last_batch_is_taken():
    with fp.Feeder(sources(40)["(x, y)"], 8, shuffle=True) as feeder:
        dataset = feeder.as_dataset()
        next(iter(dataset))  # a look at one batch, as Keras may take: it trains nothing
        epoch = [(batch.epoch, batch.step) for batch in feeder]  # a whole loop: epoch 0
        assert epoch[0] == (0, 0)
        assert len(list(dataset)) == 5  # a whole pass: epoch 1, after the loop's epoch 0
        assert {batch.epoch for batch in feeder} == {2}


def test_every_function_of_a_gathered_dataset_is_declared_single_device():
    """Keras makes two iterators an epoch, and each instantiates the dataset's functions anew:
    one tf.data may spread over devices goes through Grappler each time (~2 ms)."""
    from feedpipe._internals.tf import dataset_pipeline

    with fp.Feeder(sources(40)["(x, y)"], 8) as feeder:
        dataset = feeder.as_dataset()
        attribute = "experimental_ints_on_device"
        declared = [
            (type(node).__name__, attribute in wrapper.function.function_def.attr)
            for node in dataset_pipeline(dataset)
            for wrapper in node._functions()
        ]
        assert declared.count(("SingleDeviceMap", True)) == 2  # gather, take
        assert declared.count(("GeneratorDataset", True)) == 3  # the plan's start, chunk, end
        declared_single = {("SingleDeviceMap", True), ("GeneratorDataset", True)}
        assert set(declared) - declared_single <= {("_MapDataset", False)}  # unbatch's
        assert len(list(dataset)) == len(feeder)


@pytest.mark.parametrize(
    "options",
    [{"workers": 2}, {"workers": 1, "worker_mode": "thread"}],
    ids=["worker processes", "a worker thread"],
)
def test_handed_over_batches_share_their_slot_and_keep_their_rows_while_held(options):
    """TensorFlow takes a handed-over batch's arrays without a copy; the slot goes back to the
    pool only once TensorFlow frees them, so batches held keep their rows."""
    source = sources(40)["(x, y)"]
    with fp.Feeder(source, 8, shuffle=True, seed=3, **options) as feeder:
        assert not feeder._gathers()
        for _ in feeder.as_dataset():  # one batch at a time: the pooled slots suffice
            pass
        pool = feeder._assembly.pools[True]
        assert pool.overflow_allocations == 0 and pool.allocated <= pool.capacity
        held = list(feeder.as_dataset())  # every batch of an epoch kept
        assert pool.overflow_allocations > 0
        kept = [tf.nest.map_structure(np.asarray, element) for element in held]
    with fp.Feeder(source, 8, shuffle=True, seed=3) as reference:
        expected = two_epochs(reference)[len(kept) :]
    for mine, theirs in zip(kept, expected, strict=True):
        for a, b in zip(tf.nest.flatten(mine), tf.nest.flatten(theirs), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_feeders_dataset_sizes_its_own_buffers_without_autotuning(as_dataset_path):
    """Freeing an iterator whose autotuning runs waits for its model thread, ~1 s at many of
    Keras's epoch boundaries; the feeder's datasets run without it, on both paths."""
    with fp.Feeder(sources(40)["(x, y)"], 8) as feeder:
        dataset = feeder.as_dataset()
        assert dataset.options().autotune.enabled is False
        assert len(list(dataset)) == len(feeder)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_gathered_dataset_holds_depth_batches_ahead_gathered_one_at_a_time(depth):
    """Bounded memory on the gathered path: its one buffer is a prefetch of `depth` batches,
    filled by one gather at a time in the prefetch's thread (a parallel map would hold one
    batch more per core)."""
    from feedpipe._internals.tf import dataset_pipeline

    with fp.Feeder(sources(40)["(x, y)"], 8, depth=depth) as feeder:
        dataset = feeder.as_dataset()
        nodes = list(dataset_pipeline(dataset))
        kinds = [type(node).__name__ for node in nodes]
        assert kinds.count("_PrefetchDataset") == 1 and kinds.count("SingleDeviceMap") == 2
        assert not [kind for kind in kinds if "Parallel" in kind]
        (prefetch,) = [node for node in nodes if type(node).__name__ == "_PrefetchDataset"]
        assert int(prefetch._buffer_size) == depth
        assert len(list(dataset)) == len(feeder)


def test_dropping_a_feeder_and_its_gathered_dataset_frees_both():
    feeder = fp.Feeder(sources(40)["(x, y)"], 8)
    dataset = feeder.as_dataset()
    next(iter(dataset))
    gone = weakref.ref(feeder)
    del feeder, dataset
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("entry", ["as_dataset under a strategy", "fit(feeder)"])
def test_a_fit_on_arrays_reports_the_steps_and_samples_it_took_and_no_verdict_on_waits(
    request, entry
):
    """The README's Quick start on TensorFlow: arrays, TensorFlow's gathered path, model.fit."""
    length, batch, epochs = 100, 32, 3  # 4 steps an epoch, the last of 4 real samples
    x = np.random.default_rng(0).normal(size=(length, 8)).astype("float32")
    y = (np.arange(length) % 3).astype("int32")
    # The suite's 4-replica strategy: TensorFlow's collectives allow one group of that size
    # per process, and a second strategy's all-reduce would meet the first's instance keys.
    strategy = request.getfixturevalue("strategy") if "strategy" in entry else None
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with fp.Feeder((x, y), batch, strategy=strategy, shuffle=True) as feeder:
        assert feeder._gathers()
        assert str(feeder.stats()).startswith("no steps measured yet")
        data = feeder.as_dataset() if strategy is not None else feeder
        model.fit(data, epochs=epochs, verbose=0, callbacks=[feeder.fit_callback()])
        stats = feeder.stats()
    assert (stats.steps, stats.samples) == (epochs * 4, epochs * length)
    assert stats.wall_s > 0 and stats.samples_per_s > 0
    assert stats.produced_samples >= epochs * length and stats.producer_busy_s > 0
    assert stats.verdict == "input wait not measured"
    assert "not input-bound" not in str(stats) and "over 0 steps" not in str(stats)


DETERMINISTIC_FITS = """
import keras
import numpy as np
import tensorflow as tf

import feedpipe as fp

x = np.random.default_rng(0).normal(size=(100, 8)).astype("float32")
y = (np.arange(100) % 3).astype("int32")
with fp.Feeder((x, y), 32) as feeder:
    early = feeder.as_dataset()
    tf.config.experimental.enable_op_determinism()
    try:
        next(iter(early))
    except tf.errors.OpError as error:
        assert "Make the dataset again, feeder.as_dataset()" in str(error), error
    else:
        raise AssertionError("a dataset made before op determinism was enabled was read")
    assert len(list(feeder.as_dataset())) == 4
weights = []
for entry in ("as_dataset", "feeder", "as_dataset"):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dropout(0.5), keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with fp.Feeder((x, y), 32, shuffle=True) as feeder:
        assert feeder._gathers()
        data = feeder.as_dataset() if entry == "as_dataset" else feeder
        model.fit(data, epochs=2, verbose=0, callbacks=[feeder.fit_callback()])
        stats = feeder.stats()
    assert (stats.steps, stats.samples) == (8, 200), stats
    assert stats.wall_s > 0 and stats.producer_busy_s > 0, stats
    weights.append(model.get_weights())
for run in weights[1:]:
    for mine, theirs in zip(run, weights[0], strict=True):
        np.testing.assert_array_equal(mine, theirs)
"""


def test_fits_under_op_determinism_train_alike_and_are_timed():
    """`tf.config.experimental.enable_op_determinism()`, which reproducible training needs,
    refuses `tf.timestamp`, by which the graph times gathered batches: they are timed by
    Python's clock instead, and a dataset made before it says to make it again. It holds for
    the rest of the process, so the fits run in one of their own."""
    run_as_a_user(DETERMINISTIC_FITS)


def chunks_of(monkeypatch, steps: int, global_batch: int) -> None:
    """Every later pass plans `steps` steps of `global_batch` rows a chunk."""
    monkeypatch.setattr("feedpipe.core.sampler.PADDED_CHUNK_ROWS", steps * global_batch)


def planned_rows(monkeypatch) -> list[int]:
    """The rows of every call of `Sampler.padded_rows` from now on, one entry a call."""
    planned: list[int] = []
    plan = fp.core.sampler.Sampler.padded_rows

    def counted(self, *args, **kwargs):
        rows, valid = plan(self, *args, **kwargs)
        planned.append(rows.size)
        return rows, valid

    monkeypatch.setattr("feedpipe.core.sampler.Sampler.padded_rows", counted)
    return planned


def test_a_pass_over_a_long_epoch_plans_only_its_first_chunk_before_its_first_batch(monkeypatch):
    """The first batch of an epoch or a restore waits for one chunk of steps, whatever the
    epoch's length: 2e6 samples in 7,813 steps of 256, where the whole epoch's rows were
    planned before."""
    from feedpipe.core.sampler import PADDED_CHUNK_ROWS

    length, batch = 2_000_000, 256
    x = np.arange(length, dtype=np.int32) % 251
    planned = planned_rows(monkeypatch)
    with fp.Feeder(x, batch, shuffle=True) as feeder:
        state = feeder.get_state()
        assert feeder._gathers() and len(feeder) == 7813
        first = next(iter(feeder.as_dataset()))
        assert planned == [PADDED_CHUNK_ROWS] and length // 16 > PADDED_CHUNK_ROWS
        np.testing.assert_array_equal(first, x[feeder._assembly.plan.order(0)[:batch]])
        feeder.set_state({**state, "epoch": 4, "step": 5000})
        planned.clear()
        next(iter(feeder.as_dataset()))
        assert planned == [PADDED_CHUNK_ROWS]


def mixed_reads(feeder: fp.Feeder, pad_last: bool = False) -> list:
    """Reads across chunk boundaries: a pass left after 3 batches, the whole pass again, a
    second epoch, and a pass from the middle of a restored epoch; then where a loop over the
    feeder goes on."""

    def numpy(element):
        return tf.nest.map_structure(np.asarray, element)

    state, dataset = feeder.get_state(), feeder.as_dataset(pad_last=pad_last)
    read = [numpy(element) for element in itertools.islice(iter(dataset), 3)]
    read += [numpy(element) for _ in range(2) for element in dataset]
    feeder.set_state({**state, "epoch": 5, "step": 2})
    read += [numpy(element) for element in feeder.as_dataset(pad_last=pad_last)]
    batch = next(iter(feeder))
    return [*read, (batch.epoch, batch.step)]


@pytest.mark.parametrize("kind", ["(x, y)", "(x, nested y)", "one array"])
@pytest.mark.parametrize("order", ["in order", "shuffled", "lazily shuffled"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("pad_last", [False, True], ids=["real rows", "pad_last"])
def test_chunk_boundaries_change_no_batch_weight_or_position(
    monkeypatch, kind, order, chunk, pad_last
):
    """Planned `chunk` steps at a time, the gathered batches (their rows, padding and label
    weights) are the feeder's own path's, in each kind of read; so are the positions."""
    if order == "lazily shuffled":  # the order computed per chunk, as above 1e7 samples
        monkeypatch.setattr("feedpipe.core.sampler.LAZY_SHUFFLE_ABOVE", 10)
    options = {"shuffle": order != "in order", "seed": 3}
    chunks_of(monkeypatch, chunk, 8)
    with fp.Feeder(sources(37)[kind], 8, **options) as feeder:
        assert feeder._gathers() and feeder._assembly.plan.lazy == (order == "lazily shuffled")
        gathered = mixed_reads(feeder, pad_last)
    handed_over(monkeypatch)
    with fp.Feeder(sources(37)[kind], 8, **options) as feeder:
        assert not feeder._gathers()
        handed = mixed_reads(feeder, pad_last)
    assert len(gathered) == len(handed) == 3 + 2 * 5 + 3 + 1 and handed[-1] == (6, 0)
    for mine, theirs in zip(gathered, handed, strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, mine, theirs)


@pytest.mark.parametrize(("length", "start"), [(37, 0), (37, 1), (40, 2), (33, 4)])
def test_the_stats_count_the_real_samples_a_gathered_pass_took(monkeypatch, length, start):
    """Taken one batch at a time across chunks of 3 steps, to the padded epoch's end."""
    chunks_of(monkeypatch, 3, 8)
    with fp.Feeder(sources(length)["(x, y)"], 8) as feeder:
        if start:
            feeder.set_state({**feeder.get_state(), "step": start})
        steps = samples = 0
        for batch in feeder.as_dataset(pad_last=True):
            steps += 1
            samples += int(np.count_nonzero(batch[2]))  # a real row weighs more than nothing
            assert (feeder.stats().steps, feeder.stats().samples) == (steps, samples)
        assert (steps, samples) == (len(feeder) - start, length - 8 * start)
        assert (feeder.stats().steps, feeder.stats().samples) == (steps, samples)


def test_as_dataset_gives_the_last_batch_as_its_real_rows_and_pad_last_pads_it(as_dataset_path):
    """By default Keras gets what `fit(x, y)` gives itself: `(x, y)`, the last batch its 5 real
    rows; `pad_last=True` keeps every batch 8 rows (static shapes), the padding weighted 0."""
    x, y = sources(37)["(x, y)"]
    with fp.Feeder((x, y), 8) as feeder:
        real, padded = feeder.as_dataset(), feeder.as_dataset(pad_last=True)
        assert [spec.shape.as_list()[0] for spec in real.element_spec] == [None, None]
        assert [spec.shape.as_list()[0] for spec in padded.element_spec] == [8, 8, 8]
        batches = [tf.nest.map_structure(np.asarray, element) for element in real]
        assert [len(b) for b in batches] == [2] * 5 and len(batches[-1][0]) == 5
        np.testing.assert_array_equal(batches[-1][0], x[32:])
        *_, last = [tf.nest.map_structure(np.asarray, element) for element in padded]
    np.testing.assert_array_equal(last[0][:5], x[32:])
    np.testing.assert_allclose(last[2].ravel(), [8 / 5] * 5 + [0.0] * 3)  # [8, 1], as y


def test_across_hosts_as_dataset_pads_and_pad_last_false_is_refused(monkeypatch):
    """Each host's stream runs on without an end, every step a full batch per replica."""
    from feedpipe.core.split import HostShare
    from feedpipe.tf.feeder import Feeder

    with fp.Feeder(sources(37)["(x, y)"], 8) as feeder:
        with monkeypatch.context() as patched:
            two_hosts = property(lambda self: HostShare(8, num_hosts=2))
            patched.setattr(Feeder, "share", two_hosts)
            assert feeder._pads_last(None) and feeder._pads_last(True)
            with pytest.raises(ValueError, match=r"pad_last=False.*2 hosts.*pad_last=True"):
                feeder.as_dataset(pad_last=False)
        with pytest.raises(TypeError, match=r"pad_last.*True, False or None.*'yes'"):
            feeder.as_dataset(pad_last="yes")
