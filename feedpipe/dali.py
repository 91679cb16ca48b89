"""DALI: a DALI pipeline as a feeder source, one pipeline per replica.

NVIDIA DALI decodes and augments in its own C++ threads (and on the GPU). `DaliSource` wraps a
`@pipeline_def` function taking `shard_id` and `num_shards`; the feeder builds one pipeline
per replica (shard `i` of `num_replicas`, `device_id` that replica's GPU, or None on the CPU)
and lets DALI run each ahead with its own prefetch queue. Each output is handed to TensorFlow
through DLPack where DALI left it: an output of a GPU stage stays on its GPU (no trip through
host memory), a host output becomes a host tensor without a copy, and only a host output bound
for a GPU is copied, once, host to device. DALI's default executor keeps every output alive for
as long as something refers to it, so the tensors need no slot and never change. `as_dataset()`
joins the replicas' outputs into one host array per field (one copy). The `Batch` API, masks,
stats and remainder rules are the feeder's own:

- the reader must be named (`name=`, default "reader") and read with `pad_last_batch=True`,
  so every replica runs the same number of steps; rows DALI pads with are masked, never
  delivered as real samples;
- `remainder="pad"` delivers every file once per epoch; `"drop"` ends the epoch at the last
  step where every replica's rows are real (the `N mod global_batch_size` samples left out are
  the shards' tails); `"error"` refuses a file count that the global batch does not divide.

DALI is imported here alone, so `import feedpipe` never needs it. State uses DALI's own
pipeline checkpointing: after each step the pipelines' checkpoints are kept with the position,
`get_state()` carries those of the consumer's position and `set_state()` rebuilds the
pipelines from them, so a restored feeder continues the same stream (shuffling and random
augmentation included) without replaying it. A pipeline DALI cannot checkpoint (some readers)
still feeds, but its `get_state()` is an error that says why, never a silent restart.
"""

from __future__ import annotations

import base64
import collections
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from feedpipe.core.checks import check_int
from feedpipe.core.producers import Producer, SlotSupply
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import EpochEnd, Step
from feedpipe.core.sources import Source
from feedpipe.core.split import HostShare
from feedpipe.core.stage import Imported
from feedpipe.core.state import Position

INSTALL = "pip install feedpipe[dali] (nvidia-dali-cuda120)"
KEPT_CHECKPOINTS = 64
"""Positions whose checkpoints are kept: more than the batches any feeder holds in flight."""


def _dali():
    try:
        import nvidia.dali as dali
    except ImportError as error:
        raise ImportError(
            f"feedpipe.dali needs NVIDIA DALI; install it with `{INSTALL}`."
        ) from error
    return dali


