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
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import queue
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import numpy as np
import optree
import tensorflow as tf

from feedpipe._internals import dataset_graph, dispatcher_error
from feedpipe.core._sync import WAIT_SLICE_S, Failure
from feedpipe.core.producers import Producer, SlotSupply
from feedpipe.core.sampler import EpochEnd, Sampler, Step
from feedpipe.core.slots import HostSlot
from feedpipe.core.sources import ArraySource, Source
from feedpipe.core.state import Position
from feedpipe.core.writer import RNG, SEED, randomness, sample_seeds

SERVICE_LIMIT = (
    "tf.data service workers run TensorFlow graphs only, never Python (py_function, "
    "numpy_function and from_generator fail there)"
)
CONNECT_TIMEOUT_S = 10.0
"""Longest the feeder waits, at construction, for the dispatcher to answer."""
ANSWER_S = 2.0
"""Longest a check that the dispatcher is alive, mid-epoch, waits for its answer: a stopped
or hung dispatcher still accepts connections (the kernel does), so only an answer counts."""
STALL_S = 30.0
"""Longest the feeder waits for a row of a job that still owes rows before asking a new job for
them: a job whose worker died sends nothing more and never ends (TensorFlow 2.21). It doubles
for each new job that sends nothing either (slow to start, not lost)."""
DISPATCHER_LOST_S = 60.0
"""Longest the feeder waits for a row while the dispatcher does not answer: time for it to be
restarted (with `--work-dir`, it keeps its jobs); then reading fails with a ConnectionError.
Jobs the dispatcher forgot are asked for again within it too; past it, its error is raised."""
RELEASE_S = 3.0
"""Longest `close()` waits for the jobs' readers to let go of their jobs."""
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
FORGOTTEN_JOB = ("dispatcher restart", "Failed to get split")
"""What TensorFlow says when a dispatcher restarted without `--work-dir` forgot a job: to the
client it names the restart; through a worker that asks it for the job's next split, the split
is not found (a file the transform cannot find is also NotFound, and says neither)."""
PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
WORKER_FAILED = "Failed to get element from worker"
"""How TensorFlow begins the message of an error a service worker sent while making an element."""
ELEMENT_FAILED = "Failed to get element"
"""What TensorFlow writes last before the worker's own error message."""
NOTE_SEARCH_S = 10.0
"""Longest the feeder runs `transform` here, on the samples still owed, to name the sample whose
error a service worker sent; the one that raised is among the first few hundred (the rows the
workers were making), unless it raises only on the workers."""


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


