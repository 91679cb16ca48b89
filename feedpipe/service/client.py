"""Service: the per-sample work of an indexed source run on tf.data service workers, exactly once.

tf.data service runs a dataset's graph on the CPUs of other machines; its dynamic sharding hands
each element to one worker, in no set order, and loses what a worker that dies was holding. So
feedpipe asks for exactly the rows it needs, each tagged with its place (the step of the epoch
and the row of the host's share), writes each arriving row into its place, hands a batch on once
all its rows are in, and asks again, in a new job, for the rows a job ended without: every
sample once per epoch at the consumer, in the plan's order, whoever computed it. The workers run
TensorFlow graphs only, so `transform` must be TensorFlow ops; its `seed`, for stateless random
ops, is a function of (seed, epoch, sample index) (`writer.sample_seeds`, as in a local run), so
a value does not depend on the worker.

This module is the work: the graph a job runs for each row (`ServiceWork`), the sizes of what
travels and is held, and the dispatcher's address checked; `feedpipe.service.producer` asks
for the rows, reads the jobs and fills the slots.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import numpy as np
import optree
import tensorflow as tf

from feedpipe._internals.tf import dataset_graph, dispatcher_error
from feedpipe.core.sources import ArraySource, Source
from feedpipe.core.writer import RNG, SEED, randomness, sample_seeds

SERVICE_LIMIT = (
    "tf.data service workers run TensorFlow graphs only, never Python (py_function, "
    "numpy_function and from_generator fail there)"
)
CONNECT_TIMEOUT_S = 10.0
"""Longest the feeder waits, at construction, for the dispatcher to answer."""
ELEMENTS_QUEUED = 2
"""Elements read ahead of the producer from one job (each at most `ELEMENT_BYTES`)."""
OUTSTANDING_ELEMENTS = 2
"""TensorFlow's `max_outstanding_requests` for a job: elements its client asks of the workers
at once, received or on the way. TensorFlow's own default (AUTOTUNE) is one per worker, which
grows with the service: 16 workers, 16 elements. 2 is that default for two workers; each
request is answered from a worker's buffer, so more keep the link no busier."""
ROWS_PER_ELEMENT = 64
"""Rows the service sends in one element, at most: the client's cost is mostly per element
(receiving and decoding it), and at 16 rows it took 3.4-4.0x the CPU per sample of
`distribute` with a batch of 64 (kernels_bench/data_service.py). Fewer where 64 rows would
pass `ELEMENT_BYTES`."""
ELEMENT_BYTES = 4 << 20
"""Most bytes of rows in one element (one row, if a row is larger): 64 float32 rows of
64 x 64 x 3 (kernels_bench/data_service.py) are 3 MiB and still travel 64 to an element;
64 rows of 224 x 224 x 3 would be 37 MiB each, times every element in flight."""
HELD_BYTES = 64 << 20
"""Bytes of rows of later steps the feeder keeps, past the steps whose slots are open, while
it waits for a row a slow, stopped or lost worker holds (at least one element's rows).
TensorFlow's client hands on elements in the order they arrive, so pausing the read would
hide that worker's rows behind the others'; instead the feeder takes no row past these and
asks a new job for the rows still missing, the held-back ones first. A free worker makes
them; a stopped one holds up the new job's start (in TensorFlow 2.21 a job starts once every
registered worker has its task), so the others wait too until it goes on, and nothing piles
up meanwhile. 64 MiB are 16 elements of `ELEMENT_BYTES`: two in flight from each of 8
workers, arriving out of order, stay within it; past it a lagging worker costs work asked
again, not memory. Counted in bytes: a count of rows held 2048 rows, 128 MiB of 64 KiB rows."""
JOB_BYTES = 4 << 20
"""Most bytes of the source's rows one job carries (its first `ROWS_PER_SPLIT` rows at
least): the service reads the arrays from the job's graph, which TensorFlow serialises to
register it, and that briefly takes about three times their bytes here (measured: +385 MB to
start a job over 128 MB of arrays, and 1 s of CPU; the graph then goes to every worker). So a
job carries only its own rows, gathered, and an epoch whose rows weigh more is asked for in
jobs of at most this, one after the other; paths of 100 characters and labels are one job an
epoch up to 38,000 rows, several above. 4 MiB: over 128 MB of arrays with a worker
stopped, jobs of 4 MiB grew the trainer by 130-160 MiB, slots included, jobs of 48 MiB by
312 MiB (the allocator keeps what larger transients freed), one job of it all by 386 MiB."""
JOB_COPIES = 4
"""Copies of a job's rows while it starts: the gathered rows here, and TensorFlow's three
(the graph, its serialised form, the request)."""
ELEMENTS_HELD_ELSEWHERE = OUTSTANDING_ELEMENTS + ELEMENTS_QUEUED + 2
"""Elements alive outside the rows held, at most: TensorFlow's, the queue's, the one the
reader turns into arrays and the one the producer writes into slots."""
ALLOCATOR_BYTES = 48 << 20
"""Memory the C allocator keeps after feedpipe and TensorFlow free it (glibc keeps freed
chunks below its mmap threshold, which rises to the largest chunk freed, in per-thread
arenas; with the threshold fixed at 1 MiB, four epochs of 128 MB of arrays in jobs of 16 MiB
grew the trainer by 139 MiB, where they grew it by 514 MiB).
It is not counted chunk by chunk: 48 MiB is twice the most the growth passed the other parts
here (160 MiB over 128 MB of arrays with a worker stopped: 32 MiB of slots, 104 MiB of
parts, 24 MiB more)."""
MEMORY_CAP_BYTES = (
    HELD_BYTES + ELEMENTS_HELD_ELSEWHERE * ELEMENT_BYTES + JOB_COPIES * JOB_BYTES + ALLOCATOR_BYTES
)
"""The stated cap (152 MiB) on what the service client adds to the trainer's memory beyond
the slots, a stopped or lost worker or not: the rows held (`HELD_BYTES`), the elements in
flight (`ELEMENTS_HELD_ELSEWHERE` of `ELEMENT_BYTES`), a starting job (`JOB_COPIES` x
`JOB_BYTES`) and what the allocator keeps (`ALLOCATOR_BYTES`). Where one row is larger than
`ELEMENT_BYTES`, an element is one row and counts instead; where `ROWS_PER_SPLIT` source rows
are larger than `JOB_BYTES`, a job is one split and counts instead. Tested as RSS with a
worker stopped (tests/test_service.py)."""
ROWS_PER_SPLIT = 16
"""Fewest rows the dispatcher hands a worker at a time (a job of fewer rows is one split). The
dispatcher pays about 100 µs of CPU per split whatever it holds (92-105 µs at 1, 16 and 256
rows): one row a split cost it 150-210 µs a row; 16, 32-44 µs (kernels_bench/data_service.py);
so splits grow with the job, up to `MAX_ROWS_PER_SPLIT`."""
MAX_ROWS_PER_SPLIT = 1024
"""Most rows the dispatcher hands a worker at a time. Besides its ~100 µs a split, the
dispatcher pays for each job (~35 ms here, 4 workers) and for each byte of the job's graph
(~12 ns: the source rows it carries; epochs of 16,384 rows of 40, 264 and 1,032 bytes cost it
45, 100 and 253 ms). Rows of 40 bytes in jobs of `JOB_BYTES` cost it 0.8 µs each at 1024
rows a split, 7.2 µs at 16 (kernels_bench/dispatcher.py, 1 dispatcher and 4 workers), and by
those costs about 1.2 µs at 256. More would save it little and cost balance: a slow worker
holds back the rows of the split it is making (see `SPLITS_HELD`)."""
SPLITS_PER_JOB = 64
"""Splits a job's rows are shared out in, at least, where they hold `ROWS_PER_SPLIT` each: so
that a small job still gives each of up to 16 workers 4 splits or more, and none waits idle
while another makes a split of every row (`ServiceWork.split_rows`)."""
SPLITS_HELD = 8
"""Splits' worth of transformed rows `HELD_BYTES` holds at least, where that leaves a split
`ROWS_PER_SPLIT` rows: while a slow worker makes one split, the others' rows of later steps are
held rather than asked for again (64 KiB rows: splits of 128 rows)."""
JOB_SHIFT = 32
"""A row's tag is `job << JOB_SHIFT | position`: its place among the epoch's rows (below
2**32), and a random number of the job that asked for it. A dispatcher restarted without
`--work-dir` numbers its tasks from the start again, and a worker still holding a task of a
forgotten job under the same number serves that job's rows to the new one; those are told
apart by the job and left out."""
PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
ELEMENT_FAILED = "Failed to get element"
"""What TensorFlow writes last before the worker's own error message."""


