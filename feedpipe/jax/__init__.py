"""The JAX layer: each replica's rows as a `jax.Array` on its device, the global batch sharded
over them (`batch.distributed()`), several processes through `jax.distributed`.

`layer` (the devices, this process's share, staging: `devices`, `stage`, on CUDA copies on
streams of feedpipe's own, else `jax.device_put`), `batch` (what the step takes), `feeder` (the
feeder `fp.Feeder(..., devices=jax.devices())` builds), `agreement` (the processes' check
through the distributed runtime's key-value store), `keras` (what Keras's JAX trainer reads),
`keras_step` (Keras's train function as `StarvationMonitor` and `diagnose` run it), `demo`
(`feedpipe demo --framework jax`: its model and jitted step).
"""
