"""Every call feedpipe makes into TensorFlow's, Keras's, JAX's and PyTorch's private APIs, in one
place.

Each is here because no public API does the job (the reason is beside it), so a new release of
TensorFlow, Keras, JAX or PyTorch is checked against this file alone. They are imported inside the
functions: worker processes import modules that use this one and never load them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any


def copy_to_device(tensor: Any, device: str) -> Any:
    """`tensor` placed on `device`: the eager runtime's own placement, ~3 µs, where
    `tf.identity` under `tf.device` costs ~50 µs; between CPU devices it shares the buffer."""
    return tensor._copy_to_device(device)


def _single_device_function(function: Any, transformation: str, **structure: Any) -> Any:
    """`function` traced as tf.data traces a dataset's function, declared to run on the
    dataset's one device (see `single_device_map`); `structure` is its input, as
    `StructuredFunctionWrapper` takes it (`dataset=` or `input_structure=`)."""
    from tensorflow.python.data.ops import structured_function

    return structured_function.StructuredFunctionWrapper(
        function,
        transformation,
        defun_kwargs={"experimental_ints_on_device": True},
        **structure,
    )


def single_device_map(dataset: Any, function: Any, *, in_calling_thread: bool = False) -> Any:
    """`dataset.map(function)`, its function declared to run on the dataset's one device, and,
    `in_calling_thread`, its ops run in the thread that asks for the element.

    Every new iterator instantiates a dataset's functions afresh, and a function tf.data may
    spread over devices goes through Grappler each time: ~2 ms a function on 2 cores, against
    ~0.2 ms declared single-device (the `experimental_ints_on_device` attribute, as TensorFlow's
    own `prefetch_to_device` declares its function). Keras makes two iterators an epoch. The
    public `map` runs a small function of a few stateful ops, taken in the consumer's
    `get_next`, on TensorFlow's inter-op pool: ~60 µs an element of hand-offs, against ~5 µs in
    the calling thread (`use_inter_op_parallelism=False`). No public argument sets either."""
    try:
        from tensorflow.python.data.ops import dataset_ops
        from tensorflow.python.ops import gen_dataset_ops

        class SingleDeviceMap(dataset_ops.UnaryDataset):
            def __init__(self):
                self._name = None
                self._map_func = _single_device_function(function, "Dataset.map()", dataset=dataset)
                common = dict(
                    f=self._map_func.function,
                    use_inter_op_parallelism=not in_calling_thread,
                    preserve_cardinality=True,
                    **self._common_args,
                )
                inputs = (dataset._variant_tensor, self._map_func.function.captured_inputs)
                super().__init__(dataset, gen_dataset_ops.map_dataset(*inputs, **common))

            def _functions(self):
                return [self._map_func]

            @property
            def element_spec(self):
                return self._map_func.output_structure

        return SingleDeviceMap()
    except (ImportError, AttributeError, TypeError):  # a TensorFlow without them: the public map
        return dataset.map(function)


def generator_dataset(make: Any, signature: Any) -> Any:
    """`tf.data.Dataset.from_generator(make, output_signature=signature)`, for a `make()` whose
    iterator yields elements of `signature` as numpy arrays of its dtypes, with the functions
    declared single-device (see `single_device_map`).

    `from_generator` builds each iterator from four functions tf.data may spread over devices
    (~30 ms to make one on 2 cores, twice an epoch under Keras); here three, each a
    `numpy_function`, run by TensorFlow's `GeneratorDataset` as `from_generator`'s are: the
    first, as the iterator gives its first element, calls `make()`; the second takes each
    element; the last closes the generator when the iterator ends or is freed. Arrays aligned
    to 64 bytes reach TensorFlow without a copy."""
    import itertools

    import numpy as np
    import tensorflow as tf

    generators: dict[int, Any] = {}
    numbers = itertools.count()
    flat_signature = tf.nest.flatten(signature)
    types = [spec.dtype for spec in flat_signature]

    def start() -> np.ndarray:
        number = next(numbers)
        generators[number] = iter(make())
        return np.int64(number)

    def element(number: np.ndarray) -> list:
        return tf.nest.flatten(next(generators[int(number)]))  # StopIteration: its end

    def finish(number: np.ndarray) -> np.ndarray:
        generator = generators.pop(int(number), None)
        if generator is not None and hasattr(generator, "close"):
            generator.close()
        return np.int64(0)

    def start_fn(_):
        return tf.numpy_function(start, [], tf.int64, stateful=True)

    def element_fn(number):
        flat = tf.numpy_function(element, [number], types, stateful=True)
        for tensor, spec in zip(flat, flat_signature, strict=True):
            tensor.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(signature, flat)

    def finish_fn(number):
        return tf.numpy_function(finish, [number], tf.int64, stateful=True)

    try:
        from tensorflow.python.data.ops import dataset_ops
        from tensorflow.python.ops import gen_dataset_ops

        def wrapped(function: Any, number: Any) -> Any:
            return _single_device_function(
                function, "Dataset.from_generator()", input_structure=number
            )

        class GeneratorDataset(dataset_ops.DatasetSource):
            def __init__(self):
                self._name = None
                number = tf.TensorSpec((), tf.int64)
                self._start = wrapped(start_fn, number)
                self._element = wrapped(element_fn, number)
                self._finish = wrapped(finish_fn, number)
                variant = gen_dataset_ops.generator_dataset(
                    [tf.constant(0, tf.int64), *self._start.function.captured_inputs],
                    self._element.function.captured_inputs,
                    self._finish.function.captured_inputs,
                    init_func=self._start.function,
                    next_func=self._element.function,
                    finalize_func=self._finish.function,
                    **self._common_args,
                )
                super().__init__(variant)

            def _functions(self):
                return [self._start, self._element, self._finish]

            @property
            def element_spec(self):
                return signature

        return GeneratorDataset()
    except (ImportError, AttributeError, TypeError):  # a TensorFlow without them
        return tf.data.Dataset.from_generator(make, output_signature=signature)


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` was called: TensorFlow then
    refuses to run ops whose result may vary, `tf.timestamp` among them, and has no public way
    to ask."""
    from tensorflow.python.framework import config

    return config.is_op_determinism_enabled()


