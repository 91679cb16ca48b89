"""A custom JAX + optax loop fed by fp.Feeder: each step takes the global batch already sharded
over the devices, and a mask-weighted mean loss keeps the padded last batch exact.

The learning rate follows the rule the TensorFlow loop uses (fp.WarmupLinearScaling, Goyal et
al. 2017): start at the base rate and rise linearly to base * global_batch / 256 over the
warm-up steps. The same seed gives the same parameters on 1 device or 4, to float tolerance.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/jax_custom_loop.py

XLA:CPU with 4 forced host devices on 2 cores can hang in an all-reduce when steps are queued
deep (feedpipe or not), so the loop waits for each step's result before the next.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import feedpipe as fp


def warmup_linear_scaling(base_lr: float, global_batch: int, warmup_steps: int, base_batch=256):
    return optax.linear_schedule(base_lr, base_lr * global_batch / base_batch, warmup_steps)


def init(key: jax.Array, features: int, classes: int) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (features, 64)) * features**-0.5,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, classes)) * 64**-0.5,
        "b2": jnp.zeros(classes),
    }


def loss_fn(params: dict, x: jax.Array, y: jax.Array, mask: jax.Array, num_valid) -> jax.Array:
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / num_valid  # padding rows count for nothing


def train(x: np.ndarray, y: np.ndarray, devices, global_batch=64, epochs=3, seed=0) -> dict:
    optimizer = optax.sgd(warmup_linear_scaling(0.05, global_batch, warmup_steps=10), 0.9)
    with fp.Feeder((x, y), global_batch, devices=devices, shuffle=True, seed=seed) as feeder:
        replicated = jax.sharding.NamedSharding(feeder.sharding.mesh, jax.sharding.PartitionSpec())
        params = jax.device_put(init(jax.random.key(seed), x.shape[1], 10), replicated)
        state = optimizer.init(params)

        @jax.jit
        def step(params, state, x, y, mask, num_valid):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y, mask, num_valid)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        for epoch in range(epochs):
            for batch in feeder:
                (bx, by), mask = batch.distributed()
                params, state, loss = step(params, state, bx, by, mask, batch.num_valid)
                loss.block_until_ready()  # forced host devices can hang with steps queued deep
            print(f"epoch {epoch}: loss {float(loss):.4f}; {feeder.stats()}")
    return params


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 20)).astype(np.float32)
    y = (x[:, :10].argmax(1)).astype(np.int32)
    train(x, y, jax.devices())
