"""Targets for `feedpipe diagnose` on PyTorch, with neither Keras, TensorFlow nor JAX: an SGD
step of a small MLP on this process's device (its GPU, else the CPU), fed by a slow Python
source or from memory.

    feedpipe diagnose examples/diagnose_target_torch.py:slow_reads --report /tmp/feedpipe-report
    feedpipe diagnose examples/diagnose_target_torch.py:arrays --json

A target returns `(input, step)`: here an `fp.Feeder` on a torch device and a callable that
trains on one batch and returns its loss (the diagnosis waits for it). `slow_reads` reads each
sample after a 1 ms wait, as a slow disk or a remote store would: highly input-bound, with
remedies. `arrays` feeds the same step from memory.
"""

import time

import numpy as np
import torch

import feedpipe as fp

BATCH = 64
images = np.random.default_rng(0).random((4096, 16 * 16 * 3), dtype=np.float32)
labels = (np.arange(len(images)) % 10).astype(np.int64)


class SlowReads:
    """The same images and labels, each sample read after a 1 ms wait."""

    def __len__(self):
        return len(images)

    def __getitem__(self, index):
        time.sleep(0.001)
        return images[index], labels[index]


def step_on(device: torch.device):
    """A step over one staged batch on `device`: the masked mean loss, one SGD update."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(images.shape[1], 128), torch.nn.Tanh(), torch.nn.Linear(128, 10)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch):
        (x, y), mask = batch.distributed()
        per_sample = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = (per_sample * mask).sum() / batch.num_valid
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    return step


def slow_reads():
    feeder = fp.Feeder(SlowReads(), BATCH, framework="torch")
    return feeder, step_on(feeder.devices[0])


def arrays():
    feeder = fp.Feeder((images, labels), BATCH, framework="torch")
    return feeder, step_on(feeder.devices[0])