def host_index(strategy: Any) -> int:
    """This process's place among the hosts of a MultiWorkerMirroredStrategy: its id in the
    cluster (the chief first, then the workers), from which the strategy numbers its replicas
    (`replica_id_in_sync_group = host * local_replicas + local`). No public API tells it;
    `InputContext.input_pipeline_id` holds the same number but only inside a dataset
    function."""
    from tensorflow.python.distribute import multi_worker_util

    resolver = strategy.cluster_resolver
    return multi_worker_util.id_in_cluster(
        resolver.cluster_spec(), resolver.task_type, resolver.task_id
    )


def collective_timeout(strategy: Any) -> float | None:
    """The `CommunicationOptions(timeout_seconds=)` a multi-worker strategy was made with
    (None: its collectives wait forever); the strategy has no public getter for its options."""
    options = getattr(strategy.extended, "_communication_options", None)
    return getattr(options, "timeout_seconds", None)


def jax_distributed_client() -> Any:
    """The client of the coordination service `jax.distributed.initialize` connected this
    process to: its key-value store has reads with a deadline, which no public JAX API offers
    between processes (`multihost_utils` runs compiled collectives, which wait forever for a
    process that never joins)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "The feeder's devices span several processes, but jax.distributed is not "
            "initialized in this one; call jax.distributed.initialize() first."
        )
    return client


def uncommitted_jax_array(array: Any) -> Any:
    """`array`, a `jax.Array` on one device, as an uncommitted array on that device sharing its
    buffer: what `jax.device_put(numpy_array)` gives. `jit` compiles again for an argument
    that is committed where it was not, and no public API drops the commitment without a
    copy (`jax.device_put(array)` returns `array` as it is)."""
    from jax._src.array import ArrayImpl

    one = array.addressable_data(0)  # its sharding: SingleDeviceSharding, without a mesh
    return ArrayImpl(one.aval, one.sharding, [one], committed=False, _skip_checks=True)


def jax_dlpack_import() -> Callable[[Any, Any, int], Any] | None:
    """JAX's own DLPack import, `(capsule, device, DLPack device type) -> jax.Array`, without the
    Python around it, or None where this jaxlib has no such entry point.

    `jax.dlpack.from_dlpack` looks the backend and device up again, asks for a stream to order
    the import behind and wraps the array once more: 70 µs a field on a CPU here, 0.08 to 0.16
    ms on an H100, against 11 µs for the import itself; no public API imports without them."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    to_buffer = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    if to_buffer is None or jaxlib_extension_version < 467:
        return None

    def take(capsule: Any, device: Any, device_type: int) -> Any:
        return to_buffer(capsule, device, None, False, device_type)

    return take