class ServiceProducer(Producer):
    """Fills each step's slot from the rows tf.data service sends, in any order, in full."""

    slots_in_flight = 2

    def __init__(self, work: ServiceWork, service: str, sampler: Sampler):
        self.work = work
        self.service = service
        self.sampler = sampler
        self.jobs = 0
        """Jobs started so far (more than one an epoch: rows asked for again)."""
        self._readers: list[threading.Thread] = []

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        try:
            for epoch in itertools.count(start.epoch):
                first = start.step if epoch == start.epoch else 0
                yield from self._epoch(epoch, self.sampler.steps(epoch, first), supply)
                yield EpochEnd(epoch, self.sampler.dropped_per_epoch)
        finally:
            self._release()

    def _start(self, indices: np.ndarray, epoch: int, positions: np.ndarray) -> _Job:
        job = _Job(functools.partial(self.work.job, self.service, indices, epoch), positions)
        self.jobs += 1
        self._readers = [t for t in self._readers if t.is_alive()] + [job.thread]
        return job

    def _release(self) -> None:
        """Waits up to `RELEASE_S` for the jobs' readers to let go of their jobs (TensorFlow
        ends a job as its iterator goes); a reader blocked by a lost worker or dispatcher is
        left, a daemon, to end when TensorFlow's read returns."""
        deadline = time.monotonic() + RELEASE_S
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))

    def _epoch(self, epoch: int, steps: Iterator[Step], supply: SlotSupply) -> Iterator:
        rows = _Rows(steps, supply, self.slots_in_flight, self.work.held_rows)
        job, patience, last_row = None, STALL_S, time.monotonic()
        waited, lagged = 0.0, False  # for the next step; whether a worker held its rows back
        try:
            while not rows.done():
                if job is None:  # the next rows still missing, as many as one job carries
                    positions, indices = rows.missing(self.work.rows_per_job)
                    job = self._start(indices, epoch, positions)
                supply.check_stop()
                asked = time.perf_counter()
                item = job.get()
                waited += time.perf_counter() - asked
                if isinstance(item, Failure):
                    lost_s = time.monotonic() - last_row
                    if not _forgotten(item.error) or lost_s > DISPATCHER_LOST_S:
                        # The rows the job still owes come first among those missing.
                        owed = rows.missing(self.work.rows_per_job)[1]
                        self._note_sample(item.error, owed, epoch, supply)
                        raise item.error
                    item = _Job.END  # its dispatcher restarted without a journal
                if item is None:  # nothing yet
                    step = rows.steps[0].index  # the next to hand on (rows are not done)
                    if job.idle_s() > patience and self._dispatcher_answers(job, epoch, step):
                        job.abandon()  # a worker died holding rows: ask a new job for them
                        job, lagged = None, True
                        patience *= 2  # unless jobs are slow to start: then wait longer
                    continue
                if item is _Job.END:
                    job = None  # rows it ended without are asked for again
                    continue
                positions, *leaves = item
                if not rows.arrived(positions, leaves):
                    job.abandon()  # a worker lags holding rows: ask a new job for them
                    job, lagged = None, True
                patience, last_row = STALL_S, time.monotonic()
                for delivered in rows.deliver():
                    supply.service_waited(waited, lagging=lagged)
                    waited, lagged = 0.0, False
                    yield delivered
        finally:
            if job is not None:
                job.abandon()
            rows.give_back()

    def _note_sample(
        self, error: BaseException, owed: np.ndarray, epoch: int, supply: SlotSupply
    ) -> None:
        """Adds to an error a service worker sent while making a sample (TensorFlow's message
        names the worker, never the sample) a note naming the sample, as a local run's says:
        the first of the samples still `owed` on which `transform` raises it here too."""
        if not isinstance(error, tf.errors.OpError) or WORKER_FAILED not in error.message:
            return
        until = time.monotonic() + NOTE_SEARCH_S
        index, tried = self.work.failing_sample(error, owed, epoch, until, supply.check_stop)
        if index is not None:
            error.add_note(
                f"feedpipe: raised on a tf.data service worker while producing sample index "
                f"{index} of epoch {epoch} (`transform` raises it on that sample here too)."
            )
        else:
            error.add_note(
                f"feedpipe: raised on a tf.data service worker while producing one of the "
                f"{len(owed)} samples of epoch {epoch} still owed; `transform` raised no such "
                f"error here on the first {tried} of them."
            )

    def _dispatcher_answers(self, job: _Job, epoch: int, step: int) -> bool:
        """Whether the dispatcher answers within `ANSWER_S`; raises once it has not for
        `DISPATCHER_LOST_S` without a row."""
        error = dispatcher_error(self.service.removeprefix("grpc://"), ANSWER_S)
        if error is not None and job.idle_s() > DISPATCHER_LOST_S:
            raise ConnectionError(
                f"the tf.data service dispatcher at {self.service} has not answered for "
                f"{job.idle_s():.0f} s ({error}), at step {step} of epoch {epoch}; "
                "every batch delivered before was whole. Restart it at the same address "
                "(`feedpipe service dispatcher --work-dir DIR --fault-tolerant` keeps its jobs) "
                "and go on from `feeder.get_state()`."
            )
        return error is None


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


