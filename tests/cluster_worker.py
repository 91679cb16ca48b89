"""One host of a MultiWorkerMirroredStrategy cluster on loopback, run by tests/cluster.py.

`python tests/cluster_worker.py SCENARIO OUT_DIR [ARGS_JSON]`, with TF_CONFIG set: runs the
scenario and writes what it saw to OUT_DIR/<scenario>-<host>.json for the test to compare
against the one-host stream.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import feedpipe as fp
from tests.fakes import CountingSource, index_arrays


class ReadLog(CountingSource):
    """A counting source that also lists the indices it was asked for, in order."""

    def __init__(self, length: int):
        super().__init__(length)
        self.log: list[int] = []

    def __getitem__(self, index: int):
        self.log.append(int(index))
        return super().__getitem__(index)


def gathered_ids(strategy, batch) -> tuple[list[int], list[bool]]:
    """The row ids and masks of every host's replicas of `batch`, in global row order."""
    (features, _labels), mask = batch.distributed(strategy)
    ids = strategy.gather(strategy.run(lambda x: tf.cast(x[:, 0], tf.int64), args=(features,)), 0)
    masks = strategy.gather(strategy.run(lambda m: tf.cast(m, tf.int32), args=(mask,)), 0)
    return ids.numpy().tolist(), masks.numpy().astype(bool).tolist()


def order(strategy, args: dict) -> dict:
    """Every case's steps as gathered from all hosts, and which samples this host read."""
    seen = {}
    for case in args["cases"]:
        source = ReadLog(case["length"])
        feeder = fp.Feeder(
            source if case["workers"] == 0 else index_arrays(case["length"]),
            case["global_batch"],
            strategy=strategy,
            shuffle=case["shuffle"],
            seed=5,
            workers=case["workers"],
            worker_mode=case.get("worker_mode", "process"),
        )
        with feeder:
            steps = []
            for _ in range(args["epochs"]):
                for batch in feeder:
                    ids, masks = gathered_ids(strategy, batch)
                    steps.append(
                        {
                            "epoch": batch.epoch,
                            "step": batch.step,
                            "ids": ids,
                            "masks": masks,
                            "num_valid": batch.num_valid,
                            "local_masks": [m.numpy().tolist() for m in batch.masks],
                        }
                    )
            seen[case["name"]] = {
                "steps": steps,
                "len": len(feeder),
                "reads": source.log,
                "state": feeder.get_state(),
            }
    return seen