def torch_default_store() -> Any:
    """The key-value store of `torch.distributed`'s default process group, whose waits take a
    deadline: no public API hands it out, and the collectives wait for the group's own timeout
    (30 minutes by default) for a process that never joins."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "The feeder is shared by several processes, but torch.distributed is not "
            "initialized in this one; call torch.distributed.init_process_group() first."
        )
    return dist.distributed_c10d._get_default_store()


def keras_torch_device() -> Any:
    """The device Keras's torch backend trains on (`keras.src.backend.torch.core.get_device`;
    Keras exports no getter for it)."""
    import torch
    from keras.src.backend.torch.core import get_device

    return torch.device(get_device())


def keras_dataset(*data: Any, **options: Any) -> Any:
    """The `tf.data.Dataset` Keras's `fit` would make of `data` (a generator, a PyDataset, or
    `x, y` arrays with `batch_size=`): Keras's own adapter, so the input is read exactly as
    `fit` reads it."""
    from keras.src.trainers.data_adapters import get_data_adapter

    adapter = get_data_adapter(*data, **options)
    adapter.on_epoch_begin()
    return adapter.get_tf_dataset()


def build_for_batch(model: Any, batch: Any) -> None:
    """Builds `model`, its loss, metrics and optimizer from `batch`, as `fit` does before its
    first step (a batch of per-replica values goes through Keras's distributed path)."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and any(
        isinstance(v, tf.distribute.DistributedValues) for v in tf.nest.flatten(batch)
    ):
        model._maybe_symbolic_build(iterator=[(0, 0, iter([batch]))])
    else:
        model._symbolic_build(data_batch=batch)


_KERAS_TRAINER = re.compile(r"keras[/\\]src[/\\]backend[/\\]\w+[/\\]trainer\.py$")


def keras_reading(adapter: Any) -> str | None:
    """Which of Keras's `fit`, `evaluate` or `predict` is reading `adapter` now (a `fit`'s
    validation is "evaluate"), or None outside them (see `keras_call`)."""
    call = keras_call(adapter)
    return None if call is None else call[0]


def keras_call(adapter: Any) -> tuple[str, dict[str, Any]] | None:
    """Which of Keras's `fit`, `evaluate` or `predict` is reading `adapter` now (a `fit`'s
    validation is "evaluate"), with the arguments it was called with; None outside them.

    Keras tells a data adapter nothing of what it is read for, yet `predict` must not see the
    padding rows `fit` trains on, and a custom adapter gets none of the call's `y`,
    `sample_weight` or `class_weight` (`get_data_adapter` returns it before it looks at them);
    the nearest of its backend trainer's methods on the calling stack says (the adapter is
    asked for its batches from inside the method). A validation's arguments are the fit's
    `validation_*` ones, which Keras has already unpacked: none are given for it.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit", "evaluate", "predict")):
        given, method = frame.f_locals, frame.f_code.co_name
        if method == "fit" and given.get("x") is not adapter:
            return "evaluate", {}  # the validation data of the fit
        names = ("y", "sample_weight", "class_weight")
        return method, {name: given[name] for name in names if name in given}
    return None


def keras_restored_epoch(model: Any) -> int | None:
    """The epoch `keras.callbacks.BackupAndRestore` restored `model` to begin its fits at, or
    None: it sets the model's `_initial_epoch`, which `fit` reads before its own
    `initial_epoch`, and no public name gives it."""
    return getattr(model, "_initial_epoch", None)


def keras_fit_input() -> Any:
    """The `x` of the Keras `fit` running on this thread (what it trains on), or None outside
    one: a callback is told nothing of it (see `keras_call`)."""
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        return frame.f_locals.get("x")
    return None


def _keras_trainer_frames(frame: Any, methods: tuple[str, ...]) -> Iterator[Any]:
    """The frames of Keras's backend trainer methods named `methods` on the calling stack of
    `frame`, nearest first: where Keras keeps what it tells neither a data adapter nor a
    callback (what `fit` was given, its epoch iterator, its callbacks)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in methods and _KERAS_TRAINER.search(code.co_filename):
            yield frame
        frame = frame.f_back


def keras_jax_batches(*data: Any, **options: Any) -> Iterator[Any]:
    """The batches Keras's JAX `fit` hands its train function for `data`, epoch after epoch
    until one is empty: its own epoch iterator, which places each batch as `fit` does (over a
    `DataParallel` distribution's devices)."""
    from keras.src.backend.jax.trainer import JAXEpochIterator

    epochs = JAXEpochIterator(*data, **options)
    while True:
        taken = 0
        for _, _, iterator in epochs:
            try:
                yield next(iterator)
            except StopIteration:
                break
            taken += 1
        if not taken:
            return
        epochs.reset()


