"""Keras, on any backend: `fit` (the callback that tells a feeder what `model.fit` trained on),
`adapter` (a feeder as Keras's own data adapter, so `model.fit(feeder)` works) and `batches`
(what Keras's JAX and torch trainers read from it)."""
