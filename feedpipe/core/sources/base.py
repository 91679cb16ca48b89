"""Sources: what the samples are.

Every input a user already has is adapted to a `Source`, one of two kinds:

* an *indexed* source (`length`, `sample(i)`) reads any sample on demand, so the sampler
  chooses the order: numpy arrays, map-style objects, a `keras.utils.PyDataset` (its batches,
  split into rows);
* a *stream* source (`samples(epoch)`, `first_sample()`) yields rows in its own order:
  `from_generator(fn)` and `tf.data.Dataset`;

and a source may make whole batches itself (`producer`: DALI's pipelines).

A `SampleSpec` records the structure, shapes and dtypes of one sample and checks every later
sample against it. Nothing here imports TensorFlow at module level: worker processes import it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import optree

from feedpipe.core.skips import ErrorPolicy, listed, over_budget

# numpy dtype kinds that cannot become numeric tensors: objects, strings, bytes, datetimes.
_NON_TENSOR_KINDS = frozenset("OUSMm")


def is_tensor_dtype(dtype: np.dtype) -> bool:
    """Numbers and booleans, including ml_dtypes' (bfloat16, float8); not records or raw void."""
    return dtype.kind not in _NON_TENSOR_KINDS and dtype.type is not np.void


def as_array(leaf: Any) -> np.ndarray:
    """`leaf`, a field of a sample, as a numpy array (`np.asarray`); a torch tensor of a float
    numpy lacks (bfloat16, float8) as the same bits in ml_dtypes' dtype of that name, which
    every framework's feeder stages as that dtype."""
    try:
        return np.asarray(leaf)
    except TypeError as error:
        return _torch_float(leaf, error)


def _torch_float(tensor: Any, error: TypeError) -> np.ndarray:
    """`tensor`, a torch bfloat16 or float8 tensor whose `__array__` raised `error`, as
    ml_dtypes' array of its bits; `error` raised as it is for anything else."""
    name = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
    floats = name == "bfloat16" or name.startswith("float8")
    if type(tensor).__module__.split(".")[0] != "torch" or not floats:
        raise error
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            f"A field is a torch.{name} tensor, and numpy holds {name} only with the ml_dtypes "
            f"package, which is not installed: pip install ml_dtypes, and the feeder stages "
            f"it as {name}; or cast it (tensor.float()) in the dataset or `transform`."
        ) from error
    ours = np.dtype(getattr(ml_dtypes, name))
    torch = sys.modules["torch"]  # loaded: `tensor` is one of its tensors
    bits = {1: torch.uint8, 2: torch.int16}[ours.itemsize]
    return tensor.detach().cpu().view(bits).numpy().view(ours)


def _refuse_empty(length: int) -> None:
    if length < 1:
        raise ValueError("`source` is empty (0 samples); give the feeder at least one sample.")


def field_name(path: tuple) -> str:
    """The user-facing name of a leaf, e.g. `[0]`, `['image']`, or `sample` for a bare array."""
    return "".join(f"[{key!r}]" for key in path) or "sample"


