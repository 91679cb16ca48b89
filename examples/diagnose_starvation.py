"""Is the step starved? Compare `feeder.stats()` for a slow source and a fast one.

    python examples/diagnose_starvation.py

The same 10 ms step consumes batches from two sources: one whose samples each take 1 ms to
read (a slow disk or a remote store) and one of numpy arrays in memory. `feeder.stats()` reads
the answer off the consumer's side: the share of wall time the step waited for its batch (the
input-bound fraction, judged with the TensorFlow profiler's 5 % and 20 % thresholds), and, to
say why, what the producer alone and the step alone could sustain.

The step is emulated with `time.sleep`, which leaves the CPU free as an accelerator step does;
in your code it is your training step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time

import numpy as np
import tensorflow as tf

import feedpipe as fp

cpu = tf.config.list_physical_devices("CPU")[0]  # four logical CPU devices stand in for GPUs
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
DEVICES = [f"/cpu:{i}" for i in range(4)]
STEP_S, STEPS, BATCH = 0.010, 40, 32

images = np.random.default_rng(0).random((2000, 32, 32, 3), dtype=np.float32)


class SlowImages:
    """The same images, each read after a 1 ms wait: 32 ms of reading per 10 ms step."""

    def __len__(self):
        return len(images)

    def __getitem__(self, index):
        time.sleep(0.001)
        return images[index]


def measure(source) -> fp.FeedStats:
    """Runs `STEPS` steps fed from `source` and returns what the feeder saw."""
    with fp.Feeder(source, BATCH, devices=DEVICES) as feeder:
        for batch in feeder:
            time.sleep(STEP_S)  # the training step
            if batch.step + 1 == STEPS:
                break
        return feeder.stats()


for name, source in [("slow source (1 ms per sample)", SlowImages()), ("numpy arrays", images)]:
    stats = measure(source)
    print(f"{name}:\n  {stats}")
    if stats.producer_samples_per_s < stats.consumer_samples_per_s:
        print(
            f"  -> the input is the bottleneck: it makes {stats.producer_samples_per_s:,.0f} "
            f"samples/s, the step could take {stats.consumer_samples_per_s:,.0f}/s; read faster "
            "(cache, parallel reads, lighter decoding)"
        )
    else:
        print("  -> the step is the bottleneck: a faster input would not speed training up")