def keras_torch_batches(*data: Any, **options: Any) -> Iterator[Any]:
    """The batches Keras's torch `fit` hands its train function for `data`, epoch after epoch
    until one is empty: its own epoch iterator (`TorchEpochIterator`), which reads each batch
    from the data adapter's `get_torch_dataloader()` as `fit` does."""
    from keras.src.backend.torch.trainer import TorchEpochIterator

    epochs = TorchEpochIterator(*data, **options)
    while True:
        taken = 0
        for _, _, batches in epochs:
            yield from batches
            taken += 1
        if not taken:
            return
        epochs.reset()


def read_keras_fit_input_through(wrap: Callable[[Iterator], Iterator]) -> bool:
    """Makes the Keras `fit` running on this thread read its input through `wrap(iterator)`
    from its next epoch on; whether such a fit was found (call it from `on_train_begin`).

    Keras's torch `fit` reads each batch in its epoch iterator, before it calls the train
    function, so a callback cannot see the read (on TensorFlow and JAX the train function reads
    it). No public API reaches that iterator: it is `fit`'s local `epoch_iterator`, found on
    the calling stack as `keras_reading` finds the trainer, which makes each epoch's iterator
    with its `_get_iterator()`. The epoch iterator ends with the fit, and the wrapping with it.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        epochs = frame.f_locals.get("epoch_iterator")
        if epochs is None or not hasattr(epochs, "_get_iterator"):
            return False
        epochs._get_iterator = lambda make=epochs._get_iterator: wrap(iter(make()))
        return True
    return False


def keras_global_seed_generator() -> Any:
    """The seed generator Keras's random ops draw from when given no seed (`keras.random.normal`
    in a layer's `call`), or None before one has: `keras.random` makes it in Keras's global
    state on first use, and no public name gives it."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    return global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)


def drop_keras_global_seed_generator() -> None:
    """Forgets Keras's global seed generator (see `keras_global_seed_generator`), as before
    its first use."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)


def jax_train_state(model: Any) -> tuple:
    """The state Keras's JAX train function takes and returns: the trainable, non-trainable,
    optimizer and metrics variables' arrays (the JAX trainer's own helper builds it; inside a
    fit the variables hold it at each epoch's end)."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )


def give_back_jax_train_state(model: Any, state: tuple) -> None:
    """Makes `state` (as `jax_train_state` gives it) the one Keras's JAX `fit` puts back into
    the model's variables when it ends (its `jax_state_sync`), also when it raises.

    Keras takes the state out of the variables as an epoch's first step begins (it empties
    them) and keeps the state each step returns in `_jax_state`, until the epoch's end; a step
    that raised before its batch was handed over donated nothing, but in a model's first fit
    there is no earlier state to put back, and the emptied variables would stay empty.
    """
    names = ("trainable", "non_trainable", "optimizer", "metrics")
    model._jax_state = {f"{name}_variables": part for name, part in zip(names, state, strict=True)}
    model._jax_state_synced = False


def in_keras_fit_with(callback: Any, frame: Any) -> bool:
    """Whether a Keras `fit` with `callback` among its callbacks is on the calling stack of
    `frame` (it has not returned or raised): no public API says which fit is running."""
    for fit in _keras_trainer_frames(frame, ("fit",)):
        callbacks = fit.f_locals.get("callbacks")
        if any(c is callback for c in getattr(callbacks, "callbacks", ())):
            return True
    return False


def keras_loss(loss: Any, y_true: Any, y_pred: Any) -> Any:
    """The Keras loss object `compile(loss=...)` would build from `loss` (a name, a class or a
    function), for these targets and predictions."""
    from keras.src.trainers import compile_utils

    return compile_utils.get_loss(loss, y_true, y_pred)


def keras_metric(metric: Any, y_true: Any, y_pred: Any) -> Any:
    """The Keras metric object `compile(metrics=[...])` would build from `metric`."""
    from keras.src.trainers import compile_utils

    return compile_utils.get_metric(metric, y_true, y_pred)


def unweighted_metrics(model: Any) -> list | None:
    """The metrics given to `model.compile(metrics=...)`, which ignore sample weights (no
    public attribute lists them apart from `weighted_metrics`)."""
    return getattr(getattr(model, "_compile_metrics", None), "_user_metrics", None)


def scalar_summary_metadata() -> Any:
    """What TensorBoard's scalar dashboard reads, written by TensorFlow alone:
    `tf.summary.scalar` needs the `tensorboard` package installed (viewing still does)."""
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )


