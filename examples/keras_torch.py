"""`model.fit(feeder)` with Keras 3 on PyTorch: batches already on the device Keras trains on.

    pip install -e ".[keras-torch]"   # PyTorch and Keras 3 ([torch] installs no Keras)
    KERAS_BACKEND=torch python examples/keras_torch.py

Under Keras's torch backend a feeder built without `devices` stages on this process's device
(its GPU, else the CPU), which is where Keras trains, and `model.fit` takes the feeder itself.
1,000 samples in batches of 64 leave a last batch of 40 real rows, padded to 64: Keras gets
`(x, y, sample_weight)` with weight 0 on the padding and `64 / 40` on the real rows, so the
batch's loss is the mean over its real samples (metrics must be `weighted_metrics` to skip the
padding too). `predict` and `evaluate` get the real rows alone: one prediction per sample.
`feeder.fit_callback()` makes `feeder.state_dict()` the batches the step trained on, in any
callback, so a checkpoint written beside the model's weights resumes exactly.
`fp.StarvationMonitor` says after every epoch whether the step waited for its input.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

try:
    import keras
except ModuleNotFoundError as error:
    if error.name != "keras":
        raise
    raise SystemExit(
        "examples/keras_torch.py trains with Keras 3 on PyTorch, and Keras is not installed "
        "(the [torch] extra installs PyTorch alone); install both: "
        'pip install "feedpipe[keras-torch]" (from a clone: pip install -e ".[keras-torch]").'
    ) from error
import numpy as np

import feedpipe as fp

rng = np.random.default_rng(0)
centers = rng.normal(size=(10, 64)).astype(np.float32)
labels = (np.arange(1200) % 10).astype(np.int32)
features = centers[labels] + rng.normal(scale=2.0, size=(1200, 64)).astype(np.float32)
train, held_out = slice(0, 1000), slice(1000, 1200)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((64,)), keras.layers.Dense(128, "relu"), keras.layers.Dense(10)]
)
model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    weighted_metrics=["accuracy"],
)

with (
    fp.Feeder((features[train], labels[train]), 64, shuffle=True, seed=0) as feeder,
    fp.Feeder((features[held_out], labels[held_out]), 64) as validation,
):
    print(feeder)  # a torch feeder on Keras's device
    monitor = fp.StarvationMonitor(feeder=feeder)
    model.fit(
        feeder,
        validation_data=validation,
        epochs=3,
        verbose=2,
        callbacks=[feeder.fit_callback(), monitor],
    )
    print(feeder.state_dict())  # the batches the step trained on: epoch 3, step 0
    predicted = model.predict(validation, verbose=0)
    print(f"{len(predicted)} predictions for {len(labels[held_out])} held-out samples")
    print(model.evaluate(validation, verbose=0, return_dict=True))
