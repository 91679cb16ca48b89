"""`model.fit(feeder)` stopped by a real Ctrl-C, saved in the handler, and resumed in a new
process, on the Keras backend `KERAS_BACKEND` names.

    python tests/keras_resume_worker.py MODE OUT_DIR [AT]

MODE is `full` (two epochs, uninterrupted), `interrupt` (a thread sends SIGINT as step AT of
the fit begins; the `KeyboardInterrupt` handler saves the model, its optimizer included, to
`model.keras` and the feeder's state to `state.json`) or `resume` (loads both, and runs the
same fit from the state's epoch). `full` and `resume` write `<MODE>.npz`: the weights and the
optimizer's `iterations`. Driven by `tests/keras_conformance.py`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import feedpipe as fp
from tests.keras_conformance import SHORT, SHORT_BATCH, MapStyle, Structure


def model() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
    net = keras.Model(inputs, keras.layers.Dense(SHORT)(hidden))
    net.compile(
        keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return net


def feeder() -> fp.Feeder:
    devices = None
    if keras.backend.backend() == "jax":  # Keras trains on one device without a distribution
        import jax

        devices = [jax.devices()[0]]
    return fp.Feeder(MapStyle(Structure(SHORT)), SHORT_BATCH, devices=devices)


class CtrlC(keras.callbacks.Callback):
    """Sends SIGINT from another thread as step `at` of the fit begins: it lands in the step."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.steps = at, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps == self.at:
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()
        self.steps += 1


def save(net: keras.Model, path: Path) -> None:
    weights = {f"weight_{i}": w for i, w in enumerate(net.get_weights())}
    np.savez(path, iterations=int(net.optimizer.iterations), **weights)


def main(mode: str, out: Path, at: int = 0) -> None:
    with feeder() as fed:
        if mode == "full":
            net = model()
            net.fit(fed, epochs=2, callbacks=[fed.fit_callback()], verbose=0)
            save(net, out / "full.npz")
        elif mode == "interrupt":
            net = model()
            try:
                net.fit(fed, epochs=2, callbacks=[fed.fit_callback(), CtrlC(at)], verbose=0)
                time.sleep(2.0)  # a SIGINT sent as the last step began may land after the fit
            except KeyboardInterrupt:
                net.save(out / "model.keras")
                (out / "state.json").write_text(json.dumps(fed.get_state()))
                return
            raise SystemExit("the fit was not interrupted")
        else:
            net = keras.models.load_model(out / "model.keras")
            state = json.loads((out / "state.json").read_text())
            fed.set_state(state)
            callbacks = [fed.fit_callback()]
            net.fit(fed, epochs=2, initial_epoch=state["epoch"], callbacks=callbacks, verbose=0)
            save(net, out / "resume.npz")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *(int(a) for a in sys.argv[3:]))
