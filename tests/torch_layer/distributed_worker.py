"""One rank of a `torch.distributed` job on loopback, run by test_torch_distributed.py.

`python tests/torch_layer/distributed_worker.py OUT_DIR ARGS_JSON`, with `MASTER_ADDR`,
`MASTER_PORT`, `RANK` and `WORLD_SIZE` set as `torchrun` sets them: joins the process group on
gloo, builds `fp.Feeder(samples, global_batch, workers=...)` with no devices (this process's:
the CPU) and trains a `DistributedDataParallel` linear model on the staged tensors for an epoch and
`stop_after` steps, each step's loss weighted by the mask and normalised by `batch.num_valid`;
then restores the state saved there into a new feeder (without workers) that runs to the end of
that epoch, and the state a one-process feeder saved (`from_one`) into another. It writes what
this rank saw of every step, and its parameters, to OUT_DIR/rank-<rank>.json for the test to
compare with the one-process stream. With `"mode": "differ"` it builds instead one feeder per
case with this rank's own arguments and reports what each raised.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import feedpipe as fp
from tests.worker_fakes import index_pairs

LEARNING_RATE = 0.5


def make_model() -> torch.nn.Module:
    """The same linear model in every rank and in the test's one-process reference."""
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def masked_loss(model, x, y, mask, num_valid: int, world_size: int, length: int) -> torch.Tensor:
    """This rank's part of the global batch's mean squared error over its real rows.

    `DistributedDataParallel` averages the ranks' gradients, so each rank's sum over its real
    rows is scaled by `world_size / num_valid`: the average is then the gradient of the mean
    over the global batch's real rows, padding counting for nothing. Ids are scaled to [0, 1).
    """
    predicted = model(x / length).squeeze(1)
    errors = (predicted - y.to(torch.float32) / length) ** 2
    return torch.where(mask, errors, 0.0).sum() * (world_size / num_valid)


def feeder(args: dict, workers: int) -> fp.Feeder:
    return fp.Feeder(
        index_pairs(args["length"]),
        args["global_batch"],
        shuffle=True,
        seed=args["seed"],
        workers=workers,
    )


def seen(batch) -> dict:
    """What this rank saw of one batch: its own rows."""
    (x, y), mask = batch.distributed()
    return {
        "epoch": batch.epoch,
        "step": batch.step,
        "num_valid": batch.num_valid,
        "ids": y.tolist(),
        "masks": mask.tolist(),
        "rows_agree": bool((x == y[:, None].to(x.dtype)).all()),
        "tensors": all(isinstance(t, torch.Tensor) for t in (x, y, mask)),
        "devices": sorted({str(t.device) for t in (x, y, mask)}),
    }


def rest_of_epoch(args: dict, state: dict) -> list[dict]:
    """The steps a new feeder restored from `state` delivers to the end of that epoch (read
    by the feeder's thread: the order does not depend on the workers)."""
    with feeder(args, workers=0) as restored:
        restored.load_state_dict(state)
        return [seen(batch) for batch in restored]


def train(args: dict) -> dict:
    """An epoch and `stop_after` steps of the next, training the DDP model on each batch; then
    the rest of that epoch from the state saved there and from the one-process state."""
    world_size = dist.get_world_size()
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    steps, losses = [], []
    first = feeder(args, args["workers"])
    with first:
        for epoch in range(2):
            for batch in first:
                steps.append(seen(batch))
                (x, y), mask = batch.distributed()
                loss = masked_loss(model, x, y, mask, batch.num_valid, world_size, args["length"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if epoch == 1 and batch.step + 1 == args["stop_after"]:
                    break
        state = first.state_dict()
        described = {
            "layer": first.layer.name,
            "len": len(first),
            "devices": [str(d) for d in first.devices],
            "rows": [first.share.rows.start, first.share.rows.stop],
        }
    return {
        **described,
        "steps": steps,
        "losses": losses,
        "parameters": [p.detach().tolist() for p in model.module.parameters()],
        "state": state,
        "resumed": rest_of_epoch(args, state),
        "from_one": rest_of_epoch(args, args["from_one"]),
    }


def left_running() -> list:
    """feedpipe threads and child processes this rank still has."""
    left = [t.name for t in threading.enumerate() if t.name.startswith("feedpipe")]
    return left + [child.pid for child in psutil.Process().children(recursive=True)]


def differ(args: dict) -> dict:
    """Each case's feeder built with this rank's own arguments: what `fp.Feeder()` raised (None
    if it was built) and how long it took; what was left running; one epoch from feeders that
    agree, this rank's real ids; then, last (it leaves the ranks' agreements out of step), a
    feeder built in rank 1 only, while rank 0 waits at a barrier."""
    rank = dist.get_rank()
    refused, took_s = {}, {}
    for case in args["cases"]:
        options = dict(case["ranks"][rank])
        length = options.pop("length", args["length"])
        started = time.perf_counter()
        try:
            built = fp.Feeder(index_pairs(length), args["global_batch"], **options)
        except Exception as error:  # the test reads what it was
            refused[case["name"]] = f"{type(error).__name__}: {error}"
        else:
            built.close()
            refused[case["name"]] = None
        took_s[case["name"]] = time.perf_counter() - started
    left = left_running()
    real = []
    with fp.Feeder(index_pairs(args["length"]), args["global_batch"], shuffle=True) as agreed:
        for batch in agreed:
            (_, y), mask = batch.distributed()
            real += y[mask].tolist()
    alone, alone_s = None, None
    if rank == 1:
        started = time.perf_counter()
        try:
            fp.Feeder(index_pairs(8), 4).close()
        except Exception as error:
            alone = f"{type(error).__name__}: {error}"
        alone_s = time.perf_counter() - started
    dist.barrier()  # rank 0 holds the store: it stays until rank 1 has its answer
    return {
        "refused": refused,
        "took_s": took_s,
        "left": left,
        "epoch": real,
        "alone": alone,
        "alone_s": alone_s,
        "left_at_end": left_running(),
    }


def main() -> None:
    faulthandler.enable()
    out, args = sys.argv[1], json.loads(sys.argv[2])
    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args["timeout_s"]))
    result = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        **(differ(args) if args.get("mode") == "differ" else train(args)),
        "frameworks_loaded": sorted(
            {m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras", "jax"}
        ),
    }
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