@dataclasses.dataclass(frozen=True, slots=True)
class LeafSpec:
    """Shape and dtype of one field of a sample (without the batch dimension)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    """The structure of a sample and the shape and dtype of each of its fields."""

    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSpec, ...]

    @classmethod
    def of(cls, sample: Any, *, index: int | str = 0) -> SampleSpec:
        """Reads the spec from one sample, refusing fields that cannot become tensors."""
        paths, leaves, treespec = optree.tree_flatten_with_path(sample)
        if not leaves:
            raise ValueError(f"Sample {index} has no fields (got {sample!r}); samples need data.")
        specs = []
        for path, leaf in zip(paths, leaves, strict=True):
            array = as_array(leaf)
            name = field_name(path)
            if not is_tensor_dtype(array.dtype):
                raise TypeError(
                    f"Field {name} of sample {index} has dtype {array.dtype}, which cannot be "
                    "staged as a numeric tensor; encode it as numbers first (for example "
                    "strings to integer ids) or drop the field."
                )
            specs.append(LeafSpec(name, array.shape, array.dtype))
        return cls(treespec, tuple(specs))

    def flatten(self, sample: Any, index: int | str) -> list[np.ndarray]:
        """The fields of `sample` as arrays, checked against this spec."""
        leaves, treespec = optree.tree_flatten(sample)
        if treespec != self.treespec:
            raise ValueError(
                f"Sample {index} has structure {treespec}, but the first sample had "
                f"{self.treespec}; every sample (after `transform`) must have the same structure."
            )
        arrays = []
        for spec, leaf in zip(self.leaves, leaves, strict=True):
            array = as_array(leaf)
            if array.shape != spec.shape or array.dtype != spec.dtype:
                raise ValueError(
                    f"Field {spec.name} of sample {index} has shape {array.shape} and dtype "
                    f"{array.dtype}, but the first sample had shape {spec.shape} and dtype "
                    f"{spec.dtype}; make every sample the same shape and dtype (pad, crop or "
                    "cast in `transform`)."
                )
            arrays.append(array)
        return arrays

    def transposed(self, axes: Sequence[tuple[int, ...] | None]) -> SampleSpec:
        """This spec with the axes of field `i` reordered by `axes[i]` (None: unchanged)."""
        leaves = tuple(
            leaf
            if order is None
            else LeafSpec(leaf.name, tuple(leaf.shape[a] for a in order), leaf.dtype)
            for leaf, order in zip(self.leaves, axes, strict=True)
        )
        return SampleSpec(self.treespec, leaves)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return optree.tree_unflatten(self.treespec, list(leaves))

    @property
    def row_bytes(self) -> int:
        return sum(leaf.row_bytes for leaf in self.leaves)

    def __str__(self) -> str:
        fields = ", ".join(f"{leaf.name}: {leaf.dtype}{list(leaf.shape)}" for leaf in self.leaves)
        return f"{self.treespec} with {fields}"


class Source:
    """What the pipeline asks of every source; the defaults suit most of them."""

    length: int | None = None
    """Samples per epoch; None where unknown until the epoch ends (a stream)."""
    indexed = False
    """True: any sample can be read on demand with `sample(i)`, so the feeder picks the order."""
    block_size = 1
    """Shuffle in blocks of this many consecutive samples (a PyDataset: its batch size)."""
    shards_order = False
    """True: with N workers, the stream is N shards and its order is their rotation."""
    replicas_order = False
    """True: each replica reads a shard of its own, so the order depends on the replica count
    (DALI); otherwise the global order is the same for any number of replicas and hosts."""
    own_threads: int | None = None
    """Threads the source runs its work in itself (DALI's `num_threads`); None: the feeder's
    producer thread or workers do the work."""

    def on_epoch_end(self) -> None:
        """Called once an epoch's last sample has been read."""

    def measure(self, policy: ErrorPolicy | None = None) -> Any:
        """Reads what must be read before the epochs can be planned (a PyDataset's batch size
        and length), under `policy` where given; returns it, for `learn` to tell another copy
        of the source (None: nothing to read)."""
        return None

    def learn(self, measured: Any) -> None:
        """Takes what `measure` read in another copy of the source (a worker's)."""

    def producer(self, share, devices, rule):
        """The producer of a source that makes whole batches itself; None for the others."""
        return None

    def check_resumable(self, skipped: int) -> None:
        """Raises if skipping the first `skipped` samples of a fresh epoch cannot resume it."""


class ArraySource(Source):
    """Samples are rows of numpy arrays (one array, or a tuple/dict of equal-length arrays).
    With `text`, arrays of strings too, for a `transform` to read (file paths); what it returns
    is what reaches a slot."""

    indexed = True

    def __init__(self, data: Any, *, text: bool = False):
        paths, nodes, _ = optree.tree_flatten_with_path(data, is_leaf=_is_list)
        for path, leaf in zip(paths, nodes, strict=True):
            if isinstance(leaf, list):
                raise TypeError(
                    f"Field {field_name(path)} of `source` is a list of {len(leaf)} items; a "
                    "field is one array whose first dimension counts the samples: stack them "
                    "(np.stack(images)), or pass a list of samples (list(zip(images, labels)))."
                )
        paths, leaves, self.treespec = optree.tree_flatten_with_path(data)
        self.arrays = [np.asarray(leaf) for leaf in leaves]
        for path, array in zip(paths, self.arrays, strict=True):
            strings = text and array.dtype.kind in "SU"
            if array.ndim == 0:
                raise ValueError(
                    f"Field {field_name(path)} of `source` is a scalar ({array!r}); every array "
                    "needs a first dimension that counts samples."
                )
            if not is_tensor_dtype(array.dtype) and not strings:
                # Rows are gathered with no per-sample check, so an object array would be cast
                # silently (1.7 becomes 1 when the first row is an int): refuse it up front.
                raise TypeError(
                    f"Field {field_name(path)} of `source` has dtype {array.dtype}, which cannot "
                    "be staged as a numeric tensor; convert it first (for example "
                    "np.asarray(x, dtype=np.float32), or strings to integer ids) or drop it."
                )
        lengths = {field_name(p): len(a) for p, a in zip(paths, self.arrays, strict=True)}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
            raise ValueError(
                f"The arrays of `source` have unequal lengths ({listed}); give every array the "
                "same number of samples along its first dimension."
            )
        self.length = len(self.arrays[0])
        _refuse_empty(self.length)

    def sample(self, index: int) -> Any:
        return optree.tree_unflatten(self.treespec, [array[index] for array in self.arrays])

    def take(self, indices: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Gathers the rows `indices` of every array into `outs` with one copy each."""
        for array, out in zip(self.arrays, outs, strict=True):
            # mode="clip" lets numpy write straight into `out`; the sampler's indices are valid.
            np.take(array, indices, axis=0, out=out, mode="clip")

    def __repr__(self) -> str:
        return f"ArraySource(length={self.length}, fields={len(self.arrays)})"


class MapSource(Source):
    """Samples come from an object with `__len__` and `__getitem__(i)` returning one sample."""

    indexed = True

    def __init__(self, data: Any):
        self.data = data
        self.length = len(data)
        _refuse_empty(self.length)

    def sample(self, index: int) -> Any:
        return self.data[index]

    def __repr__(self) -> str:
        return f"MapSource({type(self.data).__name__}, length={self.length})"


class PyDatasetSource(Source):
    """Samples are the rows of a `keras.utils.PyDataset`'s batches.

    Its batches are read whole and kept while their rows are taken, and the sampler shuffles
    whole batches (`block_size` rows), so each batch is read once per epoch. Its batch size and
    length are read from its batches by `measure` (in a worker, where there are workers): the
    last one and the first that reads of the others.
    """

    indexed = True

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.num_batches = dataset.num_batches
        if self.num_batches is None:
            raise ValueError(
                "`source` is a PyDataset without a length (num_batches is None); give it a "
                "`__len__`, or wrap its batches in fp.from_generator."
            )
        if self.num_batches < 1:
            raise ValueError("The dataset is empty (the PyDataset has 0 batches).")
        self.rows: tuple[int, int] | None = None
        """The rows of every batch but the last, and the rows of all, once measured."""
        self._local = threading.local()

    @property
    def block_size(self) -> int:
        return self.measure()[0]

    @property
    def length(self) -> int:
        return self.measure()[1]

    def measure(self, policy: ErrorPolicy | None = None) -> tuple[int, int]:
        """Reads the rows of the last batch, which the length depends on, and of the first of
        the others that reads: under `policy`'s `errors="skip"`, batches that raise are passed
        over, as the epochs will skip their rows, within the budget."""
        if self.rows is None:
            self.rows = self._measure(policy)
        return self.rows

    def learn(self, measured: tuple[int, int]) -> None:
        self.rows = tuple(measured)

    def _measure(self, policy: ErrorPolicy | None) -> tuple[int, int]:
        skips = policy is not None and policy.skips
        last_number = self.num_batches - 1
        last = self._rows_of(
            last_number,
            "count its rows, which the length depends on"
            + (' (errors="skip" cannot pass over it)' if skips else ""),
        )
        if not last_number:
            return last, last
        # Each batch passed over holds at least one sample the epochs will skip, so passing
        # over more than the budget of the longest length possible is sure to exceed it.
        limit = policy.budget(last_number + last) if skips else 0
        failed: list[int] = []
        for number in range(last_number):
            try:
                block = self._rows_of(number, "learn its batch size")
                break
            except Exception as error:
                failed.append(number)
                if len(failed) > limit or number + 1 == last_number:
                    if skips:
                        error.add_note(
                            f'feedpipe: errors="skip" passed over PyDataset batches '
                            f"{listed(failed)}, which all raised, and found none within "
                            f"{policy} to learn its batch size from."
                        )
                    raise
                latest = error
        length = block * last_number + last
        if failed and len(failed) * block > policy.budget(length):
            skipping = f"{len(failed) * block} samples of epoch 0 (batches {listed(failed)})"
            latest.add_note(over_budget(skipping, policy, policy.budget(length)))
            raise latest
        return block, length

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def _cache(self) -> dict[int, tuple[list[np.ndarray], optree.PyTreeSpec]]:
        """The batches this thread is reading (each worker thread keeps its own)."""
        if not hasattr(self._local, "cache"):
            self._local.cache = {}
        return self._local.cache

    def _batch(self, number: int) -> tuple[list[np.ndarray], optree.PyTreeSpec]:
        cache = self._cache
        if number not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            leaves, treespec = optree.tree_flatten(self.dataset[number])
            arrays = [np.asarray(leaf) for leaf in leaves]
            expected = self.block_size if number < self.num_batches - 1 else None
            sizes = {len(a) for a in arrays}
            if len(sizes) != 1 or (expected is not None and sizes != {expected}):
                raise ValueError(
                    f"PyDataset batch {number} has fields with {sorted(sizes)} rows; every "
                    f"batch but the last must have {self.block_size} rows in every field."
                )
            cache[number] = (arrays, treespec)
        return cache[number]

    def _rows_of(self, number: int, why: str) -> int:
        """The rows of batch `number`, read to `why`; an error gets a note saying so."""
        try:
            leaves = optree.tree_leaves(self.dataset[number])
            if not leaves:
                raise ValueError(f"PyDataset batch {number} has no fields.")
            return len(np.asarray(leaves[0]))
        except Exception as error:
            error.add_note(
                f"feedpipe: raised in {threading.current_thread().name} while reading batch "
                f"{number} of the PyDataset, to {why}."
            )
            raise

    def sample(self, index: int) -> Any:
        arrays, treespec = self._batch(index // self.block_size)
        row = index % self.block_size
        return optree.tree_unflatten(treespec, [array[row] for array in arrays])

    def on_epoch_end(self) -> None:
        self._cache.clear()
        self.dataset.on_epoch_end()

    def __repr__(self) -> str:
        rows = "unread" if self.rows is None else self.rows[1]
        return f"PyDatasetSource(batches={self.num_batches}, rows={rows})"


class GeneratorSource(Source):
    """Samples come from `fn(shard, num_shards)`, a generator function called once per epoch
    (`fn(shard, num_shards, epoch)` where `fn` takes three arguments).

    Build one with `fp.from_generator(fn)`. With one producer, `fn(0, 1)` yields the whole
    epoch; with N workers, worker `i` reads the `sharded(i, N)` copy, which calls `fn(i, N)`.
    """

    shards_order = True

    def __init__(
        self, fn: Callable[[int, int], Iterable[Any]], shard: int = 0, num_shards: int = 1
    ):
        if not callable(fn):
            raise TypeError(
                f"fp.from_generator needs a callable fn(shard, num_shards) that yields samples; "
                f"got {type(fn).__name__}."
            )
        if not (_accepts(fn, 2) or _accepts(fn, 3)):
            raise TypeError(
                f"fp.from_generator(fn): fn{_signature(fn)} must take fn(shard, num_shards) (or "
                "fn(shard, num_shards, epoch)): each producer calls it for its shard of the "
                "samples, fn(0, 1) for all of them, and with workers=N worker i calls fn(i, N), "
                "so every shard is read once. Yield every num_shards-th sample from the "
                "shard-th, e.g. fp.from_generator(lambda shard, num_shards: "
                "itertools.islice(rows(), shard, None, num_shards))."
            )
        self.fn = fn
        self.shard = shard
        self.num_shards = num_shards
        self.takes_epoch = _accepts(fn, 3)

    def sharded(self, shard: int, num_shards: int) -> GeneratorSource:
        """The source of shard `shard` of `num_shards`."""
        return GeneratorSource(self.fn, shard, num_shards)

    def samples(self, epoch: int) -> Iterator[Any]:
        if self.takes_epoch:
            return iter(self.fn(self.shard, self.num_shards, epoch))
        return iter(self.fn(self.shard, self.num_shards))

    def first_sample(self) -> Any:
        for sample in self.samples(0):
            return sample
        raise ValueError("The dataset is empty: the generator yielded no sample.")

    def __repr__(self) -> str:
        return f"GeneratorSource({getattr(self.fn, '__qualname__', self.fn)!r})"


def from_generator(fn: Callable[..., Iterable[Any]]) -> GeneratorSource:
    """A source of the samples that `fn(shard, num_shards)` yields, for `fp.Feeder`.

    `fn` is called once per epoch; each call must yield that epoch's samples (a shard of them
    when `num_shards` > 1: with N workers every shard is read, so a `fn` that ignores its shard
    delivers each sample N times). Generators have no indices, so they cannot be shuffled by the
    feeder: shuffle inside `fn`, and take a third argument, `fn(shard, num_shards, epoch)`, to
    seed that shuffle from the epoch. A restore mid-epoch calls `fn` for the restored epoch and
    skips the samples already taken, so `fn` must yield the same order whenever it is called for
    the same epoch.
    """
    return GeneratorSource(fn)


class TFDatasetSource(Source):
    """Samples are the elements of a `tf.data.Dataset`, read in blocks batched by TensorFlow."""

    def __init__(self, dataset: Any):
        import tensorflow as tf

        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "`source` is an infinite tf.data.Dataset; an epoch must end: use "
                "dataset.take(n) for n samples per epoch."
            )
        if cardinality == 0:
            raise ValueError("The dataset is empty: the tf.data.Dataset has 0 elements.")
        self.length = cardinality if cardinality > 0 else None
        self.dataset = dataset
        paths, specs, _ = optree.tree_flatten_with_path(dataset.element_spec)
        for path, spec in zip(paths, specs, strict=True):
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise ValueError(
                    f"Field {field_name(path)} of the tf.data.Dataset's elements is {spec}; the "
                    "feeder needs tensors of one fixed shape (pad or resize them in dataset.map)."
                )

    def samples(self, epoch: int) -> Iterator[Any]:
        del epoch  # tf.data decides its own order (shuffle inside the dataset)
        return self.dataset.as_numpy_iterator()

    def check_resumable(self, skipped: int) -> None:
        """Refuses to resume mid-epoch where a new iteration would reorder the samples."""
        from feedpipe._internals import unseeded_or_reshuffling

        why = unseeded_or_reshuffling(self.dataset)
        if why is not None:
            raise ValueError(
                f"Cannot restore mid-epoch: the tf.data.Dataset source shuffles {why}, so a new "
                "iteration does not repeat the order being resumed, and skipping the "
                f"{skipped} samples already taken would deliver some twice and others never. "
                "Shuffle with a seed and reshuffle_each_iteration=False, or give the feeder an "
                "indexed source (arrays, a map-style object) with shuffle=True, or restore a "
                "state taken at an epoch's end."
            )

    def blocks(self, rows: int) -> Iterator[list[np.ndarray]]:
        """Blocks of up to `rows` samples, batched by tf.data itself."""
        for block in self.dataset.batch(rows).prefetch(2):
            yield [np.asarray(leaf) for leaf in optree.tree_leaves(block)]

    def first_sample(self) -> Any:
        for sample in self.samples(0):
            return sample
        raise ValueError("The dataset is empty: the tf.data.Dataset yielded no element.")

    def __repr__(self) -> str:
        return f"TFDatasetSource(length={self.length})"


def _is_list(node: Any) -> bool:
    return isinstance(node, list)


def _accepts(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments."""
    try:
        inspect.signature(fn).bind(*range(count))
    except (TypeError, ValueError):
        return False
    return True


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _is_instance_of_loaded(obj: Any, module: str, path: str) -> bool:
    """isinstance against a class of `module`, without importing it when it is not loaded yet."""
    root = sys.modules.get(module)
    if root is None:
        return False
    cls: Any = root
    for part in path.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            return False
    return isinstance(obj, cls)


def _check_list_of_samples(data: list, global_batch_size: int | None) -> None:
    """A list is read as samples; arrays in one are fields, passed as a list where a tuple was
    meant (`fp.Feeder([x, y], ...)`), where their shapes differ (say so before sample 1 fails),
    or where they are fewer than `global_batch_size` and each counts more rows than the list
    has items (`[x, y_onehot]`, both (1000, 10): 2 samples, each batch nearly all padding)."""
    if len(data) < 2 or not all(isinstance(item, np.ndarray) for item in data):
        return
    shapes = [item.shape for item in data]
    if len(set(shapes)) > 1:
        listed = ", ".join(str(shape) for shape in shapes[:4]) + (", ..." if len(data) > 4 else "")
        raise ValueError(
            f"`source` is a list, which is read as samples (sample i is source[i]), but its "
            f"{len(data)} items are arrays of different shapes ({listed}): fields, it seems. "
            "Pass fields as a tuple of equal-length arrays, fp.Feeder((x, y), ...), whose "
            "sample i is (x[i], y[i]); a list of samples needs samples of one shape."
        )
    shape, count = shapes[0], len(data)
    if global_batch_size is None or count >= global_batch_size or not shape or shape[0] <= count:
        return
    raise ValueError(
        f"`source` is a list of {count} arrays of shape {shape}, which is read as {count} "
        f"samples, fewer than `global_batch_size`={global_batch_size}: every batch would be "
        f"mostly padding. They look like fields of {shape[0]} samples: pass fields as a tuple, "
        f"fp.Feeder((x, y), {global_batch_size}), whose sample i is (x[i], y[i]). If they are "
        f"{count} samples, stack them, fp.Feeder(np.stack(samples), ...), with a global batch "
        f"of at most {count}."
    )


def as_source(data: Any, *, text: bool = False, global_batch_size: int | None = None) -> Source:
    """Adapts what the user passed as `source` to the matching source class; with `text`,
    arrays may hold strings (file paths that a `transform` reads). `global_batch_size`, where
    given, tells a list of samples from fields passed as a list."""
    if isinstance(data, Source):
        return data  # fp.from_generator(fn), or a DaliSource (see feedpipe.dali)
    if _is_instance_of_loaded(data, "tensorflow", "data.Dataset"):
        return TFDatasetSource(data)
    if _is_instance_of_loaded(data, "keras", "utils.PyDataset"):
        return PyDatasetSource(data)
    if isinstance(data, np.ndarray | tuple | dict) or _is_instance_of_loaded(
        data, "tensorflow", "Tensor"
    ):
        return ArraySource(data, text=text)
    if isinstance(data, list):
        _check_list_of_samples(data, global_batch_size)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapSource(data)
    if callable(data) or hasattr(data, "__next__"):
        raise TypeError(
            f"`source` is a {type(data).__name__}; wrap a generator function as "
            "fp.from_generator(fn), where fn(shard, num_shards) yields samples."
        )
    raise TypeError(
        f"`source` of type {type(data).__name__} is not supported; pass numpy arrays (an "
        "array, tuple or dict of equal-length arrays), an object with __len__ and "
        "__getitem__, a keras.utils.PyDataset, fp.from_generator(fn) or a tf.data.Dataset."
    )