class DaliSource(Source):
    """A DALI pipeline definition for `fp.Feeder`: one pipeline per replica, each its shard.

    Args:
        pipeline: a function decorated with `nvidia.dali.pipeline_def`, taking `shard_id` and
            `num_shards` (pass them to the reader) and returning the sample's fields.
        names: names of the outputs, in order; samples become dicts of them. None: a tuple
            (one output: that output alone). The pipeline must return exactly these outputs.
        reader_name: the `name=` of the pipeline's reader, which says how many samples an
            epoch holds.
        num_threads: DALI's CPU threads per pipeline.
        prefetch_queue_depth: batches each pipeline runs ahead, in DALI's own queue.
        seed: the pipelines' seed (shuffling and random augmentation); shard `i` uses
            `seed + i`.
    """

    replicas_order = True

    def __init__(
        self,
        pipeline: Callable[..., Any],
        *,
        names: Sequence[str] | None = None,
        reader_name: str = "reader",
        num_threads: int = 2,
        prefetch_queue_depth: int = 2,
        seed: int = 0,
    ):
        _dali()
        if not callable(pipeline):
            raise TypeError(
                f"`pipeline` must be a function decorated with @nvidia.dali.pipeline_def; got "
                f"{type(pipeline).__name__}."
            )
        check_int("num_threads", num_threads, "pass DALI's CPU threads per pipeline, e.g. 2")
        check_int("prefetch_queue_depth", prefetch_queue_depth, "use 2, DALI's own default")
        self.pipeline = pipeline
        self.names = None if names is None else tuple(names)
        self.reader_name = reader_name
        self.num_threads = self.own_threads = num_threads
        self.prefetch_queue_depth = prefetch_queue_depth
        self.seed = seed
        self.checkpointing = True
        """Whether DALI can checkpoint the pipeline; `uncheckpointable` says why not."""
        self.uncheckpointable: str | None = None
        try:
            probe = self.build(0, 1, 1, _probe_device())
        except RuntimeError as error:
            if "checkpoint" not in str(error).lower():
                raise
            self.checkpointing, self.uncheckpointable = False, str(error).strip().splitlines()[0]
            probe = self.build(0, 1, 1, _probe_device())
        meta = probe.reader_meta(self.reader_name)
        if not meta:
            raise ValueError(
                f"The pipeline has no reader named {reader_name!r}; give its reader "
                f'name="{reader_name}" (or pass reader_name=).'
            )
        if not meta["pad_last_batch"]:
            raise ValueError(
                f"The reader {reader_name!r} must be built with pad_last_batch=True, so that "
                "every replica runs the same number of steps; feedpipe masks the padded rows."
            )
        self.length: int = int(meta["epoch_size"])
        """Samples per epoch, across every shard."""
        self.stick_to_shard = bool(meta["stick_to_shard"])
        outputs = self._run(probe)
        self._first = self._sample(outputs, 0)
        self.fields = [(tuple(out.as_tensor().shape())[1:], _numpy_dtype(out)) for out in outputs]
        """Each output's per-sample shape and numpy dtype: every batch must keep them."""
        del outputs, probe

    def build(
        self,
        shard_id: int,
        num_shards: int,
        batch_size: int,
        device_id: int | None,
        checkpoint: str | bytes | None = None,
    ):
        """The pipeline of shard `shard_id`, built; from `checkpoint` if one is given."""
        pipe = self.pipeline(
            shard_id=shard_id,
            num_shards=num_shards,
            batch_size=batch_size,
            num_threads=self.num_threads,
            device_id=device_id,
            seed=self.seed + shard_id,
            prefetch_queue_depth=self.prefetch_queue_depth,
            exec_dynamic=True,  # outputs stay valid while referred to: handed over in place
            enable_checkpointing=self.checkpointing,
            checkpoint=checkpoint,
        )
        pipe.build()
        return pipe

    def _run(self, pipe) -> list:
        """One batch of `pipe`'s outputs (tensor lists, where DALI left them), checked against
        `names` and for one shape per output."""
        outputs = pipe.run()
        outputs = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        if self.names is not None and len(outputs) != len(self.names):
            raise ValueError(
                f"The pipeline returns {len(outputs)} outputs but `names` declares "
                f"{len(self.names)} ({', '.join(self.names)}); return one output per name."
            )
        for index, out in enumerate(outputs):
            if not out.is_dense_tensor():
                raise ValueError(
                    f"Output {self._name(index)} of the pipeline has samples of different "
                    f"shapes ({[tuple(out[i].shape()) for i in range(min(len(out), 3))]}...); "
                    "resize or crop them to one shape in the pipeline."
                )
        return outputs

    def _sample(self, outputs: list, row: int) -> Any:
        fields = []
        for out in outputs:
            out = out.as_cpu() if hasattr(out, "as_cpu") else out
            fields.append(np.asarray(out.as_array()[row]))
        if self.names is not None:
            return dict(zip(self.names, fields, strict=True))
        return fields[0] if len(fields) == 1 else tuple(fields)

    def _name(self, index: int) -> str:
        return repr(self.names[index]) if self.names is not None else str(index)

    def first_sample(self) -> Any:
        """Sample 0 of shard 0: it tells the feeder the samples' structure, shapes and dtypes."""
        return self._first

    def producer(self, share: HostShare, devices: Sequence[str], rule: Remainder) -> DaliProducer:
        return DaliProducer(self, share, devices, rule)

    def __repr__(self) -> str:
        return (
            f"DaliSource({getattr(self.pipeline, '__name__', self.pipeline)!r}, "
            f"length={self.length}, names={self.names}, reader_name={self.reader_name!r}, "
            f"num_threads={self.num_threads}, seed={self.seed})"
        )


