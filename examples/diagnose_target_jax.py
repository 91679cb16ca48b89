"""Targets for `feedpipe diagnose` on JAX, with no Keras and no TensorFlow: a jitted SGD step of
a small MLP, fed by a slow Python source or from memory.

    feedpipe diagnose examples/diagnose_target_jax.py:slow_reads --report /tmp/feedpipe-report
    feedpipe diagnose examples/diagnose_target_jax.py:arrays --json

A target returns `(input, step)`: here an `fp.Feeder` on JAX devices and a callable that trains
on one batch and returns once the step is done. `slow_reads` reads each sample after a 1 ms
wait, as a slow disk or a remote store would: highly input-bound, with remedies. `arrays`
feeds the same step from memory.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import feedpipe as fp

BATCH = 64
images = np.random.default_rng(0).random((4096, 16 * 16 * 3), dtype=np.float32)
labels = (np.arange(len(images)) % 10).astype(np.int32)


class SlowReads:
    """The same images and labels, each sample read after a 1 ms wait."""

    def __len__(self):
        return len(images)

    def __getitem__(self, index):
        time.sleep(0.001)
        return images[index], labels[index]


def _loss(params, x, y, mask):
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    log_p = jax.nn.log_softmax(logits)
    per_sample = -jnp.take_along_axis(log_p, y[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(mask, per_sample, 0.0)) / jnp.maximum(mask.sum(), 1)


@jax.jit
def _sgd(params, x, y, mask):
    loss, grads = jax.value_and_grad(_loss)(params, x, y, mask)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss


def step_on(device):
    """A step over one staged batch on `device`, returning once the device is done."""
    rng = np.random.default_rng(1)
    state = {
        "params": jax.device_put(
            {
                "w1": rng.standard_normal((images.shape[1], 128), np.float32) * 0.02,
                "w2": rng.standard_normal((128, 10), np.float32) * 0.1,
            },
            device,
        )
    }

    def step(batch):
        (x, y), mask = batch.replicas[0], batch.masks[0]
        state["params"], loss = _sgd(state["params"], x, y, mask)
        loss.block_until_ready()

    return step


def slow_reads():
    device = jax.devices()[0]
    return fp.Feeder(SlowReads(), BATCH, devices=[device]), step_on(device)


def arrays():
    device = jax.devices()[0]
    return fp.Feeder((images, labels), BATCH, devices=[device]), step_on(device)
