"""Keras 3 on JAX: one model fitted on each peer's input, in rotating order, first epoch and
steady state apart (`gpu_fit.py` on a GPU, `keras_jax_fit.py` on CPU JAX)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

from kernels_bench import harness
from kernels_bench.harness.images import (
    CONV_WIDTHS,
    NUM_CLASSES,
    ImageSource,
    feeder_input,
    grain_dataset,
    have_grain,
    pydataset,
)
from kernels_bench.harness.parts import (
    epoch_metrics,
    feeder_params,
    session_params,
    session_reps,
    session_units,
)

FIT_PEERS = ("arrays", "feedpipe", "pydataset", "grain")


def convnet(shape: tuple[int, ...], seed: int):
    """The fit part's model, the same initial weights for a given seed. (Seeded per layer:
    `keras.utils.set_random_seed` would import TensorFlow wherever it is installed.)"""
    import keras

    def init(layer: int):
        return keras.initializers.GlorotUniform(seed=seed * 100 + layer)

    inputs = keras.Input(shape)
    h = inputs
    for layer, width in enumerate(CONV_WIDTHS):
        h = keras.layers.Conv2D(
            width, 3, strides=2, padding="same", activation="relu", kernel_initializer=init(layer)
        )(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(len(CONV_WIDTHS)))(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_clock():
    """A callback that reads the wall clock at the end of every step and every epoch."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_ends: list[float] = []
            self.steps: list[int] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.steps[-1] += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append(time.perf_counter())

    return Clock()