def check_address(service: str) -> str:
    """`service` ("grpc://host:port" or "host:port") as the address tf.data takes, once a
    tf.data service dispatcher has answered there within `CONNECT_TIMEOUT_S` (TensorFlow would
    wait for one without end, whatever else serves at that port)."""
    if not isinstance(service, str):
        raise TypeError(f'`service`={service!r} must be an address such as "grpc://host:5050".')
    parsed = urlparse(service if "://" in service else f"grpc://{service}")
    if parsed.scheme != "grpc" or not parsed.hostname or parsed.port is None:
        raise ValueError(
            f'`service`={service!r} is not a dispatcher address; pass "grpc://host:port", '
            "where `feedpipe service dispatcher --port PORT` runs."
        )
    if error := dispatcher_error(f"{parsed.hostname}:{parsed.port}", CONNECT_TIMEOUT_S):
        raise ConnectionError(
            f"`service`={service!r}: no tf.data service dispatcher answered there within "
            f"{CONNECT_TIMEOUT_S:.0f} s ({error}); start one (`feedpipe service dispatcher "
            f"--port {parsed.port}`, and workers with `feedpipe service worker --dispatcher "
            f"{parsed.hostname}:{parsed.port}`) or fix the address."
        )
    return f"grpc://{parsed.hostname}:{parsed.port}"