def dataset_pipeline(dataset: Any) -> Iterator[Any]:
    """`dataset` and every dataset it reads, depth first (tf.data has no public graph walk)."""
    yield dataset
    try:
        inputs = dataset._inputs()
    except NotImplementedError:
        return
    for child in inputs:
        yield from dataset_pipeline(child)


def unseeded_or_reshuffling(dataset: Any) -> str | None:
    """How a shuffle in `dataset` changes its order between iterations, if one does: "anew on
    each iteration" (reshuffle_each_iteration=True) or "without a seed" (no op seed and no
    global seed: TensorFlow's seeds 0 and 0 mean random); None if none does."""
    for node in dataset_pipeline(dataset):
        if type(node).__name__ != "_ShuffleDataset":
            continue
        if node._reshuffle_each_iteration:
            return "anew on each iteration (reshuffle_each_iteration=True)"
        if int(node._seed) == 0 and int(node._seed2) == 0:
            return "without a seed"
    return None


def keras_validation_input(model: Any) -> Any:
    """What the validation of the running `fit` reads: the dataset its data adapter wraps, or
    the adapter itself (a feeder). Keras keeps the validation's epoch iterator on the model
    during `fit` (`_eval_epoch_iterator`); no public name gives it. None outside a fit."""
    adapter = getattr(getattr(model, "_eval_epoch_iterator", None), "data_adapter", None)
    return getattr(adapter, "_dataset", adapter)


def batch_keras_validation_arrays(adapter: Any, batch_size: int) -> None:
    """Makes the Keras `fit` that trains on `adapter` batch its validation arrays by
    `batch_size` where it was given no `validation_batch_size`, as `fit(x, y,
    batch_size=batch_size)` batches them.

    Keras batches them by `validation_batch_size or batch_size`, `fit`'s locals alone, and a fit
    on a data adapter has no `batch_size`, so 32 would apply. `fit` makes the validation's
    epoch iterator at its first validation unless the model holds one already
    (`_eval_epoch_iterator`, emptied as each fit begins); no public name sets either. It is
    made here, before that, as `fit` makes it, with `batch_size`.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        given = frame.f_locals
        model = given.get("self")
        if (
            given.get("x") is not adapter
            or given.get("validation_data") is None
            or given.get("validation_batch_size") is not None
            or getattr(model, "_eval_epoch_iterator", None) is not None
        ):
            return
        from keras import backend
        from keras.src.trainers.data_adapters.array_data_adapter import can_convert_arrays

        data = {name: given.get(f"val_{name}") for name in ("x", "y", "sample_weight")}
        if not can_convert_arrays(tuple(data.values())):
            return  # a dataset, a generator or a feeder: Keras reads its own batches
        options = {}
        if backend.backend() == "tensorflow":
            from keras.src.backend.tensorflow.trainer import TFEpochIterator as EpochIterator

            options["distribute_strategy"] = model.distribute_strategy
        elif backend.backend() == "jax":
            from keras.src.backend.jax.trainer import JAXEpochIterator as EpochIterator
        else:
            from keras.src.backend.torch.trainer import TorchEpochIterator as EpochIterator
        model._eval_epoch_iterator = EpochIterator(
            **data,
            batch_size=batch_size,
            steps_per_execution=model.steps_per_execution,
            steps_per_epoch=given.get("validation_steps"),
            shuffle=False,
            **options,
        )
        return


def keras_data_adapter() -> type:
    """Keras 3's `DataAdapter` base class: `model.fit` takes an instance of it as it is (its
    `get_data_adapter` returns "a custom data adapter" unchanged). No public name exports it."""
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    return DataAdapter


def dataset_graph(dataset: Any) -> Any:
    """The `GraphDef` of `dataset` as tf.data service gets it (the map functions in its
    library), to look for ops a service worker cannot run; no public API serializes a
    dataset, and tracing one inside a `tf.function` converts its functions otherwise."""
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    return graph


def dispatcher_error(address: str, timeout_s: float) -> str | None:
    """Why the tf.data service dispatcher at `address` (HOST:PORT) did not tell its version
    within `timeout_s`, or None if it did. TensorFlow's own calls to a dispatcher retry until
    one answers, and no public API asks one with a deadline; so this makes the dispatcher's
    `GetVersion` call (empty request, TensorFlow's first call to it) through gRPC, which
    TensorFlow depends on. A server that is not a dispatcher fails it at once."""
    import grpc

    def same(message: bytes) -> bytes:
        return message

    with grpc.insecure_channel(address) as channel:
        get_version = channel.unary_unary(
            "/tensorflow.data.DispatcherService/GetVersion",
            request_serializer=same,
            response_deserializer=same,
        )
        try:
            get_version(b"", timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return None