def _device_id(device: str) -> int | None:
    """The GPU index of a TensorFlow device name, or None for a CPU device."""
    kind, _, index = device.rsplit("/", 1)[-1].partition(":")
    kind = kind.removeprefix("device:").upper()
    return int(index) if kind == "GPU" else None


def _probe_device() -> int | None:
    """GPU 0 where DALI sees a GPU (a pipeline with GPU stages builds only there), else None."""
    from nvidia.dali import backend

    try:
        return 0 if backend.GetCUDADeviceCount() > 0 else None
    except RuntimeError:  # no CUDA driver
        return None


class DaliProducer(Producer):
    """Runs one pipeline per replica and hands each step's outputs over where DALI left them.

    Under a multi-worker strategy each host runs the pipelines of its own replicas only (shard
    `r` of the global replicas), and its state is its own pipelines' checkpoints: each host
    saves and restores its own (Grain's `process_<i>-of-<n>` rule), into as many hosts.
    """

    def __init__(
        self, source: DaliSource, share: HostShare, devices: Sequence[str], rule: Remainder
    ):
        self.source = source
        self.share = share
        self.split = share.local_split
        split = self.split
        self.device_ids = [_device_id(device) for device in devices]
        self.rule = rule
        shards = share.num_replicas
        n = source.length
        self.shard_sizes = [n * (i + 1) // shards - n * i // shards for i in range(shards)]
        """Real samples in each shard: DALI cuts the file list into contiguous parts."""
        self.iterations = math.ceil(math.ceil(n / shards) / split.per_replica)
        """Steps DALI runs per epoch: its padded shards, in per-replica batches."""
        full = min(self.shard_sizes) // split.per_replica
        self.steps = self.iterations if rule.pads else full
        self.slots_in_flight = 0  # its batches stay in DALI's memory: it takes no slot
        self._checkpoints: collections.OrderedDict[tuple[int, int], list[str | bytes]] = (
            collections.OrderedDict()
        )
        """DALI's checkpoint of every pipeline at each position produced lately (or restored):
        a consumer's position is at most a few batches behind the producer's."""

    def state_at(self, position: tuple[int, int]) -> list[str] | None:
        """The pipelines' checkpoints at the consumer's `position`, for `Feeder.get_state`."""
        if not self.source.checkpointing:
            raise RuntimeError(
                f"The feeder's state cannot be saved: DALI cannot checkpoint this pipeline "
                f"({self.source.uncheckpointable}), and restarting it would repeat samples. "
                "Use readers and operators that support DALI checkpointing to save and restore "
                "the position."
            )
        saved = self._checkpoints.get(tuple(position))
        if saved is None:
            return None
        pipelines = [_encode(checkpoint) for checkpoint in saved]
        if self.share.num_hosts == 1:
            return pipelines
        return {"host": self.share.host, "num_hosts": self.share.num_hosts, "pipelines": pipelines}

    def restore(self, position: tuple[int, int], checkpoints: list[str] | None) -> None:
        """Makes the next stream start from `checkpoints`, taken at `position`."""
        if checkpoints is not None and (isinstance(checkpoints, dict) or self.share.num_hosts > 1):
            checkpoints = self._this_hosts(checkpoints)
        if checkpoints is not None:
            if len(checkpoints) != self.split.num_replicas:
                raise ValueError(
                    f"The state holds DALI checkpoints of {len(checkpoints)} pipelines, but this "
                    f"feeder runs {self.split.num_replicas}; restore into a feeder with as many "
                    "replicas."
                )
            self._remember(tuple(position), [_decode(text) for text in checkpoints])

    def _this_hosts(self, saved: dict | list) -> list[str]:
        """The pipelines' checkpoints in a state this host saved; refuses another host's."""
        share = self.share
        mine = {"host": share.host, "num_hosts": share.num_hosts}
        theirs = (
            {"host": 0, "num_hosts": 1}
            if not isinstance(saved, dict)
            else {"host": saved.get("host"), "num_hosts": saved.get("num_hosts")}
        )
        if theirs != mine:
            raise ValueError(
                f"The state holds the DALI pipelines of host {theirs['host']} of "
                f"{theirs['num_hosts']}, but this is host {share.host} of {share.num_hosts}: "
                "each host's DALI readers are at a position of their own. Save each host's "
                "get_state() (e.g. to state-<host>-of-<hosts>.json) and restore each host's "
                "own, with as many hosts."
            )
        return saved["pipelines"] if isinstance(saved, dict) else saved

    def _remember(self, position: tuple[int, int], checkpoints: list[str | bytes]) -> None:
        self._checkpoints[position] = checkpoints
        self._checkpoints.move_to_end(position)
        while len(self._checkpoints) > KEPT_CHECKPOINTS:
            self._checkpoints.popitem(last=False)

    def _replica_valid(self, epoch: int, index: int) -> tuple[int, ...]:
        """Real rows of each replica at step `index`; without stick_to_shard, DALI's readers
        move on to the next shard every epoch."""
        b, shards = self.split.per_replica, self.share.num_replicas
        shift = 0 if self.source.stick_to_shard else epoch
        return tuple(
            min(b, max(0, self.shard_sizes[(r + shift) % shards] - index * b))
            for r in range(shards)
        )

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, Imported] | EpochEnd]:
        b, shards = self.split.per_replica, self.share.num_replicas
        mine = slice(self.share.first_replica, self.share.first_replica + len(self.device_ids))
        saved = self._checkpoints.get((start.epoch, start.step))
        pipes = [
            self.source.build(
                mine.start + r, shards, b, device, None if saved is None else saved[r]
            )
            for r, device in enumerate(self.device_ids)
        ]
        if saved is None:  # no checkpoint of that position: DALI replays it from its seed
            for _ in range(start.epoch * self.iterations + start.step):
                supply.check_stop()
                for pipe in pipes:
                    pipe.run()
        epoch, first = start.epoch, start.step
        dropped = (
            0 if self.rule.pads else self.source.length - self.steps * self.rule.global_batch_size
        )
        while True:
            for index in range(first, self.steps):
                supply.check_stop()
                outputs = Imported(
                    [self._outputs(replica, pipe) for replica, pipe in enumerate(pipes)]
                )
                after = (epoch, index + 1)
                if index + 1 == self.steps:
                    for _ in range(self.steps, self.iterations):  # "drop": unused steps
                        for pipe in pipes:
                            pipe.run()
                    after = (epoch + 1, 0)
                if self.source.checkpointing:
                    self._remember(after, [pipe.checkpoint() for pipe in pipes])
                valid = self._replica_valid(epoch, index)
                yield Step(epoch, index, None, sum(valid), replica_valid=valid[mine]), outputs
                del outputs  # DALI's buffers go back when the staged tensors are dropped
            yield EpochEnd(epoch, dropped=dropped)
            epoch, first = epoch + 1, 0

    def _outputs(self, replica: int, pipe) -> list:
        """One step of a replica's pipeline: its outputs as dense tensors, checked against the
        first batch's shapes and dtypes."""
        outputs = self.source._run(pipe)
        fields = self.source.fields
        if len(outputs) != len(fields):
            raise ValueError(
                f"The pipeline returned {len(outputs)} outputs, but its first batch had "
                f"{len(fields)}; return the same outputs every time."
            )
        tensors = []
        for index, (out, (shape, dtype)) in enumerate(zip(outputs, fields, strict=True)):
            tensor = out.as_tensor()
            got = tuple(tensor.shape())
            if got[1:] != shape or got[0] != self.split.per_replica or _numpy_dtype(out) != dtype:
                raise ValueError(
                    f"Output {self.source._name(index)} of shard {replica} has shape {got} "
                    f"and dtype {_numpy_dtype(out)}, but the first sample had shape {shape} and "
                    f"dtype {dtype} per row; make every output the same shape and dtype (resize "
                    "or crop in the pipeline)."
                )
            tensors.append(tensor)
        return tensors


def _encode(checkpoint: bytes | str) -> str:
    """A DALI checkpoint as JSON-safe text."""
    raw = checkpoint.encode() if isinstance(checkpoint, str) else checkpoint
    return base64.b64encode(raw).decode("ascii")


def _decode(text: str) -> bytes:
    return base64.b64decode(text)


def _numpy_dtype(out) -> np.dtype:
    """The numpy dtype of a DALI tensor list."""
    return _to_numpy(out.dtype)


@functools.cache
def _to_numpy(dali_dtype) -> np.dtype:
    from nvidia.dali import types

    return np.dtype(types.to_numpy_type(dali_dtype))
