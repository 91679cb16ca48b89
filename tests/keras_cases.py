"""What the Keras tests of every backend train: the same small data, model and weight check
(Keras is passed in, so that this module imports no framework)."""

from __future__ import annotations

import json
import time

import numpy as np

LENGTH, BATCH = 100, 32  # the last batch holds 4 real rows and 28 padded ones


def data(length: int = LENGTH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(length, 8)).astype("float32")
    return x, rng.integers(0, 3, length).astype("int32")


def model(keras):
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    net.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return net


def assert_same_weights(a, b) -> None:
    for mine, theirs in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def classifier(keras):
    """A model whose unweighted `accuracy` would count padding rows if it were given them."""
    net = model(keras)
    net.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return net


def wall_clock(keras):
    """A callback keeping ground truth the monitor does not see: when each call of the step
    returned."""

    class WallClock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def step_s(self) -> float:
            """Mean seconds per step from the end of the third call to the last one."""
            return (self.ends[-1] - self.ends[2]) / (len(self.ends) - 3)

    return WallClock()


DIAGNOSE_TARGET = """
import keras
import numpy as np

import feedpipe as fp
{imports}

def fit_model():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 3)).astype("float32"), rng.normal(size=256).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return fp.Feeder((x, y), 16{devices}), model
"""


def diagnose_command(tmp_path, capsys, *, imports: str = "", devices: str = "") -> dict:
    """`feedpipe diagnose target.py:fit_model --json` on a script as users write them (a Keras
    model and its feeder, built with `devices` after `imports`), read back as JSON."""
    from feedpipe import cli

    target = tmp_path / "target.py"
    target.write_text(DIAGNOSE_TARGET.format(imports=imports, devices=devices))
    argv = ["diagnose", f"{target}:fit_model", "--json", "--steps", "3", "--warmup", "1"]
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)
