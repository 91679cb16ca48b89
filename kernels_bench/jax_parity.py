"""On 4 host devices of CPU JAX, with the data in memory, does a training loop fed by the
feeder run as fast as the same loop fed the way a JAX user feeds it without one?

A user who has the arrays in memory already has a feeder of sorts: slicing the rows and putting
them on the devices. Where the devices are the CPU that also does the slicing, every
microsecond the input spends is taken from the step, and the feeder's background thread does
its work on the step's own cores, where `stats()` cannot see it (the step never waits). Two
cases, each one model, data and step for both peers, in paired rounds: two sessions of each
peer a round, in the order A B B A, A alternating from round to round (a load that rises or
falls across a round then weighs on both alike); each session builds its peer's input inside
its timed call:

* optax loop: an MLP (`--features` 784 -> `--hidden` 512 -> 512 -> 10, ReLU, softmax
  cross-entropy, `optax.adam`), parameters replicated over a 1-D mesh of the 4 devices and the
  batch sharded along it, jitted once per peer; `--steps` (32) steps of `--batch` (256) rows per
  epoch, `--epochs` (3) epochs per session, each step waited for (`block_until_ready` on the
  loss: XLA:CPU with several host devices on 2 cores can stall in the gradients' all-reduce
  when many steps are queued). Peers: `plain`, `jax.device_put((x[rows], y[rows]),
  NamedSharding(mesh, P("batch")))` of contiguous rows, the loop a JAX user writes; and
  `feeder`, `for batch in fp.Feeder((x, y), B, devices=jax.devices())`, `(x, y), mask =
  batch.distributed()`, the step weighting its loss by the mask.
* keras fit: Keras 3 on JAX, the same MLP (`keras.Sequential`, Adam, sparse cross-entropy from
  logits) under `keras.distribution.DataParallel(devices=jax.devices())`, the natural 4-device
  set-up of Keras on JAX. Peers: `arrays`, `model.fit(x, y, batch_size=B, shuffle=True)`; and
  `feeder`, `model.fit(fp.Feeder((x, y), B, devices=jax.devices(), shuffle=True),
  callbacks=[feeder.fit_callback()])`. Both fits carry a callback that counts each step
  (`on_train_batch_end`), so Keras dispatches callbacks synchronously, reading each step's
  loss, in both peers alike.

Per round, each the mean of the peer's two sessions: `<peer>_epoch1_s` (from building the
input to the end of the first epoch: the feeder's construction, its thread's start and first
batch included; the steps were compiled before the rounds, and each peer's first compiled call
is reported apart as `<peer>_compile_s` in the case's params), `<peer>_steady_ms` (wall time
per step over the epochs after the first) and `<peer>_steady_cpu_ms` (this process's CPU,
every thread, per step over the same epochs). Ratios are times, feeder over its peer (above 1:
the feeder is slower), taken within each round, then the median over rounds:
`feeder_time_over_<peer>_steady` and `_epoch1`, and `feeder_cpu_over_<peer>_steady`. Targets:
`feeder_time_over_<peer>_steady` <= 1.05, in both cases. `other_cores` is the CPU other
processes used during the round; each case's `by_load` gives the ratios' medians over the
rounds with other processes under 0.1 core (`quiet`) and over the rest (`loaded`).

A third case, `phases`, times what each input path costs per batch with no step running, in
the same rounds: the step alone on a batch already on the devices (`step_plain_ms`,
`step_masked_ms`), the plain loop's sharded `device_put` (`plain_put_us`), the feeder alone
(`feeder_cpu_us`: the process's CPU, every thread, per batch of `for batch in feeder:
batch.distributed()`), and the feeder's staging on CPU devices taken apart on one slot's
bytes: the copy out of the slot (`stage_copy_us`), the global arrays made over the copy
(`stage_arrays_us`, `jax.make_array_from_callback` per field), and, for contrast, a
`jax.device_put` per device of each region copied alone, then
`jax.make_array_from_single_device_arrays` per field (`per_device_us`). `feeder.stats()` after
the last feeder session of each case is in that case's params.

Run: `python -m kernels_bench.jax_parity [--quick]` (sets `KERAS_BACKEND=jax` and
`XLA_FLAGS=--xla_force_host_platform_device_count=4` itself, so it must be a fresh process);
writes `kernels_bench/results/jax_parity.json`. No TensorFlow is imported (checked at the end).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kernels_bench import harness

DEVICES = 4
TARGET = 1.05
QUIET_CORES = 0.1
"""A round during which other processes used more CPU than this did not measure the peers
alone (as in `workers.py`): the case's `by_load` gives the ratios' medians both ways."""
CASES = ("optax loop", "keras fit")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--features", type=int, default=784, help="input features")
    parser.add_argument("--hidden", type=int, default=512, help="units of each hidden layer")
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per session (>= 2)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="paired rounds per case (default 16, or 6 with --quick; --reps sets the same)",
    )


def configure_environment() -> None:
    """What JAX and Keras read when they load: 4 host devices, Keras on JAX, quiet logs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise SystemExit(f"KERAS_BACKEND={backend}: this benchmark runs Keras on JAX; unset it.")
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    if "jax" in sys.modules:
        raise SystemExit("JAX was imported before the benchmark set its devices; run it afresh.")


