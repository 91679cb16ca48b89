"""Keras, on any backend: `fit` (the callback that tells a feeder what `model.fit` trained on)
and `adapter` (a feeder as Keras's own data adapter, so `model.fit(feeder)` works)."""