def regression_model(seed: int):
    """A small model with the same initial weights on every host (and in the test)."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def regression_arrays(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples whose targets depend on the features, so every step moves the weights."""
    x = np.random.default_rng(0).normal(size=(length, 3)).astype(np.float32)
    y = (x @ np.array([[0.5], [-1.0], [2.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def regression_feeder(args: dict, **where) -> fp.Feeder:
    """The feeder of the training scenarios (and of the test's one-device reference)."""
    return fp.Feeder(
        regression_arrays(args["length"]), args["global_batch"], shuffle=True, seed=2, **where
    )


def train_logged(model, feeder, optimizer, epochs: int, **options) -> dict:
    """`fp.train` with a loss and a metric: the epochs' logs."""
    history = fp.train(
        model,
        feeder,
        epochs=epochs,
        loss="mse",
        optimizer=optimizer,
        metrics=["mae"],
        verbose=0,
        **options,
    )
    return {name: history.history[name] for name in ("loss", "mae")}


def train(strategy, args: dict) -> dict:
    """`fp.train` on this cluster: the final weights and the epochs' logs."""
    model, optimizer, feeder, _ = trained_checkpoint(strategy, args)
    with feeder:
        logs = train_logged(model, feeder, optimizer, args["epochs"])
    return {"weights": [w.tolist() for w in model.get_weights()], "logs": logs}


def shuffled_ids(strategy, args: dict, **options) -> fp.Feeder:
    """The feeder of the resume scenarios: samples that carry their index, shuffled."""
    return fp.Feeder(
        index_arrays(args["length"]),
        args["global_batch"],
        strategy=strategy,
        shuffle=True,
        seed=5,
        **options,
    )


def die_once_every_host_wrote(out: str, name: str, deadline_s: float = 120.0) -> None:
    """Dies without a word (SIGKILL) once every host has written `out/name.format(host)`: a
    host writes it after its last step, so none dies while another still receives that step's
    collective from it (which would fail the other with "Socket closed" instead)."""
    import signal

    hosts = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    paths = [os.path.join(out, name.format(host)) for host in range(hosts)]
    give_up = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < give_up:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def save(strategy, args: dict) -> dict:
    """Takes `args["steps"]` steps, writes the state, and dies without a word (SIGKILL)."""

    feeder = shuffled_ids(strategy, args, workers=args.get("workers", 0))
    batches = iter(feeder)
    for _ in range(args["steps"]):
        gathered_ids(strategy, next(batches))
    state = feeder.get_state()
    host = strategy.cluster_resolver.task_id
    path = os.path.join(args["out"], f"state-{host}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(state, file)
    os.replace(path + ".tmp", path)
    die_once_every_host_wrote(args["out"], "state-{}.json")
    return {}


def restore(strategy, args: dict) -> dict:
    """Restores the state the chief of another cluster saved and gathers the rest."""
    with open(os.path.join(args["out"], "state-0.json")) as file:
        state = json.load(file)
    with shuffled_ids(strategy, args) as feeder:
        feeder.set_state(state)
        steps = []
        for _ in range(2):
            for batch in feeder:
                ids, masks = gathered_ids(strategy, batch)
                steps.append({"epoch": batch.epoch, "step": batch.step, "ids": ids, "masks": masks})
    return {"steps": steps}


def fault(strategy, args: dict) -> dict:
    """`fp.train` where the last host dies (or hangs) at a step: the others must raise."""
    import signal

    import keras
    import psutil

    host = strategy.cluster_resolver.task_id
    last = host == strategy.num_replicas_in_sync - 1
    with strategy.scope():
        model = regression_model(0)
    feeder = fp.Feeder(
        regression_arrays(args["length"]),
        args["global_batch"],
        strategy=strategy,
        workers=2,
        transform=None,
    )
    pids = [child.pid for child in psutil.Process().children(recursive=True)]
    with open(os.path.join(args["out"], f"pids-{host}.json"), "w") as file:
        json.dump(pids, file)

    class DieAtStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if last and batch == args["fail_at"]:
                with open(os.path.join(args["out"], "failed"), "w") as file:
                    file.write(repr(time.time()))
                if args["how"] == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # hangs: its process and its server stay up

    try:
        fp.train(
            model,
            feeder,
            epochs=100,
            loss="mse",
            optimizer="sgd",
            verbose=0,
            callbacks=[DieAtStep()],
        )
    except Exception as error:  # the test reads what it was
        return {"error": f"{type(error).__name__}: {error}", "at": time.time()}
    finally:
        feeder.close()
    return {"error": None, "at": time.time()}


def dataset(strategy, args: dict) -> dict:
    """A custom loop over `feeder.as_dataset()`, and what Keras 3's `fit` says of it."""
    import keras

    feeder = fp.Feeder(
        index_arrays(args["length"]), args["global_batch"], strategy=strategy, shuffle=True, seed=5
    )
    distributed = feeder.as_dataset()

    @tf.function
    def ids_of(element):
        features, _labels, weights = element
        ids = strategy.run(lambda x: tf.cast(x[:, 0], tf.int64), args=(features,))
        return strategy.gather(ids, 0), strategy.gather(weights, 0)

    steps = []
    iterator = iter(distributed)
    for _ in range(args["epochs"] * len(feeder)):
        ids, weights = ids_of(next(iterator))
        steps.append({"ids": ids.numpy().tolist(), "weights": weights.numpy().tolist()})
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(feeder.as_dataset(), epochs=1, steps_per_epoch=len(feeder), verbose=0)
        fit_error = None
    except Exception as error:  # the test reads what it was
        fit_error = f"{type(error).__name__}: {error}"
    feeder.close()
    # TensorFlow's own flag for the per-step all-reduce asking every host whether it has data.
    optional = getattr(iterator, "_enable_get_next_as_optional", None)
    return {
        "steps": steps,
        "len": len(feeder),
        "fit_error": fit_error,
        "get_next_as_optional": optional,
    }


def service_rows(strategy):
    """A function of `batch.distributed(strategy)`: its labels, features and masks from every
    host's replicas, in global row order (one graph for every step)."""

    @tf.function
    def gather(inputs):
        (features, labels), mask = inputs
        masks = strategy.run(lambda m: tf.cast(m, tf.int32), args=(mask,))
        return [strategy.gather(values, 0) for values in (labels, features, masks)]

    return gather


def asked_of_service(feeder: fp.Feeder) -> list[dict]:
    """The rows of each job `feeder` asks its tf.data service for, as {epoch, indices}, listed
    as they are asked."""
    work = feeder._assembly.producer.work
    job = work.job
    asked = []

    def recorded(service, indices, epoch, number):
        asked.append({"epoch": epoch, "indices": indices.tolist()})
        return job(service, indices, epoch, number)

    work.job = recorded
    return asked


def wait_for_service_jobs(timeout_s: float = 30.0) -> None:
    """Waits until the readers of the service jobs closed feeders abandoned have ended (each
    once its blocked read returns, soon while the workers serve): a reader still inside
    TensorFlow when the interpreter exits aborts the process (SIGABRT, "FATAL: exception not
    rethrown", TensorFlow 2.21)."""
    deadline = time.monotonic() + timeout_s
    while any(thread.name == "feedpipe-service-job" for thread in threading.enumerate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"A service job's reader did not end within {timeout_s:.0f} s.")
        time.sleep(0.05)


def service(strategy, args: dict) -> dict:
    """A feeder whose `transform` runs on the tf.data service at `args["service"]`: every step
    gathered from all hosts, and the rows this host asked the service for."""
    from tests.test_service import records, scaled

    feeder = fp.Feeder(
        records(args["length"]),
        args["global_batch"],
        strategy=strategy,
        transform=scaled,
        service=args["service"],
        shuffle=True,
        seed=args["seed"],
    )
    asked = asked_of_service(feeder)
    gather = service_rows(strategy)
    steps = []
    with feeder:
        for _ in range(args["epochs"]):
            for batch in feeder:
                labels, features, masks = gather(batch.distributed(strategy))
                steps.append(
                    [
                        batch.epoch,
                        batch.step,
                        labels.numpy().tolist(),
                        features.numpy().tolist(),
                        masks.numpy().astype(bool).tolist(),
                    ]
                )
    wait_for_service_jobs()
    return {"steps": steps, "asked": list(asked)}


def errors(strategy, args: dict) -> dict:
    """What each mistake a multi-host script can make raises, as `type: message`."""

    def attempt(make) -> str | None:
        try:
            made = make()
        except Exception as error:  # the test reads what it was
            return f"{type(error).__name__}: {error}"
        made.close()
        return None

    data = index_arrays(20)

    def restore(length=20, global_batch=4, seed=0) -> fp.Feeder:
        """A state of a feeder of `length`, `global_batch` and `seed`, restored into ours."""
        with fp.Feeder(index_arrays(length), global_batch, strategy=strategy, seed=seed) as other:
            state = other.get_state()
        feeder = fp.Feeder(data, 4, strategy=strategy)
        try:
            feeder.set_state(state)
        except BaseException:
            feeder.close()
            raise
        return feeder

    def in_scope() -> fp.Feeder:
        with strategy.scope():
            return fp.Feeder(data, 4)

    def generator(shard, num_shards):
        yield from zip(*data, strict=True)

    return {
        "indivisible": attempt(lambda: fp.Feeder(data, 3, strategy=strategy)),
        "devices_alone": attempt(lambda: fp.Feeder(data, 4, devices=["/cpu:0"])),
        "devices_and_strategy": attempt(
            lambda: fp.Feeder(data, 4, devices=["/cpu:0"], strategy=strategy)
        ),
        "no_strategy": attempt(lambda: fp.Feeder(data, 4)),
        "in_scope": attempt(in_scope),
        "stream": attempt(lambda: fp.Feeder(fp.from_generator(generator), 4, strategy=strategy)),
        "other_length": attempt(lambda: restore(length=21)),
        "other_batch": attempt(lambda: restore(global_batch=6)),
        "other_seed": attempt(lambda: restore(seed=1)),
        "same": attempt(restore),
    }


def differ(strategy, args: dict) -> dict:
    """Each case's feeder built with this host's own arguments: what `fp.Feeder()` raised (None
    if it was built), what it left running; then one epoch gathered from feeders that agree."""
    import psutil

    host = strategy.cluster_resolver.task_id
    refused = {}
    for case in args["cases"]:
        options = dict(case["hosts"][host])
        length = options.pop("length", args["length"])
        global_batch = options.pop("global_batch", args["global_batch"])
        try:
            feeder = fp.Feeder(index_arrays(length), global_batch, strategy=strategy, **options)
        except Exception as error:  # the test reads what it was
            refused[case["name"]] = f"{type(error).__name__}: {error}"
        else:
            feeder.close()
            refused[case["name"]] = None
    left = [t.name for t in threading.enumerate() if t.name.startswith("feedpipe")]
    left += [child.pid for child in psutil.Process().children(recursive=True)]
    with fp.Feeder(
        index_arrays(args["length"]), args["global_batch"], strategy=strategy, shuffle=True
    ) as feeder:
        real = []
        for batch in feeder:
            ids, masks = gathered_ids(strategy, batch)
            real += [i for i, m in zip(ids, masks, strict=True) if m]
    return {"refused": refused, "left": left, "epoch": real}


def dali_images(files: list[str]):
    """The test suite's DALI pipeline over `files`, shuffled, each file's index its label."""
    from tests.test_dali import indexed_images

    return indexed_images(files, shuffle=True)


def dali(strategy, args: dict) -> dict:
    """A DALI source on each host: the gathered stream, and its resume from this host's state."""

    @tf.function
    def gather(batch):
        (_, labels), mask = batch
        ids = strategy.gather(strategy.run(lambda y: tf.reshape(y, [-1]), args=(labels,)), 0)
        real = strategy.gather(strategy.run(lambda m: tf.cast(m, tf.int32), args=(mask,)), 0)
        return ids, real

    def read(feeder, steps):
        got = []
        batches = iter(feeder)
        while len(got) < steps:
            batch = next(batches, None)
            if batch is None:
                batches = iter(feeder)
                continue
            ids, real = gather(batch.distributed(strategy))
            got.append([batch.epoch, batch.step, ids.numpy().tolist(), real.numpy().tolist()])
        return got

    host = strategy.cluster_resolver.task_id
    with fp.Feeder(dali_images(args["files"]), args["global_batch"], strategy=strategy) as first:
        head = read(first, args["save_at"])
        state = first.get_state()
        tail = read(first, args["steps"] - args["save_at"])
    with open(os.path.join(args["out"], f"dali-state-{host}-of-2.json"), "w") as file:
        json.dump(state, file)
    strategy.gather(tf.constant([0]), 0)  # both hosts have saved
    with open(os.path.join(args["out"], f"dali-state-{1 - host}-of-2.json")) as file:
        other = json.load(file)
    with fp.Feeder(dali_images(args["files"]), args["global_batch"], strategy=strategy) as again:
        try:
            again.set_state(other)
            wrong_host = None
        except ValueError as error:
            wrong_host = str(error)
        again.set_state(state)
        resumed = read(again, args["steps"] - args["save_at"])
    return {"stream": head + tail, "resumed": resumed, "wrong_host": wrong_host}


def legacy_fit(strategy, args: dict) -> dict:
    """`tf_keras`'s `fit` on `feeder.as_dataset()`: the final weights."""
    import tf_keras

    initial = regression_model(args["seed"]).get_weights()
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.Input((3,)),
                tf_keras.layers.Dense(8, activation="tanh"),
                tf_keras.layers.Dense(1),
            ]
        )
        model.set_weights(initial)
        model.compile(optimizer=tf_keras.optimizers.SGD(args["learning_rate"]), loss="mse")
    with regression_feeder(args, strategy=strategy) as feeder:
        model.fit(
            feeder.as_dataset(), epochs=args["epochs"], steps_per_epoch=len(feeder), verbose=0
        )
    return {"weights": [w.tolist() for w in model.get_weights()]}


def trained_checkpoint(strategy, args: dict):
    """The model, optimizer and feeder of the training scenarios, with their checkpoint."""
    import keras

    with strategy.scope():
        model = regression_model(args["seed"])
        optimizer = keras.optimizers.SGD(args["learning_rate"])
    feeder = regression_feeder(args, strategy=strategy)
    return model, optimizer, feeder, tf.train.Checkpoint(model=model, feeder=feeder)


def checkpoint_then_die(strategy, args: dict) -> dict:
    """`fp.train` with a checkpoint (model and feeder) taken at a step mid-epoch by every host,
    the chief's in the real place, as MultiWorkerMirroredStrategy wants; then every host is
    killed."""

    import keras

    model, optimizer, feeder, checkpoint = trained_checkpoint(strategy, args)
    host = strategy.cluster_resolver.task_id
    where = os.path.join(args["out"], "checkpoint" if host == 0 else f"scratch-{host}")

    class SaveAndDie(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == args["save_at"]:
                checkpoint.write(os.path.join(where, "ckpt"))
                with open(os.path.join(args["out"], f"saved-{host}"), "w") as file:
                    json.dump(feeder.get_state(), file)
                die_once_every_host_wrote(args["out"], "saved-{}")

    fp.train(
        model,
        feeder,
        epochs=args["epochs"],
        loss="mse",
        optimizer=optimizer,
        verbose=0,
        callbacks=[SaveAndDie()],
    )
    return {}


def resume_training(strategy, args: dict) -> dict:
    """Restores the chief's checkpoint on this cluster and trains to the end."""
    model, optimizer, feeder, checkpoint = trained_checkpoint(strategy, args)
    model.build((None, 3))
    checkpoint.read(os.path.join(args["out"], "checkpoint", "ckpt")).assert_consumed()
    state = feeder.get_state()
    with feeder:
        fp.train(
            model,
            feeder,
            epochs=args["epochs"],
            initial_epoch=state["epoch"],
            loss="mse",
            optimizer=optimizer,
            verbose=0,
        )
    return {"weights": [w.tolist() for w in model.get_weights()], "restored": state}


SCENARIOS = {
    "checkpoint_then_die": checkpoint_then_die,
    "resume_training": resume_training,
    "legacy_fit": legacy_fit,
    "dali": dali,
    "errors": errors,
    "order": order,
    "train": train,
    "save": save,
    "restore": restore,
    "fault": fault,
    "dataset": dataset,
    "differ": differ,
    "service": service,
}


def main() -> None:
    faulthandler.enable()  # a crash inside TensorFlow shows every thread's Python stack
    scenario, out = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    timeout = args.get("collective_timeout_s")
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    host = strategy.cluster_resolver.task_id
    started = time.perf_counter()
    result = SCENARIOS[scenario](strategy, {**args, "out": out})
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out, f"{scenario}-{host}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
