"""The base every source shares: what the pipeline asks of a source (`Source`), and what a
sample is (`SampleSpec`).

A `SampleSpec` records the structure, shapes and dtypes of one sample and checks every later
sample against it. Nothing here imports TensorFlow at module level: worker processes import it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import optree

from feedpipe.core.skips import ErrorPolicy

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


def refuse_empty(length: int) -> None:
    """Refuses a source of no samples."""
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


def is_instance_of_loaded(obj: Any, module: str, path: str) -> bool:
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

    @classmethod
    def adapts(cls, data: Any) -> bool:
        """Whether `data` is what this kind reads (`as_source` asks each kind in turn)."""
        return False

    @classmethod
    def adapt(cls, data: Any, *, text: bool, global_batch_size: int | None) -> Source:
        """This kind over `data`, which `adapts` accepted; `text` and `global_batch_size` as
        `as_source` takes them."""
        return cls(data)

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