class ServiceWork:
    """The graph the service runs for each row: read sample `index` of the source's arrays,
    then `transform` it, as one `tf.data` map over tagged rows."""

    def __init__(self, source: Source, transform: Callable[..., Any] | None, seed: int):
        if not isinstance(source, ArraySource):
            raise TypeError(
                f"`service` runs the per-sample work on tf.data service workers, which read "
                f"arrays only; got a {type(source).__name__}. Pass arrays (for example file "
                "paths and labels) and do the reading in `transform` with TensorFlow ops, or "
                "use workers=N for Python sources."
            )
        self.source = source
        self.transform = transform
        self.seed = seed
        kind = None if transform is None else randomness(transform)
        self.with_seed = kind == SEED
        if kind == RNG:
            raise TypeError(
                f"`transform` takes a second argument other than `seed`, but {SERVICE_LIMIT}, "
                "so it cannot get a numpy Generator: name its second parameter `seed` and use "
                "it in stateless TensorFlow ops (tf.random.stateless_uniform(shape, seed), "
                "tf.image.stateless_random_flip_left_right(image, seed)); a local run "
                "(service=None) then gets the same seed."
            )
        self.treespec = source.treespec
        """The structure of a transformed sample (known once the map is traced)."""
        source_row_bytes = max(1, sum(_row_bytes(array) for array in source.arrays))
        self.rows_per_job = max(ROWS_PER_SPLIT, JOB_BYTES // source_row_bytes)
        """Rows asked of one job at most: their source rows travel in its graph (`JOB_BYTES`)."""
        self.most_split_rows = ROWS_PER_SPLIT
        """Most rows in a split (`MAX_ROWS_PER_SPLIT`, `SPLITS_HELD`), once a row's bytes are
        known (the probe below is one row)."""
        try:
            self._probe = self._rows(np.zeros(1, np.int64), epoch=0)
            """Sample 0 of epoch 0, traced once: its structure, then its value."""
            graph = dataset_graph(self._probe)
        except Exception as error:
            raise TypeError(
                f"`transform`={_name(transform)} cannot be traced into a TensorFlow graph "
                f"({_cause(error)}), and {SERVICE_LIMIT}. Write it with TensorFlow ops alone "
                "(no numpy or Python calls on its inputs), or drop `service` and use workers=N "
                "to run Python per sample in worker processes."
            ) from error
        self._check(graph)
        self.row_bytes = max(
            1, sum(s.shape.num_elements() * s.dtype.size for s in self._probe.element_spec[1:])
        )
        """Bytes of one transformed row, as it travels and is held."""
        self.rows_per_element = max(1, min(ROWS_PER_ELEMENT, ELEMENT_BYTES // self.row_bytes))
        """Rows in one element the service sends (`ELEMENT_BYTES`)."""
        self.held_rows = max(self.rows_per_element, HELD_BYTES // self.row_bytes)
        """Rows of later steps kept outside the slots at most (`HELD_BYTES`)."""
        held_split = HELD_BYTES // (SPLITS_HELD * self.row_bytes)
        self.most_split_rows = max(ROWS_PER_SPLIT, min(MAX_ROWS_PER_SPLIT, held_split))

    def split_rows(self, rows: int) -> int:
        """Rows of each split of a job of `rows` rows: `rows` over `SPLITS_PER_JOB`, at least
        `ROWS_PER_SPLIT` and at most `most_split_rows`: the dispatcher's CPU goes per split,
        and balance wants many splits, and small ones."""
        per_split = -(-rows // SPLITS_PER_JOB)
        return max(ROWS_PER_SPLIT, min(self.most_split_rows, per_split))

    def _sample(
        self, arrays: list[tf.Tensor], index: tf.Tensor, seed: tf.Tensor | None
    ) -> list[tf.Tensor]:
        fields = [tf.gather(array, index) for array in arrays]
        sample = optree.tree_unflatten(self.source.treespec, fields)
        if self.with_seed:
            sample = self.transform(sample, seed)
        elif self.transform is not None:
            sample = self.transform(sample)
        leaves, self.treespec = optree.tree_flatten(sample)
        return leaves

    def first_sample(self) -> Any:
        """Sample 0 of epoch 0 as the service makes it (its structure, shapes and dtypes)."""
        _, *leaves = next(iter(self._probe))
        return optree.tree_unflatten(self.treespec, [leaf.numpy() for leaf in leaves])

    def _rows(
        self, indices: np.ndarray, epoch: int, job: int = 0, in_order: bool = False
    ) -> tf.data.Dataset:
        """Samples `indices` of `epoch`, each after its tag (see `JOB_SHIFT`), shared out
        `split_rows(len(indices))` at a time, made in parallel in any order, or one after
        another with `in_order`. The graph holds only these rows of the source's arrays (see
        `JOB_BYTES`), and their sample indices where `transform` takes a seed: a row's place,
        tag and seed are worked out on the worker from its split's number, for every byte of
        the graph costs the dispatcher CPU and goes to every worker
        (kernels_bench/dispatcher.py)."""
        arrays = [tf.constant(np.take(array, indices, axis=0)) for array in self.source.arrays]
        count = len(indices)
        per_split = self.split_rows(count)
        sample_index = tf.constant(np.asarray(indices, np.int64)) if self.with_seed else None
        first_seed = sample_seeds(self.seed, epoch, np.zeros(1, np.int64))[0]

        def split_places(split: tf.Tensor) -> tf.Tensor:
            return split * per_split + tf.range(per_split, dtype=tf.int64)

        def made(place: tf.Tensor) -> tuple:
            seed = None
            if sample_index is not None:  # as `sample_seeds`, from the sample's index
                seed = tf.constant(first_seed) + tf.stack([0, tf.gather(sample_index, place)])
            tag = tf.bitwise.bitwise_or(
                tf.bitwise.left_shift(tf.constant(job, tf.int64), JOB_SHIFT), place
            )
            return (tag, *self._sample(arrays, place, seed))

        splits = tf.data.Dataset.range(-(-count // per_split))
        return (
            splits.map(split_places)
            .unbatch()
            .filter(lambda place: place < count)
            .map(
                made,
                **({} if in_order else {"num_parallel_calls": tf.data.AUTOTUNE}),
                deterministic=None if in_order else False,
            )
        )

    def failing_sample(
        self,
        error: tf.errors.OpError,
        indices: np.ndarray,
        epoch: int,
        until: float,
        check: Callable[[], None],
    ) -> tuple[int | None, int]:
        """The first of `indices` whose `transform` raises `error` here too, and how many were
        tried: the service does not say which sample raised, so they run here, in order, until
        the `time.monotonic()` `until` (`check` raises to stop sooner)."""
        tried = 0
        while tried < len(indices) and time.monotonic() < until:
            try:
                chunk = indices[tried : tried + self.rows_per_job]
                for _ in self._rows(chunk, epoch, in_order=True):
                    tried += 1
                    check()
                    if time.monotonic() >= until:
                        break
            except tf.errors.OpError as local:
                tried += 1
                if _same_error(local, error):
                    return int(indices[tried - 1]), tried
        return None, tried

    def _check(self, graph: Any) -> None:
        """Refuses a transform the service cannot run, or whose output varies in shape."""
        found = {node.op for node in graph.node}
        found |= {node.op for function in graph.library.function for node in function.node_def}
        if found & PYTHON_OPS:
            raise TypeError(
                f"`transform`={_name(self.transform)} calls Python "
                f"({', '.join(sorted(found & PYTHON_OPS))}), but {SERVICE_LIMIT}. Write it with "
                "TensorFlow ops alone, or drop `service` and use workers=N to run Python per "
                "sample in worker processes."
            )
        for spec in self._probe.element_spec[1:]:
            if not spec.shape.is_fully_defined():
                raise ValueError(
                    f"`transform` returns a field of shape {spec.shape} that varies from sample "
                    "to sample; a batch needs one shape: resize or pad to a fixed shape inside "
                    "`transform` (e.g. tf.image.resize)."
                )

    def job(self, service: str, indices: np.ndarray, epoch: int, job: int) -> tf.data.Dataset:
        """A new service job over `indices` (at most `rows_per_job` of them), tagged with `job`
        and their positions, shared out dynamically."""
        rows = self._rows(indices, epoch, job).batch(self.rows_per_element)
        return rows.apply(
            tf.data.experimental.service.distribute(
                processing_mode="distributed_epoch",
                service=service,
                job_name=f"feedpipe-{uuid.uuid4().hex}",
                max_outstanding_requests=OUTSTANDING_ELEMENTS,
            )
        )


def _row_bytes(array: np.ndarray) -> int:
    """Bytes of one row of `array` in a TensorFlow graph: numpy's 4 bytes per character of a
    str array are about 1 in TensorFlow's UTF-8 (paths are mostly ASCII)."""
    row = array[:1].nbytes
    return row // 4 if array.dtype.kind == "U" else row


def _name(transform: Callable[..., Any] | None) -> str:
    """How a message names `transform`: its name, else its repr."""
    return getattr(transform, "__name__", None) or repr(transform)


def _cause(error: BaseException) -> str:
    """`error` in one line: its type and the last line of its message, where AutoGraph puts
    the original error, already after its own type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    last = last if len(last) <= 200 else f"{last[:200].rstrip()}..."
    kind = type(error).__name__
    return last if last.startswith(f"{kind}:") else f"{kind}: {last}"


def _same_error(local: tf.errors.OpError, remote: tf.errors.OpError) -> bool:
    """Whether `local`, raised here, is the error a worker sent as `remote`: the same type, and
    the worker's own words (after TensorFlow's account of the way) end `local`'s first line."""
    said = _first_line(remote.message).rsplit(f"{ELEMENT_FAILED}: ", 1)[-1]
    return type(local) is type(remote) and bool(said) and _first_line(local.message).endswith(said)


def _first_line(message: str) -> str:
    """A TensorFlow error message's first line, without the op it surfaced in."""
    line = message.strip().split("\n", 1)[0]
    return re.sub(r"\s*\[Op:\w+\].*$", "", line).strip()
