"""Feeder: the object users build, a facade over the pipeline and its consumer.

`fp.Feeder(...)` builds the subclass of the framework that `devices` or `strategy` name
(`feedpipe.tf.feeder`, `feedpipe.jax.feeder`, `feedpipe.torch.feeder`), which supplies the
`Layer` that stages on its devices and its own ways in (`as_dataset`, a sharded global
batch). Everything else lives in a room of its own: the options (`feedpipe.options`), the
plan they make of the source (`feedpipe.plan`), the pipeline built from it
(`feedpipe.assembly`), the consumer's position and state
(`feedpipe.consumer`) and what a Keras fit has trained on (`feedpipe.keras.ledger`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from feedpipe._frameworks import feeder_class
from feedpipe.assembly import Assembly
from feedpipe.consumer import Consumer
from feedpipe.core.cost import SampleCost
from feedpipe.core.description import FeederDescription
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sources import SampleSpec
from feedpipe.core.stage import Layer
from feedpipe.core.stats import FeedStats
from feedpipe.options import FeedOptions
from feedpipe.plan import plan_feeder


class Feeder:
    """Builds each global batch on the host, splits it per replica, and stages it on each device.

    Iterating yields batches whose arrays already sit on their devices; each `for` loop runs
    one epoch from the feeder's position (a loop left early resumes where it stopped). Invariant:
    at most `depth` batches wait on each device, and `depth + 2` host slots (allocated once,
    reused) hold everything in flight.

    Args:
        source: The samples: arrays (one, or a tuple or dict of equal-length arrays), a
            map-style object with `__len__` and `__getitem__`, a `keras.utils.PyDataset`,
            `fp.from_generator(...)`, a `tf.data.Dataset`, or a `feedpipe.dali.DaliSource`.
        global_batch_size: Samples per step across every replica of every host; it must
            divide evenly among the replicas.
        devices: The replica devices: TensorFlow device strings (`["/gpu:0", "/gpu:1"]`), JAX
            devices (`jax.devices()`), a `jax.sharding.Mesh`, or PyTorch devices
            (`[torch.device("cuda:0")]`, or `["cuda:0"]` with `framework="torch"`). Default:
            every GPU, else the CPU, of the framework in use; on PyTorch, this process's GPU
            (one process per device), else the CPU.
        strategy: A `tf.distribute` strategy, whose replicas' devices are used instead.
        remainder: The epoch's last, partial batch: "pad" (real samples repeated, masked, and
            weighted zero for Keras), "drop" (left out, with a warning) or "error".
        shuffle: Shuffle each epoch's order from (seed, epoch).
        seed: Seeds the order and each sample's `transform` rng.
        workers: 0 makes batches in one background thread; N > 0 in N workers; "auto"
            measures what a sample costs and picks the kind and count (`describe()` says).
        depth: Batches staged on each device ahead of the step (2 hides one transfer).
        transform: A per-sample callable run by the producers, `transform(sample)` or
            `transform(sample, rng)` (or `(sample, seed)` for tf.data service).
        worker_mode: "process" (each worker its own interpreter and GIL) or "thread".
        timeout_s: Longest a worker may spend on one sample before `TimeoutError`; on Ray, a
            task unanswered this long is asked for again.
        errors: A sample that raises: "raise" (default) or "skip" (a masked padding row, named
            in `stats().skipped` and the state; docs/errors.md).
        max_skipped: With errors="skip", the samples an epoch may skip: a count, or a fraction
            of the epoch (default 0.01).
        transpose: Axis orders applied as samples are written, one order or a dict from field
            to order: `{"image": (2, 0, 1)}` makes HWC images CHW.
        service: Where the per-sample work runs instead of this host: a tf.data service
            dispatcher, "grpc://host:port", for a TensorFlow-ops `transform`; or a Ray
            cluster, "ray" (the one this process is connected to, or RAY_ADDRESS's) or
            "ray://host:port", for any Python (docs/multi-host.md).
        framework: "tensorflow", "jax" or "torch", where `devices` and `strategy` do not say.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Feeder:
        if cls is Feeder:
            try:
                given = cls.__signature__.bind_partial(*args, **kwargs).arguments
            except TypeError:
                given = {}  # __init__ raises Python's own error for these arguments
            cls = feeder_class(given.get("framework"), given.get("devices"), given.get("strategy"))
        return super().__new__(cls)

    def _layer(self, devices: Any, strategy: Any, global_batch_size: int) -> Layer:
        """The framework layer that stages this feeder's batches (each framework's subclass)."""
        raise NotImplementedError

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        devices: Any = None,
        strategy: Any = None,
        remainder: str = "pad",
        shuffle: bool = False,
        seed: int = 0,
        workers: int | str = 0,
        depth: int = 2,
        transform: Callable[..., Any] | None = None,
        *,
        worker_mode: str = "process",
        timeout_s: float | None = None,
        errors: str = "raise",
        max_skipped: int | float | None = None,
        transpose: Any = None,
        service: str | None = None,
        framework: str | None = None,
    ):
        self._arguments = {name: value for name, value in locals().items() if name != "self"}
        """What the feeder was built from, so that `like` can build another."""
        self._consumer: Consumer | None = None
        self.options = FeedOptions(
            global_batch_size,
            remainder=remainder,
            shuffle=shuffle,
            seed=seed,
            workers=workers,
            depth=depth,
            worker_mode=worker_mode,
            timeout_s=timeout_s,
            errors=errors,
            max_skipped=max_skipped,
            service=service,
        )
        if transform is not None and not callable(transform):
            raise TypeError(
                f"`transform` must be callable or None; got {type(transform).__name__}."
            )
        self.layer = self._layer(devices, strategy, self.options.global_batch_size)
        """The framework layer: its devices, this host's share, how it stages."""
        self.strategy = strategy
        self.source = source
        """The source as it was given (the arrays, the dataset, the generator source)."""
        try:
            plan, parts = plan_feeder(
                source,
                self.options,
                self.layer,
                transform=transform,
                transpose=transpose,
            )
            self._assembly = Assembly(plan, parts, self.layer)
        except BaseException:
            self.layer.close()  # which the assembly closes once built
            raise
        self._consumer = Consumer(self._assembly, StatsRecorder(self.options.depth))

    @property
    def devices(self) -> tuple[Any, ...]:
        """This host's replica devices (under a multi-worker strategy, not the other hosts')."""
        return self.layer.devices

    @property
    def share(self) -> Any:
        """This host's rows of each global batch (all of them on one host)."""
        return self.layer.share

    @property
    def split(self) -> Any:
        """How this host's rows divide among its devices."""
        return self._assembly.split

    @property
    def spec(self) -> SampleSpec:
        """What each host slot holds: the samples after `transform` and `transpose`."""
        return self._assembly.spec

    @property
    def staged_spec(self) -> SampleSpec:
        """Each field as the step receives it (a dtype the framework narrows, where no value
        changes: int64 ids that fit arrive as int32 on JAX without x64)."""
        return self._assembly.staged_spec

    # ---- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Steps per epoch."""
        if self._assembly.plan is None:
            raise TypeError(
                f"The number of steps is unknown: a {type(self._assembly.source).__name__} does "
                "not say how many samples it has."
            )
        return len(self._assembly.plan)

    def __iter__(self) -> Iterator[Any]:
        """The batches of the next epoch (or of the rest of an epoch left early).

        A batch counts as taken once the loop takes it; a step written as `with batch:` that
        an exception (Ctrl-C) ends gives its batch back, for `get_state()` and the next loop.
        """
        return self._consumer.iterate("loop", host=False)

    def as_dataset(self) -> Any:
        """A `tf.data.Dataset` of global batches for `model.fit` on TensorFlow (see the
        TensorFlow feeder's `as_dataset`); on JAX pass the feeder itself to `model.fit`."""
        raise TypeError(
            f"as_dataset() makes a tf.data.Dataset, but this feeder stages for "
            f"{self.layer.name}; pass the feeder itself: model.fit(feeder, "
            "callbacks=[feeder.fit_callback()]), or iterate it in a loop of your own."
        )

    def fit_callback(self) -> Any:
        """A Keras callback for `model.fit(feeder, callbacks=[...])` (or `feeder.as_dataset()`
        on TensorFlow): with it, `get_state()` and checkpoints taken in any callback hold
        exactly the batches the step trained on, and an error in the source or `transform`
        leaves `fit` as itself (see `feedpipe.keras.fit.FitTracker`)."""
        from feedpipe.keras.fit import FitTracker  # Keras is loaded only for a fit

        return FitTracker(self)

    def _reads_this(self, data: Any) -> bool:
        """Whether `data` reads this feeder (a framework adds its own datasets)."""
        return data is self

    # ---- diagnostics and state ------------------------------------------------------------

    def stats(self) -> FeedStats:
        """A snapshot of how well the step has been fed so far (`fp.FeedStats`)."""
        return self._consumer.snapshot()

    def describe(self) -> FeederDescription:
        """What this feeder is: its framework, source, batch, devices, workers, staging and
        host slots, as a frozen `feedpipe.core.description.FeederDescription`: a dataclass
        rather than a dict, so each field is documented where it is defined and read as an
        attribute that tools check; `to_dict()` gives the JSON. It says what the feeder was
        built as, never how it is doing (that is `stats()`)."""
        return self._assembly.describe()

    def sample_cost(self) -> SampleCost | None:
        """What one sample costs to make, measured now for about a third of a second on the
        source itself (its `transform` included): the wall and CPU time of a sample, and how
        fast a few threads make them, which tells waiting, GIL-bound Python and GIL-free
        native code apart (`feedpipe.core.cost`). None where nothing runs per sample (arrays
        without a transform) or the source is not indexed."""
        return self._assembly.sample_cost()

    def like(self, **changes: Any) -> Feeder:
        """A new feeder built from this one's arguments, with `changes`:
        `feeder.like(workers=8, worker_mode="thread")` tries another setting on the same
        source (`fp.diagnose` tries its first remedy so). It starts at the beginning."""
        return Feeder(**{**self._arguments, **changes})

    def get_state(self) -> dict:
        """The consumer's position, as a small JSON-serialisable dict.

        After `as_dataset()` has been read, the position is known only with a
        `fit_callback()` in the fit's callbacks (TensorFlow takes batches ahead of the step);
        without one this raises, until `set_state()` or a loop over the feeder itself.
        """
        return self._consumer.get_state()

    def set_state(self, state: dict) -> None:
        """Continues the stream exactly where `state` was taken; staged batches are remade.

        A loop over `as_dataset()` that is still open is superseded (Keras's look at a batch
        before training, for a restore in a callback's `on_train_begin`).
        """
        self._consumer.set_state(state)

    def state_dict(self) -> dict:
        """`get_state()` under PyTorch's name, so `torch.save` keeps the feeder's position
        beside the model's and the optimizer's `state_dict()` (any framework's feeder)."""
        return self.get_state()

    def load_state_dict(self, state_dict: dict) -> None:
        """`set_state()` under PyTorch's name: goes on exactly where `state_dict` was taken."""
        self.set_state(state_dict)

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A block whose reads train nothing (`fp.diagnose` measures in one): they read whole
        epochs from the next one begun (so `as_dataset().repeat()` can repeat), and the
        position, and so `get_state()`, is put back as it was when the block ends."""
        with self._consumer.set_aside():
            yield

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background thread and the workers, and frees staged batches; idempotent."""
        if self._consumer is not None:
            self._consumer.close()

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Feeder({self._assembly.source!r}, global_batch_size={o.global_batch_size}, "
            f"devices={list(self.devices)}, remainder={o.remainder!r}, shuffle={o.shuffle}, "
            f"seed={o.seed}, workers={o.workers}, depth={o.depth}"
            + (f", worker_mode={o.worker_mode!r}" if o.workers else "")
            + (f", timeout_s={o.timeout_s}" if o.timeout_s is not None else "")
            + (f", errors={o.errors!r}" if o.errors != "raise" else "")
            + (
                f", host={self.share.host} of {self.share.num_hosts}"
                if self.share.num_hosts > 1
                else ""
            )
            + ")"
        )


# `__new__` takes (*args, **kwargs) to build the framework's subclass; IDEs, notebooks and
# help() show `__init__`'s parameters instead, the one place they and their defaults are written.
_init = inspect.signature(Feeder.__init__, eval_str=True)
Feeder.__signature__ = _init.replace(parameters=list(_init.parameters.values())[1:])
