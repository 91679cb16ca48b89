"""Sources for the tests of `workers="auto"`'s trial pools, in a module that imports no
framework: a worker process that unpickles one imports this module, and stays small."""

from __future__ import annotations

import os
import threading

from tests import worker_fakes as wf


class LoadsForeverInAWorker(wf.SlowSource):
    """A `SlowSource` that a worker process never finishes loading: a pool of them stays
    spawning until it is ended."""

    def __init__(self, length: int, delay_s: float):
        super().__init__(length, delay_s)
        self.home = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.home:
            threading.Event().wait()


class HoldsPythonObjects(wf.SlowSource):
    """A `SlowSource` holding a million Python ints: each worker process unpickles its own."""

    def __init__(self, length: int):
        super().__init__(length, 0.001)
        self.objects = list(range(1_000_000))