def make_data(settings: harness.Settings) -> tuple[np.ndarray, np.ndarray]:
    """`--steps` batches of standard-normal features and labels in 0-9, as numpy makes them
    (not realigned: the plain loop's `device_put` copies rows that are not 64-byte aligned)."""
    args = settings.args
    rng = np.random.default_rng(settings.seed)
    rows = args.batch * args.steps
    x = rng.standard_normal((rows, args.features), dtype=np.float32)
    y = rng.integers(0, 10, rows).astype(np.int32)
    return x, y


def mark() -> tuple[float, float]:
    """The wall clock and this process's CPU time (every thread), in seconds."""
    return time.perf_counter(), time.process_time()


def blocked_steps(step: Callable[[], object], count: int) -> float:
    """Seconds for `count` calls of `step`, each waited for."""
    started = time.perf_counter()
    for _ in range(count):
        step().block_until_ready()
    return time.perf_counter() - started


# ---- optax loop ------------------------------------------------------------------------------


class OptaxLoop:
    """An MLP trained with optax on the 4 devices: the plain loop and the feeder's loop."""

    def __init__(self, x: np.ndarray, y: np.ndarray, settings: harness.Settings):
        import jax
        import jax.numpy as jnp
        import optax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        args = settings.args
        self.jax, self.x, self.y = jax, x, y
        self.batch, self.steps = args.batch, args.steps
        self.devices = jax.devices()
        mesh = Mesh(np.array(self.devices), ("batch",))
        self.sharding = NamedSharding(mesh, PartitionSpec("batch"))
        keys = jax.random.split(jax.random.key(settings.seed), 3)
        sizes = [args.features, args.hidden, args.hidden, 10]
        params = [
            jax.random.normal(key, (a, b)) / np.sqrt(a)
            for key, a, b in zip(keys, sizes, sizes[1:], strict=False)
        ]
        replicated = NamedSharding(mesh, PartitionSpec())
        self.params = jax.device_put(params, replicated)
        optimizer = optax.adam(1e-3)
        self.opt_state = jax.device_put(optimizer.init(self.params), replicated)

        def loss(params, xb, yb, weights):
            h = xb
            for w in params[:-1]:
                h = jax.nn.relu(h @ w)
            losses = optax.softmax_cross_entropy_with_integer_labels(h @ params[-1], yb)
            return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)

        def update(params, opt_state, xb, yb, weights):
            value, grads = jax.value_and_grad(loss)(params, xb, yb, weights)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        @jax.jit
        def plain_step(params, opt_state, xb, yb):
            return update(params, opt_state, xb, yb, jnp.ones(xb.shape[0], jnp.float32))

        @jax.jit
        def masked_step(params, opt_state, xb, yb, mask):
            return update(params, opt_state, xb, yb, mask.astype(jnp.float32))

        self.plain_step, self.masked_step = plain_step, masked_step

    def feeder(self, rows: int | None = None):
        import feedpipe as fp

        x, y = (self.x, self.y) if rows is None else (self.x[:rows], self.y[:rows])
        return fp.Feeder((x, y), self.batch, devices=self.devices)

    def put(self, i: int):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.jax.device_put((self.x[rows], self.y[rows]), self.sharding)

    def session(self, peer: str, epochs: int, steps: int | None = None) -> list:
        """One session of `epochs` epochs from fresh parameters: `mark()` at its start and at
        each epoch's end."""
        steps = self.steps if steps is None else steps
        params, opt_state = self.params, self.opt_state
        marks = [mark()]
        if peer == "plain":
            for _ in range(epochs):
                for i in range(steps):
                    xb, yb = self.put(i)
                    params, opt_state, loss = self.plain_step(params, opt_state, xb, yb)
                    loss.block_until_ready()
                marks.append(mark())
            return marks
        with self.feeder(steps * self.batch) as feeder:
            for _ in range(epochs):
                for batch in feeder:
                    (xb, yb), mask = batch.distributed()
                    params, opt_state, loss = self.masked_step(params, opt_state, xb, yb, mask)
                    loss.block_until_ready()
                marks.append(mark())
            self.stats = feeder.stats()
        return marks

    def compile_s(self) -> dict:
        """Each step's first call on its peer's first batch (the compile), in seconds."""
        started = time.perf_counter()
        xb, yb = self.put(0)
        self.plain_step(self.params, self.opt_state, xb, yb)[2].block_until_ready()
        plain = time.perf_counter() - started
        with self.feeder(self.batch) as feeder:
            (xb, yb), mask = next(iter(feeder)).distributed()
            started = time.perf_counter()
            self.masked_step(self.params, self.opt_state, xb, yb, mask)[2].block_until_ready()
        return {"plain_compile_s": plain, "feeder_compile_s": time.perf_counter() - started}


