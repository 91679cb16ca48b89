"""The JAX layer: each replica's rows as a `jax.Array` on its device, the global batch sharded
over them (`batch.distributed()`), several processes through `jax.distributed`.

`layer` (devices, this process's share, staging with `jax.device_put` from page-locked slots),
`batch` (what the step takes), `feeder` (the feeder `fp.Feeder(..., devices=jax.devices())`
builds), `demo` (`feedpipe demo --framework jax`: its model and jitted step).
"""
