"""Keras 3 on PyTorch fed by `model.fit(feeder)`: the same weights as `fit(arrays)` on the same
order, a padded batch handed over as its real rows alone, a state that counts what the step
trained on, and `predict` and `evaluate` on the real rows alone."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch

import feedpipe as fp
from tests.keras_cases import BATCH, LENGTH, assert_same_weights, classifier, data, model
from tests.keras_fit_promises import *  # noqa: F403 (every promise of fit(feeder) runs here)
from tests.keras_fit_promises import position
from tests.processes import REPO_ROOT

CPU = [torch.device("cpu")]
"""The device Keras on PyTorch trains on here."""


def test_a_feeder_built_without_devices_under_keras_on_torch_stages_for_it(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH) as feeder:
        assert feeder.layer.name == "torch"
        fed = model(keras)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_a_padded_batch_goes_to_keras_as_its_real_rows_alone(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        batches = list(feeder.get_torch_dataloader())
    assert [len(b) for b in batches] == [2] * len(batches), "no weight is added"
    *_, (bx, by) = batches
    assert isinstance(by, torch.Tensor) and by.tolist() == y[96:].tolist()
    np.testing.assert_array_equal(bx.numpy(), x[96:])


def test_a_sources_own_weights_go_to_keras_as_they_are(keras):
    x, y = data()
    given = np.linspace(0.5, 2.0, LENGTH).astype("float32")
    with fp.Feeder((x, y, given), BATCH, devices=CPU) as feeder:
        batches = list(feeder.get_torch_dataloader())
    np.testing.assert_array_equal(batches[0][2].numpy(), given[:BATCH])
    np.testing.assert_array_equal(batches[-1][2].numpy(), given[96:])


def test_a_feeder_on_more_devices_than_keras_trains_on_is_refused(keras):
    x, y = data()
    refused = pytest.raises(
        ValueError, match=r"Keras's torch backend trains on cpu, but the feeder stages on"
    )
    with fp.Feeder((x, y), BATCH, devices=["cpu", "cpu"], framework="torch") as feeder, refused:
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)


def test_validation_data_from_a_second_feeder_is_evaluated_on_its_real_rows(keras):
    x, y = data()
    vx, vy = data(37)  # 37 = 4 batches of 8 and 5 real rows in a padded fifth
    with (
        fp.Feeder((x, y), BATCH, devices=CPU) as feeder,
        fp.Feeder((vx, vy), 8, devices=CPU) as validation,
    ):
        fed = model(keras)
        history = fed.fit(
            feeder,
            validation_data=validation,
            epochs=2,
            callbacks=[feeder.fit_callback()],
            verbose=0,
        )
        assert position(feeder) == (2, 0)
    assert len(history.history["val_loss"]) == 2
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)
    last = plain.evaluate(vx, vy, batch_size=8, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(last, rel=1e-5)


def test_predict_on_the_feeder_returns_one_prediction_per_real_sample(keras):
    x, y = data(37)
    net = classifier(keras)
    with fp.Feeder((x, y), 8, devices=CPU) as feeder:
        predicted = net.predict(feeder, verbose=0)
    assert predicted.shape == (37, 3)
    np.testing.assert_allclose(predicted, net.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_leaves_out_a_skipped_samples_row_wherever_it_is(keras):
    x, y = data(37)

    class SkipsSample3:
        def __len__(self):
            return 37

        def __getitem__(self, index):
            if index == 3:
                raise ValueError("unreadable")
            return x[index], y[index]

    net = classifier(keras)
    with fp.Feeder(SkipsSample3(), 8, devices=CPU, errors="skip") as feeder:
        predicted = net.predict(feeder, verbose=0)
    kept = np.delete(x, 3, axis=0)
    assert predicted.shape == (36, 3)
    np.testing.assert_allclose(predicted, net.predict(kept, verbose=0), rtol=1e-5, atol=1e-6)


def test_the_example_fits_on_the_feeder_and_predicts_every_held_out_sample(keras, capsys):
    runpy.run_path(str(REPO_ROOT / "examples" / "keras_torch.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "200 predictions for 200 held-out samples" in printed
    assert "'epoch': 3, 'step': 0" in printed
    assert printed.count("StarvationMonitor epoch") == 3


def test_the_example_without_keras_names_the_install_that_brings_it(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    monkeypatch.setitem(sys.modules, "keras", None)  # import keras fails as where it is absent
    with pytest.raises(SystemExit, match=r'pip install "feedpipe\[keras-torch\]"'):
        runpy.run_path(str(REPO_ROOT / "examples" / "keras_torch.py"), run_name="__main__")


def test_the_keras_torch_extra_brings_keras_and_the_readme_gives_it_to_keras_on_torch():
    """`[torch]` installs PyTorch alone; the README's Keras-on-torch section sends its readers
    to `[keras-torch]`, which adds Keras, and the torch tests install it too."""
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert "feedpipe[torch]" in extras["keras-torch"]
    assert any(r.startswith("keras>=3") for r in extras["keras-torch"])
    assert not any(r.startswith("keras") for r in extras["torch"])
    assert "feedpipe[keras-torch]" in extras["test-torch"]
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quick start on PyTorch", 1)[1].split("\n## ", 1)[0]
    keras_part = section[section.index("With Keras on torch") :]
    assert "[keras-torch]" in keras_part
    assert 'pip install -e ".[keras-torch]"' in readme.split("## Install", 1)[1]


FIT_PREDICT_MONITOR_DIAGNOSE = """
import json, sys
import keras
import numpy as np
import feedpipe as fp

rng = np.random.default_rng(0)
x, y = rng.normal(size=(40, 3)).astype("float32"), rng.normal(size=40).astype("float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
with fp.Feeder((x, y), 8) as feeder:
    monitor = fp.StarvationMonitor(verbose=0, headspace_steps=2)
    model.fit(feeder, epochs=2, verbose=0, callbacks=[feeder.fit_callback(), monitor])
    predicted = model.predict(feeder, verbose=0)
    fp.diagnose(feeder, model, steps=2, warmup=1, progress=False)
loaded = sorted({name.split(".")[0] for name in sys.modules} & {"tensorflow", "jax"})
print(json.dumps([keras.backend.backend(), len(predicted), len(monitor.epochs), loaded]))
"""


def test_keras_on_torch_loads_neither_tensorflow_nor_jax():
    """A fresh interpreter, as a user with KERAS_BACKEND=torch runs it: fit, predict, the
    monitor and a diagnosis, where any of them reaching for TensorFlow or JAX would show."""
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", FIT_PREDICT_MONITOR_DIAGNOSE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    backend, predictions, epochs, loaded = json.loads(done.stdout.splitlines()[-1])
    assert (backend, predictions, epochs, loaded) == ("torch", 40, 2, [])