# ---- keras fit -------------------------------------------------------------------------------


class KerasFit:
    """Keras 3 on JAX, the MLP under `DataParallel` over the 4 devices: fit(x, y) and
    fit(feeder)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, settings: harness.Settings):
        import jax
        import keras

        args = settings.args
        self.keras, self.x, self.y = keras, x, y
        self.batch, self.steps, self.seed = args.batch, args.steps, settings.seed
        self.devices = jax.devices()
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=self.devices))

        # Seeded initialisers: keras.utils.set_random_seed would import TensorFlow to seed it.
        def dense(units: int, seed: int, **options):
            initializer = keras.initializers.GlorotUniform(seed=settings.seed + seed)
            return keras.layers.Dense(units, kernel_initializer=initializer, **options)

        self.model = keras.Sequential(
            [
                keras.Input((args.features,)),
                dense(args.hidden, 1, activation="relu"),
                dense(args.hidden, 2, activation="relu"),
                dense(10, 3),
            ]
        )
        self.model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def clock(self):
        """A callback that counts each step (which makes Keras read every step's loss) and
        reads the clocks (`mark()`) at every epoch's end."""

        class Clock(self.keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.marks: list[tuple[float, float]] = []
                self.steps: list[int] = []

            def on_epoch_begin(self, epoch, logs=None):
                self.steps.append(0)

            def on_train_batch_end(self, batch, logs=None):
                self.steps[-1] += 1

            def on_epoch_end(self, epoch, logs=None):
                self.marks.append(mark())

        return Clock()

    def session(self, peer: str, epochs: int, steps: int | None = None) -> list:
        """One fit of `epochs` epochs: `mark()` at the call and at each epoch's end."""
        import feedpipe as fp

        steps = self.steps if steps is None else steps
        rows = steps * self.batch
        clock = self.clock()
        started = mark()
        if peer == "arrays":
            self.model.fit(
                self.x[:rows],
                self.y[:rows],
                batch_size=self.batch,
                epochs=epochs,
                shuffle=True,
                verbose=0,
                callbacks=[clock],
            )
        else:
            source = (self.x[:rows], self.y[:rows])
            with fp.Feeder(
                source, self.batch, devices=self.devices, shuffle=True, seed=self.seed
            ) as feeder:
                self.model.fit(
                    feeder, epochs=epochs, verbose=0, callbacks=[feeder.fit_callback(), clock]
                )
                self.stats = feeder.stats()
        if clock.steps != [steps] * epochs:
            raise RuntimeError(f"{peer}: expected {epochs} epochs of {steps}, saw {clock.steps}")
        return [started, *clock.marks]

    def compile_s(self) -> dict:
        """Each peer's first fit, one epoch of 2 steps (Keras traces the step once per input
        structure: (x, y) for the arrays, (x, y, sample_weight) for the feeder)."""
        out = {}
        for peer in ("arrays", "feeder"):
            marks = self.session(peer, 1, steps=2)
            out[f"{peer}_compile_s"] = marks[1][0] - marks[0][0]
        return out


# ---- rounds ----------------------------------------------------------------------------------


def paired_rounds(
    report: harness.Report,
    settings: harness.Settings,
    case: str,
    runner: OptaxLoop | KerasFit,
    peers: tuple[str, str],
    params: dict,
) -> None:
    """`settings.reps` rounds of two sessions per peer, in the order A B B A (A alternating
    from round to round, so that a load that rises or falls across a round weighs on both
    peers alike); adds `case`."""
    args = settings.args
    other, feeder = peers
    compiled = runner.compile_s()
    for peer in peers:  # untimed: the first session of each pays its one-off costs
        runner.session(peer, 2)
    reps = []
    for rnd in range(settings.reps):
        values = dict.fromkeys(
            [f"{p}_{m}" for p in peers for m in ("epoch1_s", "steady_ms", "steady_cpu_ms")], 0.0
        )
        first, second = peers if rnd % 2 == 0 else peers[::-1]
        steady_steps = 2 * (args.epochs - 1) * args.steps  # over both sessions of a peer
        with harness.OtherLoad() as load:
            for peer in (first, second, second, first):
                marks = runner.session(peer, args.epochs)
                gc.collect()
                (wall0, _), (wall1, cpu1), (wall_end, cpu_end) = marks[0], marks[1], marks[-1]
                values[f"{peer}_epoch1_s"] += (wall1 - wall0) / 2
                values[f"{peer}_steady_ms"] += (wall_end - wall1) / steady_steps * 1e3
                values[f"{peer}_steady_cpu_ms"] += (cpu_end - cpu1) / steady_steps * 1e3
        for phase, key in (("steady", "steady_ms"), ("epoch1", "epoch1_s")):
            values[f"feeder_time_over_{other}_{phase}"] = (
                values[f"{feeder}_{key}"] / values[f"{other}_{key}"]
            )
        values[f"feeder_cpu_over_{other}_steady"] = (
            values[f"{feeder}_steady_cpu_ms"] / values[f"{other}_steady_cpu_ms"]
        )
        values["other_cores"] = load.cores
        reps.append(values)
        print(
            f"  {case} round {rnd + 1}/{settings.reps}: {other} "
            f"{values[f'{other}_steady_ms']:.2f} ms/step, feeder "
            f"{values[f'{feeder}_steady_ms']:.2f} ms/step, feeder / {other} steady "
            f"{values[f'feeder_time_over_{other}_steady']:.3f}, epoch 1 "
            f"{values[f'feeder_time_over_{other}_epoch1']:.3f} (other processes "
            f"{load.cores:.2f} core)",
            flush=True,
        )
    stats = runner.stats
    params = params | {
        **{key: round(value, 3) for key, value in compiled.items()},
        "feeder_stats": {
            "verdict": stats.verdict,
            "input_bound_fraction": stats.input_bound_fraction,
            "mean_occupancy": stats.mean_occupancy,
            "producer_busy_ms_per_batch": (
                stats.producer_busy_s / stats.produced_samples * args.batch * 1e3
                if stats.produced_samples
                else None
            ),
            "copy_path": stats.copy_path,
        },
    }
    report.add_case(
        case,
        params,
        reps,
        units={
            **{f"{p}_epoch1_s": "s" for p in peers},
            **{f"{p}_steady_ms": "ms/step" for p in peers},
            **{f"{p}_steady_cpu_ms": "ms/step" for p in peers},
        },
        extra={"by_load": by_load(reps)},
    )
    report.target(
        case,
        f"feeder_time_over_{other}_steady",
        "<=",
        TARGET,
        f"feeder / {other}, steady-state time per step",
    )


def by_load(reps: list[dict]) -> dict:
    """Each ratio's median over the quiet rounds (other processes under `QUIET_CORES`) and
    over the rest, with how many rounds each holds."""
    out = {}
    for name, quiet in (("quiet", True), ("loaded", False)):
        rows = [row for row in reps if (row["other_cores"] < QUIET_CORES) == quiet]
        out[name] = {"rounds": len(rows)} | {
            key: statistics.median(row[key] for row in rows) if rows else None
            for key in reps[0]
            if key.startswith(("feeder_time_over_", "feeder_cpu_over_"))
        }
    return out


# ---- phases ----------------------------------------------------------------------------------


def phases(report: harness.Report, settings: harness.Settings, loop: OptaxLoop) -> None:
    """What each input path costs per batch with no step running, and the step alone."""
    import jax

    from feedpipe.core.slots import SlotLayout, aligned_buffer, aligned_copy
    from feedpipe.core.split import ReplicaSplit

    args = settings.args
    steps = args.steps
    feeder = loop.feeder()
    layer = feeder.layer
    layout = SlotLayout(feeder.staged_spec, ReplicaSplit(args.batch, len(loop.devices)))
    slot = aligned_buffer(layout.nbytes)
    for replica, regions in enumerate(layout.views(slot)):
        rows = slice(replica * layout.split.per_replica, (replica + 1) * layout.split.per_replica)
        for region, field in zip(regions, (loop.x, loop.y), strict=True):
            region[...] = field[rows]
    resident_plain = loop.put(0)
    (xf, yf), mask = next(iter(feeder)).distributed()

    def step_plain():
        return loop.plain_step(loop.params, loop.opt_state, *resident_plain)[2]

    def step_masked():
        return loop.masked_step(loop.params, loop.opt_state, xf, yf, mask)[2]

    def plain_puts():
        for i in range(steps):
            jax.block_until_ready(loop.put(i))

    def feeder_alone():
        for batch in feeder:
            batch.distributed()

    def stage_copy():
        for _ in range(steps):
            aligned_copy(slot)

    copied = layout.views(aligned_copy(slot))

    def stage_arrays():
        for _ in range(steps):
            jax.block_until_ready(
                [layer.global_array(regions) for regions in zip(*copied, strict=True)]
            )

    def per_device():
        for _ in range(steps):
            placed = [
                jax.device_put([aligned_copy(region) for region in regions], device)
                for regions, device in zip(layout.views(slot), loop.devices, strict=True)
            ]
            jax.block_until_ready(layer.global_arrays(placed))

    timed = {
        "step_plain_ms": (lambda: blocked_steps(step_plain, steps), 1e3),
        "step_masked_ms": (lambda: blocked_steps(step_masked, steps), 1e3),
        "plain_put_us": (plain_puts, 1e6),
        "feeder_cpu_us": (feeder_alone, 1e6),
        "stage_copy_us": (stage_copy, 1e6),
        "stage_arrays_us": (stage_arrays, 1e6),
        "per_device_us": (per_device, 1e6),
    }
    for run, _ in timed.values():  # untimed warm-up
        run()
    reps = []
    for rnd in range(settings.reps):
        values = {}
        with harness.OtherLoad() as load:
            for name in harness.rotate(list(timed), rnd):
                run, scale = timed[name]
                cpu, started = time.process_time(), time.perf_counter()
                run()
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                values[name] = (cpu if name == "feeder_cpu_us" else wall) / steps * scale
                if name == "feeder_cpu_us":
                    values["feeder_wall_us"] = wall / steps * scale
        values["stage_us"] = values["stage_copy_us"] + values["stage_arrays_us"]
        values["per_device_over_stage"] = values["per_device_us"] / values["stage_us"]
        values["feeder_cpu_over_plain_put"] = values["feeder_cpu_us"] / values["plain_put_us"]
        values["feeder_extra_over_step"] = (
            (values["feeder_cpu_us"] - values["plain_put_us"]) / 1e3 / values["step_plain_ms"]
        )
        values["other_cores"] = load.cores
        reps.append(values)
    feeder.close()
    report.add_case(
        "phases",
        {
            "devices": len(loop.devices),
            "global_batch": args.batch,
            "batch_bytes": layout.batch_bytes,
            "slot_bytes": layout.nbytes,
            "fields": len(layout.spec.leaves),
            "each_timed_over": f"{steps} batches, per batch",
            "what": {
                "step_plain_ms": "the plain loop's step on a batch already on the devices",
                "step_masked_ms": "the feeder loop's step (loss weighted by the mask), same",
                "plain_put_us": "jax.device_put((x[rows], y[rows]), sharding), waited for",
                "feeder_cpu_us": "process CPU (all threads) per batch of the feeder alone",
                "feeder_wall_us": "wall time per batch of the feeder alone",
                "stage_copy_us": "one copy of a slot into fresh 64-byte-aligned memory",
                "stage_arrays_us": "JaxLayer.global_array per field over that copy",
                "per_device_us": (
                    "each region copied alone, jax.device_put per device, then "
                    "make_array_from_single_device_arrays per field"
                ),
                "feeder_extra_over_step": "(feeder_cpu_us - plain_put_us) / step_plain_ms",
            },
        },
        reps,
        units={
            "step_plain_ms": "ms",
            "step_masked_ms": "ms",
            **{key: "us" for key in timed if key.endswith("_us")},
            "feeder_wall_us": "us",
            "stage_us": "us",
        },
    )


def main(argv=None) -> None:
    configure_environment()
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    if args.epochs < 2:
        raise SystemExit(f"--epochs={args.epochs}: the steady state is the epochs after the first.")
    settings.reps = args.rounds or args.reps or settings.pick(6, 16)
    if settings.reps < harness.MIN_REPS:
        raise SystemExit(f"--rounds={settings.reps}: a median needs at least {harness.MIN_REPS}.")
    if settings.quick:
        args.steps = min(args.steps, 16)
    import jax
    import keras
    import optax

    if jax.device_count() != DEVICES or jax.default_backend() != "cpu":
        raise SystemExit(
            f"expected {DEVICES} CPU devices, found {jax.devices()}: run in a fresh process."
        )
    report = harness.Report(
        "jax_parity",
        "On 4 host devices of CPU JAX, with the data in memory: an optax loop fed by the feeder "
        "over the plain sharded device_put loop, and Keras's fit(feeder) over fit(x, y), time "
        "per step, steady state and first epoch",
        settings,
        "kernels_bench.jax_parity",
    )
    x, y = make_data(settings)
    cores = len(os.sched_getaffinity(0))
    common = {
        "devices": [str(d) for d in jax.devices()],
        "cores": cores,
        "global_batch": args.batch,
        "per_device_batch": args.batch // DEVICES,
        "model": f"MLP {args.features} -> {args.hidden} -> {args.hidden} -> 10, ReLU, Adam 1e-3",
        "batch_bytes": x[: args.batch].nbytes + y[: args.batch].nbytes,
        "steps_per_epoch": args.steps,
        "epochs_per_session": args.epochs,
        "x_offset_mod_64": x.ctypes.data % 64,
        "versions": {
            "jax": jax.__version__,
            "keras": keras.__version__,
            "optax": optax.__version__,
        },
    }
    loop = OptaxLoop(x, y, settings)
    paired_rounds(
        report,
        settings,
        "optax loop",
        loop,
        ("plain", "feeder"),
        common
        | {
            "peers": {
                "plain": "jax.device_put((x[rows], y[rows]), NamedSharding(mesh, P('batch'))), "
                "contiguous rows, then step(params, opt_state, x, y)",
                "feeder": "for batch in fp.Feeder((x, y), B, devices=jax.devices()): "
                "(x, y), mask = batch.distributed(); step(params, opt_state, x, y, mask)",
            },
            "sync": "block_until_ready on each step's loss, both peers",
        },
    )
    phases(report, settings, loop)
    fit = KerasFit(x, y, settings)
    paired_rounds(
        report,
        settings,
        "keras fit",
        fit,
        ("arrays", "feeder"),
        common
        | {
            "distribution": "keras.distribution.DataParallel(devices=jax.devices())",
            "peers": {
                "arrays": "model.fit(x, y, batch_size=B, shuffle=True)",
                "feeder": "model.fit(fp.Feeder((x, y), B, devices=jax.devices(), shuffle=True),"
                " callbacks=[feeder.fit_callback()])",
            },
            "sync": "a callback with on_train_batch_end in both fits: Keras reads every "
            "step's loss before the next",
        },
    )
    report.note(
        "Time ratios, feeder over its peer (above 1: the feeder is slower), within each round "
        "(the two peers' order alternating), medians over rounds. steady = per step over the "
        "epochs after the first; epoch1 = from building the input to the end of the first "
        "epoch (steps compiled before the rounds; first calls in each case's params as "
        "<peer>_compile_s). by_load: the same medians over the rounds during which other "
        f"processes used under {QUIET_CORES} core (quiet) and the rest. other_cores: CPU (in "
        "cores) used by other processes on the machine during the round."
    )
    report.note(f"TensorFlow imported during the run: {'tensorflow' in sys.modules}.")
    report.finish(
        columns=[
            "feeder_time_over_plain_steady",
            "feeder_time_over_plain_epoch1",
            "feeder_time_over_arrays_steady",
            "feeder_time_over_arrays_epoch1",
            "plain_steady_ms",
            "arrays_steady_ms",
            "feeder_steady_ms",
            "step_plain_ms",
            "plain_put_us",
            "feeder_cpu_us",
            "stage_us",
            "per_device_us",
            "feeder_extra_over_step",
            "other_cores",
        ]
    )


if __name__ == "__main__":
    main()
