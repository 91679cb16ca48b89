"""The TensorFlow layer: staging on TensorFlow devices and everything TensorFlow-shaped.

`layer` (the devices, this host's share, staging: `devices`, `stage`), `batch` (what a custom
loop's step takes, `Batch.distributed()` for `strategy.run`), `feeder` (`as_dataset()` for
`model.fit`, the feeder in a `tf.train.Checkpoint`), `array_dataset` (`as_dataset()` over arrays
in memory, gathered by TensorFlow's threads), `keras` (what Keras's TensorFlow trainer reads),
`agreement` (every host's feeder the same, checked through the strategy), `training`
(`fp.train`, `fp.Trainer`, `fp.TowerStep`), `keras_step` (Keras's train step as the headspace
measurement runs it), `demo` (`feedpipe demo`'s Keras model and step).
"""
