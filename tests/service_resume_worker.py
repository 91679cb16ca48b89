"""One feeder on a tf.data service, killed mid-epoch and resumed in a new process.

    python tests/service_resume_worker.py MODE OUT_DIR SERVICE

MODE is one of:

- `save`: takes `SAVE_AFTER` steps of `tests.test_service.feeder` on the service at SERVICE,
  writes them and `feeder.get_state()` to `OUT_DIR/saved.json` and dies by SIGKILL: no cleanup,
  no `finally`, its service job left unread.
- `resume`: builds the same feeder, restores that state, and writes the rest of the epoch and
  the next (`tests.test_service.stream`'s form), and the rows it asked the service for, to
  `OUT_DIR/resumed.json`.

Driven by `test_service_hosts.py`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests.cluster_worker import asked_of_service, wait_for_service_jobs
from tests.fakes import configure_logical_cpus
from tests.test_service import feeder, scaled, stream, stream_of

LENGTH = 21
"""Not a multiple of the global batch: every epoch ends on a padded batch of 1 real row."""
GLOBAL_BATCH = 4
REPLICAS = 2
EPOCHS = 2
SAVE_AFTER = 2
"""Steps of epoch 0 taken before the state is written: 4 of its 6 remain."""
MODES = ("save", "resume")


def write_json(path: Path, value) -> None:
    """Writes `value` whole or not at all (a reader never sees half a file)."""
    with open(path.with_suffix(".tmp"), "w") as file:
        json.dump(value, file)
    os.replace(path.with_suffix(".tmp"), path)


def main(mode: str, out: Path, service: str) -> None:
    configure_logical_cpus(REPLICAS)
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    remote = feeder(service, LENGTH, GLOBAL_BATCH, devices, scaled)
    if mode == "save":
        batches = iter(remote)
        taken = [step for _ in range(SAVE_AFTER) for step in stream_of(next(batches))]
        write_json(out / "saved.json", {"steps": taken, "state": remote.get_state()})
        os.kill(os.getpid(), signal.SIGKILL)
    asked = asked_of_service(remote)
    with remote:
        remote.set_state(json.loads((out / "saved.json").read_text())["state"])
        got = stream(remote, EPOCHS)
    wait_for_service_jobs()
    write_json(out / "resumed.json", {"steps": got, "asked": list(asked)})


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} OUT_DIR SERVICE")
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