class FitPeers:
    """Builds each peer's input, fits the model on it, and tears it down."""

    def __init__(self, model, source: ImageSource, arrays, batch: int, workers: int, seed: int):
        self.model = model
        self.source = source
        self.arrays = arrays
        self.batch = batch
        self.workers = workers
        self.seed = seed
        self.feeder_stats: list = []

    def fit(self, peer: str, epochs: int, source: ImageSource | None = None, workers=None):
        """One `fit` of `epochs` on `peer`'s input built now; (start, Clock)."""
        source = self.source if source is None else source
        workers = self.workers if workers is None else workers
        clock = make_clock()
        callbacks = [clock]
        started = time.perf_counter()
        closing = None
        if peer == "ceiling":
            with feeder_input(source, self.batch, workers, self.seed) as data:
                for epoch in range(epochs):
                    clock.on_epoch_begin(epoch)
                    for batch in data:
                        del batch
                        clock.on_train_batch_end(0)
                    clock.on_epoch_end(epoch)
        elif peer == "arrays":
            count = len(source) // self.batch * self.batch
            x, y = self.arrays
            self.model.fit(
                x[:count],
                y[:count],
                batch_size=self.batch,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        else:
            if peer == "feedpipe":
                data = feeder_input(source, self.batch, workers, self.seed)
                callbacks.insert(0, data.fit_callback())
                closing = data.close
            elif peer == "pydataset":
                data = pydataset(source, self.batch, workers)
            elif peer == "grain":
                data = grain_dataset(source, self.batch, workers)
            else:
                raise ValueError(peer)
            try:
                self.model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
            finally:
                if peer == "feedpipe":
                    self.feeder_stats.append(data.stats())
                if closing is not None:
                    closing()
                del data
                gc.collect()
        return started, clock

    def session(self, peer: str, epochs: int) -> dict:
        """One timed `fit` of `epochs` on `peer`'s input: its `epoch_metrics`, and how many
        times the model's train step was compiled during it (`<peer>_compiles`)."""
        with train_step_compilations() as compiled:
            started, clock = self.fit(peer, epochs)
        steps = len(self.source) // self.batch
        metrics = epoch_metrics(peer, started, clock.epoch_ends, clock.steps, steps, epochs)
        return {**metrics, f"{peer}_compiles": len(compiled)}

    def warm_up(self, peers) -> None:
        """One untimed fit per peer over 2 batches: compiles the step for each input structure
        and pays each kind of input's one-off imports."""
        small = self.source.prefix(2 * self.batch)
        for peer in peers:
            self.fit(peer, 1, source=small, workers=min(self.workers, 1))


@contextlib.contextmanager
def train_step_compilations() -> Iterator[list[float]]:
    """The seconds of each XLA compilation of a Keras train step made inside, as a list (JAX
    records every compilation as an event with the function's name)."""
    import jax

    compiled: list[float] = []

    def listen(event: str, duration_s: float, **details) -> None:
        if event == COMPILE_EVENT and details.get("fun_name") == "jit(train_step)":
            compiled.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def fit_ratios(values: dict, peers: list[str]) -> None:
    for phase in ("steady", "epoch1"):
        for peer in peers:
            if peer != "arrays":
                values[f"{peer}_over_arrays_{phase}"] = (
                    values[f"{peer}_{phase}_steps_s"] / values[f"arrays_{phase}_steps_s"]
                )
            if peer not in ("arrays", "feedpipe") and "feedpipe" in peers:
                values[f"feedpipe_over_{peer}_{phase}"] = (
                    values[f"feedpipe_{phase}_steps_s"] / values[f"{peer}_{phase}_steps_s"]
                )
    if "feedpipe" in peers:
        values["feedpipe_epoch1_s_over_arrays"] = (
            values["feedpipe_epoch1_s"] / values["arrays_epoch1_s"]
        )
    if "ceiling" in peers:
        bound = min(values["arrays_steady_steps_s"], values["ceiling_steady_steps_s"])
        values["feedpipe_over_bound_steady"] = values["feedpipe_steady_steps_s"] / bound


def run_fit_comparison(
    report: harness.Report,
    settings: harness.Settings,
    *,
    case: str,
    shape: tuple[int, ...],
    batch: int,
    steps: int,
    epochs: int,
    workers: int,
    sample_s: float | Callable[[float], float],
    peers: list[str] | None = None,
) -> dict:
    """Keras 3 on JAX: `fit` of one model on each peer's input, in rotating order per
    repetition, and the feeder's producers alone (`ceiling`: the same feeder iterated with no
    model); adds `case` to `report` and returns its params. `sample_s` may be a function of
    the step's own time on arrays (seconds), measured after warm-up."""
    import keras

    if epochs < 2:
        raise SystemExit(f"--epochs={epochs}: the steady state is the epochs after the first.")
    peers = list(peers or FIT_PEERS)
    if "feedpipe" in peers:
        peers.append("ceiling")
    if "grain" in peers and not have_grain():
        peers.remove("grain")
        report.note(f"{case}: Grain is not installed here; its peer was left out.")
    model = convnet(shape, settings.seed)
    length = batch * steps
    images = ImageSource(length, 0.0, shape)
    arrays = images.arrays()
    fitting = FitPeers(model, images, arrays, batch, workers, settings.seed)
    fitting.warm_up(["arrays"])
    _, clock = fitting.fit("arrays", 2)
    step_s = (clock.epoch_ends[1] - clock.epoch_ends[0]) / steps
    per_sample = sample_s(step_s) if callable(sample_s) else sample_s
    source = ImageSource(length, per_sample, shape)
    fitting.source = source
    print(
        f"fit: step on arrays {step_s * 1e3:.1f} ms; source {source.calibrated_s * batch * 1e3:.1f}"
        f" ms of CPU per batch of {batch} x {shape}, {workers} workers, {steps} steps x {epochs}"
        f" epochs; peers {', '.join(peers)}",
        flush=True,
    )
    fitting.warm_up(peers)
    reps = session_reps(settings, peers, lambda peer: fitting.session(peer, epochs), fit_ratios)
    stats = fitting.feeder_stats[-1] if fitting.feeder_stats else None
    params = {
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "model": f"convnet {list(CONV_WIDTHS)} stride 2, global pool, dense {NUM_CLASSES}",
        **session_params(source, batch, shape, steps, epochs, workers),
        "arrays_step_ms": step_s * 1e3,
        "source_serial_over_step": source.calibrated_s * batch / step_s,
        "peers": {
            "arrays": "model.fit(x, y, batch_size=B, shuffle=False)",
            "feedpipe": (
                f"model.fit(fp.Feeder(source, B, devices=jax.devices()[:1], workers={workers}),"
                " callbacks=[feeder.fit_callback()])"
            ),
            "pydataset": f"keras.utils.PyDataset(workers={workers}, use_multiprocessing=True)",
            "grain": (
                "grain.MapDataset.source(source).batch(B).to_iter_dataset().mp_prefetch("
                f"grain.MultiprocessingOptions(num_workers={workers}))"
                if "grain" in peers
                else "not installed or not asked for: left out"
            ),
            "ceiling": "the same feeder iterated with no model: the producers' own rate",
        },
        **feeder_params(stats),
    }
    report.add_case(case, params, reps, units=session_units(peers))
    return params


def target_second_fit(report: harness.Report, case: str, **applies) -> None:
    """The target of a `fit(feeder)` that is not the process's first (every timed one: the
    warm-up fitted first): its first epoch, start-up included, within 1.2x fit(x, y)'s."""
    report.target(
        case,
        "feedpipe_epoch1_s_over_arrays",
        "<=",
        1.2,
        "a second fit(feeder) in the process, first epoch (start-up included) / fit(x, y)'s",
        **applies,
    )
