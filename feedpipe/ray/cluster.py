"""Cluster: the Ray cluster a feeder's per-sample work runs on, and the work put there once.

`connect` joins the cluster `service` names (or the one this process is connected to) within
a deadline, and says once per process who can reach it. `RayWork` puts the source, `transform`
and, once planned, the epochs' plan in the object store, and starts the tasks of
`feedpipe.ray.tasks` with their refs: the work travels to each node once, never with a task.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from typing import Any

from feedpipe.core.services import RAY, RAY_CLIENT

CONNECT_S = 30.0
"""Longest joining a cluster may take where `timeout_s` is None."""
EXPOSED = (
    "Ray's ports take connections with no authentication: whoever reaches the cluster's head "
    "can run code on every node; keep the cluster on a private network, or behind a firewall "
    "that admits only its nodes and trainers (docs/multi-host.md)"
)
"""Who can reach a Ray cluster, as the feeder says it once per process."""

_warned = False


def connect(service: str, timeout_s: float | None) -> None:
    """Joins the Ray cluster `service` names, within `timeout_s` (`CONNECT_S` where None), or
    raises naming the address and the fix; a process already connected stays so."""
    import ray

    deadline = CONNECT_S if timeout_s is None else timeout_s
    if service == RAY:
        if not ray.is_initialized():
            if not os.environ.get("RAY_ADDRESS"):
                raise ValueError(
                    '`service`="ray" runs the per-sample work on the Ray cluster this process '
                    "is connected to, but it is connected to none and RAY_ADDRESS is not set; "
                    'call ray.init(address="HOST:PORT") first, set RAY_ADDRESS, or pass '
                    'service="ray://HOST:PORT" (a Ray Client server).'
                )
            _init(os.environ["RAY_ADDRESS"], deadline, "RAY_ADDRESS")
    elif not ray.is_initialized():
        _reach(service, deadline)
        _init(service, deadline, "`service`")
    _say_exposure()


def _reach(service: str, deadline: float) -> None:
    """Refuses, within `deadline`, an address nothing answers at, before Ray retries it."""
    host, _, port = service.removeprefix(RAY_CLIENT).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"`service`={service!r} names no Ray Client server; pass "
            '"ray://HOST:PORT" (the head\'s client port, 10001 by default) or "ray".'
        )
    try:
        socket.create_connection((host, int(port)), timeout=deadline).close()
    except OSError as error:
        raise ConnectionError(
            f"`service`={service!r}: no Ray Client server answers at {host}:{port} "
            f"({error}); start the cluster's head with `ray start --head` (its client port "
            "is 10001 unless --ray-client-server-port says otherwise), or check the address."
        ) from error


def _init(address: str, deadline: float, named: str) -> None:
    """`ray.init(address)`, given up on after `deadline` seconds with a ConnectionError."""
    import ray

    failure: list[BaseException] = []

    def join() -> None:
        try:
            ray.init(address=address, log_to_driver=False)
        except BaseException as error:
            failure.append(error)

    joining = threading.Thread(target=join, name="feedpipe-ray-connect", daemon=True)
    joining.start()
    joining.join(deadline)
    if joining.is_alive() or failure:
        why = f"it did not answer in {deadline:g} s" if not failure else str(failure[0])
        raise ConnectionError(
            f"{named} names the Ray cluster at {address!r}, which could not be joined: {why}. "
            "Check the address and that the cluster runs (`ray status`), or pass a larger "
            "timeout_s."
        ) from (failure[0] if failure else None)


def _say_exposure() -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"feedpipe: warning: {EXPOSED}.", file=sys.stderr, flush=True)


class RayWork:
    """A feeder's work in the object store, and the tasks that run it."""

    def __init__(self, source: Any, transform: Any, seed: int, skips: bool):
        import ray

        from feedpipe.ray import tasks

        self._ray = ray
        self._tasks = tasks
        self.work = [ray.put(tasks.Work(source, transform, seed, skips))]
        """The work's ref, boxed so that a task gets the ref, not the value."""
        self.plan: list | None = None
        self._first_spec = ray.remote(tasks.first_spec).options(
            num_cpus=1, max_retries=tasks.RETRIES
        )
        self._rows = ray.remote(tasks.make_rows).options(num_cpus=1, max_retries=tasks.RETRIES)

    def first_spec(self, policy: Any, timeout_s: float | None) -> tuple[Any, Any]:
        """The first sample's spec and what was measured of the source, read in a task."""
        ref = self._first_spec.remote(self.work, policy)
        return self.get(ref, CONNECT_S if timeout_s is None else max(timeout_s, CONNECT_S))

    def set_plan(self, spec: Any, axes: list, measured: Any, sampler: Any) -> None:
        """Puts what the rows' tasks need once the feeder is planned."""
        plan = self._tasks.TaskPlan(spec, list(axes), measured, sampler)
        self.plan = [self._ray.put(plan)]

    def rows(self, epoch: int, step: int, lo: int, hi: int) -> Any:
        """Starts the task making rows `lo:hi` of `step`; returns its ref."""
        return self._rows.remote(self.work, self.plan, epoch, step, lo, hi)

    def ready(self, refs: list, timeout_s: float) -> list:
        """Those of `refs` whose tasks have answered, waiting up to `timeout_s` for all."""
        return self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        """A task's answer; the error its code raised comes as that error."""
        ray = self._ray
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            raise TimeoutError(
                f"A Ray task of the feeder did not answer in {timeout_s:g} s: the cluster may "
                "have no free CPU (`ray status`), or its nodes cannot import feedpipe."
            ) from error
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, BaseException) else None
            if cause is None:
                raise
            raise cause from None

    def cancel(self, refs: list) -> None:
        """Cancels tasks still out; one already done is let go of."""
        for ref in refs:
            with contextlib.suppress(Exception):  # done, or its node is gone: nothing runs
                self._ray.cancel(ref, force=False)

    def close(self) -> None:
        """Lets go of the work and plan: the object store frees them once no task holds them."""
        self.work = self.plan = None

    def cpus(self) -> int:
        """CPUs the cluster has now."""
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))
