"""The demo on PyTorch: the same MLP as on the other frameworks, trained with SGD on this
process's device (its GPU, else the CPU); see `feedpipe.demo` for the story and the report.

PyTorch trains one device per process: more devices are more processes under
`torch.distributed` (`examples/torch_ddp.py`), so the demo trains on one, its step on one
intra-op thread (`STEP_THREADS`), the process's own count put back after. Neither TensorFlow,
JAX nor Keras is imported.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import numpy as np
import torch

from feedpipe.demo import (
    CLASSES,
    FEATURES,
    HIDDEN_UNITS,
    LEARNING_RATE,
    MOMENTUM,
    SyntheticRecords,
    progress_line,
)
from feedpipe.feeder import Feeder
from feedpipe.torch.devices import resolve_devices

STEP_THREADS = 1
"""PyTorch's intra-op threads while the demo runs. Its default, a thread per core, swung under
load on the 2-core development machine: one step took 4 ms, the next 200 ms (each op waits for
all its threads, and a busy machine deschedules one), and in one run the reading thread beside
them read 30 times slower than alone; the speedup reported swung with them (1.18x, 1.52x and
13.11x in three runs). On one thread the step took 5 to 8 ms throughout, and the other cores
are left to reading and staging."""


def _mlp() -> torch.nn.Module:
    """Three dense layers, Glorot-uniform weights and zero biases, as Keras's `Dense` starts."""
    torch.manual_seed(0)
    layers = []
    sizes = [FEATURES, HIDDEN_UNITS, HIDDEN_UNITS, CLASSES]
    for i in range(3):
        layer = torch.nn.Linear(sizes[i], sizes[i + 1])
        torch.nn.init.xavier_uniform_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
        layers += [layer, torch.nn.ReLU()] if i < 2 else [layer]
    return torch.nn.Sequential(*layers)


class Training:
    """The demo's `Training` on PyTorch: the MLP on one device, SGD with momentum as Keras's
    `SGD` applies it (velocity = momentum * velocity - rate * gradient)."""

    model = f"{HIDDEN_UNITS}-unit MLP in PyTorch"

    def __init__(self, devices: int | None):
        if devices not in (None, 1):
            raise ValueError(
                f"`--devices`={devices}: PyTorch trains one device per process, so the demo "
                "trains on one; run one process per device under torch.distributed for more "
                "(torchrun --nproc-per-node=N examples/torch_ddp.py)."
            )
        (self.device,) = resolve_devices(None)
        self.devices = [str(self.device)]
        self.on = "GPU" if self.device.type == "cuda" else "the CPU: no GPU found"
        self.net = _mlp().to(self.device)
        # torch's SGD keeps velocity = momentum * v + g and steps by -lr * v: the same updates
        # as Keras's once the rate is folded into the velocity.
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

    def place(self, features: np.ndarray, labels: np.ndarray, real: np.ndarray) -> tuple:
        """The global batch on the device, as `batch.distributed()` gives it."""
        placed = [
            torch.from_numpy(a).to(self.device) for a in (features, labels.astype(np.int64), real)
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (placed[0], placed[1]), placed[2]

    def step(self, inputs, mask, num_valid: int) -> float:
        features, labels = inputs
        losses = torch.nn.functional.cross_entropy(
            self.net(features), labels.long(), reduction="none"
        )
        loss = torch.where(mask, losses, 0.0).sum() / num_valid
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def snapshot(self) -> Callable[[], None]:
        # Deep copies: both state dicts hold the live tensors, which training updates in place.
        weights = copy.deepcopy(self.net.state_dict())
        optimizer = copy.deepcopy(self.optimizer.state_dict())

        def restore() -> None:
            self.net.load_state_dict(weights)
            self.optimizer.load_state_dict(copy.deepcopy(optimizer))

        return restore

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """The block runs on `STEP_THREADS` intra-op threads; the process's own count is put
        back after. The inter-op threads are left alone: they serve only `torch.jit.fork`,
        which the step never calls, and can be set only once in a process."""
        threads = torch.get_num_threads()
        torch.set_num_threads(STEP_THREADS)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def feeder(self, dataset: SyntheticRecords, global_batch_size: int) -> Feeder:
        return Feeder(dataset, global_batch_size, devices=[self.device])

    def progress_bar(self, steps: int) -> Callable[[int, float], None]:
        return progress_line(steps)
