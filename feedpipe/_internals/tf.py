"""Every call feedpipe makes into TensorFlow's private APIs: tf.data's dataset classes and
`tensorflow.python` modules, a strategy's private fields, and the tf.data service's gRPC call.

Each is here because no public API does the job (the reason is beside it), so a new release of
TensorFlow is checked against this file alone. TensorFlow is imported inside the functions:
importing this module imports no framework.
"""

from __future__ import annotations

from collections.abc import Iterator
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
