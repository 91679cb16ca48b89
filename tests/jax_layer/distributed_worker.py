"""One process of a `jax.distributed` cluster on loopback, run by test_jax_distributed.py.

`python tests/jax_layer/distributed_worker.py OUT_DIR ARGS_JSON`: joins the cluster as process
`process_id` of `num_processes` (coordinator at `coordinator`), with the host devices its
XLA_FLAGS give it and gloo for the computations that span processes; feeds samples that carry
their own index for an epoch and `stop_after` steps, restores the state saved there into a new
feeder that runs to the end of that second epoch, and writes what it saw of every step, locally
and through the global arrays, to OUT_DIR/process-<id>.json for the test to compare with the
one-process stream. It imports neither TensorFlow nor Keras (and reports whether either loaded).
With `"mode": "differ"` it builds instead one feeder per case with this process's own
arguments and reports what each raised (`differ`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import feedpipe as fp
from tests.worker_fakes import index_pairs


def feeder(args: dict) -> fp.Feeder:
    return fp.Feeder(
        index_pairs(args["length"]),
        args["global_batch"],
        devices=jax.devices(),
        shuffle=True,
        seed=args["seed"],
        workers=args["workers"],
    )


@jax.jit
def masked_sum(y: jax.Array, mask: jax.Array) -> jax.Array:
    """The sum of the real rows' ids: a reduction over every process's shards."""
    return jnp.sum(jnp.where(mask, y, 0))


def shards(array: jax.Array) -> list[dict]:
    """This process's shards of `array`: their device, rows of the global batch and values."""
    return [
        {
            "device": shard.device.id,
            "rows": [shard.index[0].start, shard.index[0].stop],
            "values": np.asarray(shard.data).tolist(),
        }
        for shard in sorted(array.addressable_shards, key=lambda s: s.index[0].start)
    ]


def seen(feeder: fp.Feeder, batch) -> dict:
    """What this process saw of one batch: its own rows, and the global arrays."""
    (x, y), mask = batch.distributed()
    local_y = np.concatenate([np.asarray(y) for _, y in batch.replicas])
    local_x = np.concatenate([np.asarray(x) for x, _ in batch.replicas])
    # The global array JAX's own multi-process constructor makes from this process's rows.
    reference = jax.make_array_from_process_local_data(feeder.sharding, local_y, y.shape)
    # Every process's rows, gathered into each process through the collectives.
    replicated = NamedSharding(feeder.layer.mesh, PartitionSpec())
    gathered = jax.jit(lambda a: a, out_shardings=replicated)(y)
    return {
        "epoch": batch.epoch,
        "step": batch.step,
        "num_valid": batch.num_valid,
        "local_ids": local_y.tolist(),
        "local_rows_agree": bool((local_x == local_y[:, None]).all()),
        "local_masks": np.concatenate([np.asarray(m) for m in batch.masks]).tolist(),
        "shapes": [list(x.shape), list(y.shape), list(mask.shape)],
        "sharding_is_the_feeders": x.sharding == y.sharding == mask.sharding == feeder.sharding,
        "sharding_devices": sorted(d.id for d in y.sharding.device_set),
        "shards": shards(y),
        "mask_shards": shards(mask),
        "reference_shards": shards(reference),
        "gathered_ids": np.asarray(gathered).tolist(),
        "masked_sum": int(masked_sum(y, mask)),
        "real_rows": int(jax.jit(jnp.sum)(mask.astype(jnp.int32))),
    }


def run(args: dict) -> dict:
    """An epoch and `stop_after` steps of the next on one feeder, then its state restored into
    a new feeder that runs to the end of that epoch."""
    steps = []
    first = feeder(args)
    with first:
        for batch in first:
            steps.append(seen(first, batch))
        for batch in first:
            steps.append(seen(first, batch))
            if batch.step + 1 == args["stop_after"]:
                break
        state = first.get_state()
        described = {
            "len": len(first),
            "mesh_devices": [d.id for d in first.layer.mesh.devices.flat],
            "mesh_processes": [d.process_index for d in first.layer.mesh.devices.flat],
            "local_devices": [d.id for d in first.devices],
            "rows": [first.share.rows.start, first.share.rows.stop],
        }
    second = feeder(args)
    with second:
        second.set_state(state)
        for batch in second:
            steps.append(seen(second, batch))
    return {**described, "steps": steps, "state": state}


def differ(args: dict) -> dict:
    """Each case's feeder built with this process's own arguments: what `fp.Feeder()` raised
    (None if it was built) and how long it took, what it left running; then one epoch from
    feeders that agree, this process's real ids; then, last (it leaves the processes' agreements
    out of step), a feeder built in process 0 only."""
    import threading

    import psutil

    process = jax.process_index()
    refused, took_s = {}, {}
    for case in args["cases"]:
        options = dict(case["processes"][process])
        length = options.pop("length", args["length"])
        global_batch = options.pop("global_batch", args["global_batch"])
        started = time.perf_counter()
        try:
            built = fp.Feeder(index_pairs(length), global_batch, devices=jax.devices(), **options)
        except Exception as error:  # the test reads what it was
            refused[case["name"]] = f"{type(error).__name__}: {error}"
        else:
            built.close()
            refused[case["name"]] = None
        took_s[case["name"]] = time.perf_counter() - started
    left = [t.name for t in threading.enumerate() if t.name.startswith("feedpipe")]
    left += [child.pid for child in psutil.Process().children(recursive=True)]
    real = []
    with fp.Feeder(
        index_pairs(args["length"]), args["global_batch"], devices=jax.devices(), shuffle=True
    ) as agreed:
        for batch in agreed:
            for (_, y), mask in zip(batch.replicas, batch.masks, strict=True):
                real += np.asarray(y)[np.asarray(mask)].tolist()
    alone, alone_s = None, None
    if process == 0:
        started = time.perf_counter()
        try:
            fp.Feeder(index_pairs(8), 4, devices=jax.devices()).close()
        except Exception as error:
            alone = f"{type(error).__name__}: {error}"
        alone_s = time.perf_counter() - started
    return {
        "refused": refused,
        "took_s": took_s,
        "left": left,
        "epoch": real,
        "alone": alone,
        "alone_s": alone_s,
    }


def main() -> None:
    faulthandler.enable()  # a crash inside XLA shows every thread's Python stack
    out, args = sys.argv[1], json.loads(sys.argv[2])
    started = time.perf_counter()
    # Computations over arrays that span processes run on CPU collectives; gloo comes with
    # jaxlib. Named here, before initialize, so the run does not rest on JAX's default.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args["coordinator"],
        num_processes=args["num_processes"],
        process_id=args["process_id"],
        initialization_timeout=args["timeout_s"],
    )
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [[d.id, d.process_index] for d in jax.devices()],
        **(differ(args) if args.get("mode") == "differ" else run(args)),
        "frameworks_loaded": sorted(
            {m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras"}
        ),
    }
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out, f"process-{args['process_id']}.json"), "w") as file:
        json.dump(result, file)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