def _forgotten(error: BaseException) -> bool:
    """Whether a job failed because its dispatcher restarted without `--work-dir` and so forgot
    it: its rows can be asked of a new job."""
    return isinstance(error, tf.errors.NotFoundError) and any(
        said in str(error) for said in FORGOTTEN_JOB
    )


class _Job:
    """One service job, read in a thread of its own: TensorFlow's iterator cannot be
    interrupted, and TensorFlow never ends a job whose worker died (nor sends what it held)
    until a worker serves again at that address. Until then such a thread stays blocked; the
    feeder asks a new job for the rows instead."""

    END = object()

    def __init__(self, make: Callable[[int], tf.data.Dataset], positions: np.ndarray):
        self.positions = positions
        """The epoch's row positions its tags index."""
        self.number = secrets.randbits(31)
        """The job's random number, in every tag of its rows (see `JOB_SHIFT`)."""
        self._items: queue.Queue = queue.Queue(maxsize=ELEMENTS_QUEUED)
        self._abandoned = threading.Event()
        self._last = time.monotonic()
        self.thread = threading.Thread(
            target=self._read, args=(make,), name="feedpipe-service-job", daemon=True
        )
        self.thread.start()

    def _read(self, make: Callable[[int], tf.data.Dataset]) -> None:
        """Makes the job (which waits for the dispatcher) and reads it, each element as the
        epoch's positions of its rows, then its fields."""
        owed = len(self.positions)
        try:
            for element in make(self.number):
                tags, *leaves = [value.numpy() for value in element]
                if np.any(tags >> JOB_SHIFT != self.number):
                    continue  # another job's rows, under a reused task number
                if not self._put([self.positions[tags & ((1 << JOB_SHIFT) - 1)], *leaves]):
                    return
                owed -= len(tags)
                if owed <= 0:  # all its rows are in: never wait for the job's end
                    break
            self._put(self.END)
        except BaseException as error:
            self._put(Failure(error))

    def _put(self, item: Any) -> bool:
        """Queues `item` unless the job was abandoned; False once it is."""
        while not self._abandoned.is_set():
            try:
                self._items.put(item, timeout=WAIT_SLICE_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        """The next element (positions, then fields), `END`, None if none came in a wait
        slice, or the `Failure` reading the job met."""
        try:
            item = self._items.get(timeout=WAIT_SLICE_S)
        except queue.Empty:
            return None
        self._last = time.monotonic()
        return item

    def idle_s(self) -> float:
        """Time since the job was asked for or last sent an element."""
        return time.monotonic() - self._last

    def abandon(self) -> None:
        """Stops reading once the thread's blocked read returns (if it ever does), and lets go
        of the elements queued: a reader blocked behind a stopped worker would keep them."""
        self._abandoned.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._items.get_nowait()


class _Rows:
    """An epoch's rows as they arrive, in any order: each is written into its step's slot if
    that slot is open (the next `window` steps, while the pool has slots), else kept until it
    is; a step is handed on, in order, once all its rows are in, and then forgotten.

    Steps are taken from the plan (`Sampler.steps`, lazy) only as far as the rows asked for
    reach (`missing`), so an epoch's or a restore's first job costs the planning of its own
    rows, however long the epoch. A row's position counts this host's rows of the epoch from
    the first step planned.

    Invariant: the rows kept outside the slots are at most those of the next `window` steps
    and `held` more (`HELD_BYTES`), each a copy of its own; a row past them is left missing,
    to be asked for again. Only the steps not yet handed on are known, as far as the furthest
    row asked for.
    """

    def __init__(self, plan: Iterator[Step], supply: SlotSupply, window: int, held: int):
        self.plan = plan
        self.supply = supply
        self.window = window
        self.held = held
        self.steps: list[Step] = []
        """The steps planned and not yet handed on, in order."""
        self.starts: list[int] = []
        """The position of each one's first row."""
        self.base = 0
        """The position of the first one's first row."""
        self.indices = np.zeros(0, np.int64)
        """The sample index of each of their rows, from position `base` on."""
        self.got = np.zeros(0, bool)
        """Whether each of their rows has arrived, from position `base` on."""
        self.kept: dict[int, list[np.ndarray]] = {}
        self.open: dict[int, HostSlot] = {}
        """Slots open, by the epoch's step number."""

    def done(self) -> bool:
        """Whether every step of the epoch has been handed on."""
        return not self.steps and not self._plan(1)

    def _plan(self, rows: int) -> int:
        """Takes steps from the plan until they hold `rows` rows more (fewer at the epoch's
        end); returns how many they hold."""
        planned: list[np.ndarray] = []
        count = 0
        while count < rows and (step := next(self.plan, None)) is not None:
            self.starts.append(self.base + len(self.got) + count)
            self.steps.append(step)
            planned.append(step.rows)
            count += len(step.rows)
        if planned:
            self.indices = np.concatenate([self.indices, *planned])
            self.got = np.concatenate([self.got, np.zeros(count, bool)])
        return count

    def missing(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions and sample indices of the first `count` rows not yet arrived (fewer
        at the epoch's end), planning steps as far as they reach."""
        owed = np.flatnonzero(~self.got)
        if len(owed) < count and self._plan(count - len(owed)):
            owed = np.flatnonzero(~self.got)
        owed = owed[:count]
        return self.base + owed, self.indices[owed]

    def _slot(self, step: int) -> HostSlot | None:
        """The open slot of `self.steps[step]`, opened now if it is near and the pool has one
        free."""
        number = self.steps[step].index
        if number not in self.open and step < self.window:
            slot = self.supply.try_acquire()
            if slot is not None:
                self._open(step, slot)
        return self.open.get(number)

    def _open(self, step: int, slot: HostSlot) -> None:
        """Opens `slot` for `self.steps[step]`, writing into it the step's rows kept so far."""
        self.open[self.steps[step].index] = slot
        lo = self.starts[step]
        hi = lo + len(self.steps[step].rows)
        for position in [p for p in self.kept if lo <= p < hi]:
            self._write(slot, position - lo, self.kept.pop(position))

    @staticmethod
    def _write(slot: HostSlot, row: int, leaves: list[np.ndarray]) -> None:
        for field, leaf in enumerate(leaves):
            slot.row(field, row)[0] = leaf

    def arrived(self, positions: np.ndarray, leaves: list[np.ndarray]) -> bool:
        """Takes an element's rows; False if some came too far ahead to keep (see the class):
        a worker lags, holding a row of an earlier step."""
        past_window = self.starts[self.window] if len(self.steps) > self.window else None
        limit = (self.base + len(self.got) if past_window is None else past_window) + self.held
        kept_all = True
        for row, position in enumerate(positions.tolist()):
            if position < self.base or self.got[position - self.base]:
                continue  # a row sent twice holds the same value: keep the first
            if position >= limit:
                kept_all = False
                continue
            self.got[position - self.base] = True
            step = bisect.bisect_right(self.starts, position) - 1
            slot = self._slot(step)
            if slot is None:  # a copy: a view would keep the element's other rows alive
                self.kept[position] = [leaf[row].copy() for leaf in leaves]
            else:
                self._write(slot, position - self.starts[step], [leaf[row] for leaf in leaves])
        return kept_all

    def deliver(self) -> Iterator[tuple[Step, HostSlot]]:
        """The next steps whose rows are all in, with their filled slots."""
        while self.steps and self.got[: len(self.steps[0].rows)].all():
            slot = self._slot(0)
            if slot is None:
                self._open(0, slot := self.supply.acquire())
            step = self.steps.pop(0)
            del self.open[step.index], self.starts[0]
            size = len(step.rows)
            self.base += size
            self.indices, self.got = self.indices[size:], self.got[size:]
            slot.pad(size)
            yield step, slot

    def give_back(self) -> None:
        """Returns the slots of steps that will not be handed on (the stream stopped)."""
        for slot in self.open.values():
            self.supply.give_back(slot)
        self.open.clear()
