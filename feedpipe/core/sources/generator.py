"""Generators: a stream of samples that a function yields, its shard of them per producer,
once an epoch (`fp.from_generator`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from feedpipe.core.sources.base import Source


class GeneratorSource(Source):
    """Samples come from `fn(shard, num_shards)`, a generator function called once per epoch
    (`fn(shard, num_shards, epoch)` where `fn` takes three arguments).

    Build one with `fp.from_generator(fn)`. With one producer, `fn(0, 1)` yields the whole
    epoch; with N workers, worker `i` reads the `sharded(i, N)` copy, which calls `fn(i, N)`.
    """

    shards_order = True

    def __init__(
        self, fn: Callable[[int, int], Iterable[Any]], shard: int = 0, num_shards: int = 1
    ):
        if not callable(fn):
            raise TypeError(
                f"fp.from_generator needs a callable fn(shard, num_shards) that yields samples; "
                f"got {type(fn).__name__}."
            )
        if not (_accepts(fn, 2) or _accepts(fn, 3)):
            raise TypeError(
                f"fp.from_generator(fn): fn{_signature(fn)} must take fn(shard, num_shards) (or "
                "fn(shard, num_shards, epoch)): each producer calls it for its shard of the "
                "samples, fn(0, 1) for all of them, and with workers=N worker i calls fn(i, N), "
                "so every shard is read once. Yield every num_shards-th sample from the "
                "shard-th, e.g. fp.from_generator(lambda shard, num_shards: "
                "itertools.islice(rows(), shard, None, num_shards))."
            )
        self.fn = fn
        self.shard = shard
        self.num_shards = num_shards
        self.takes_epoch = _accepts(fn, 3)

    def sharded(self, shard: int, num_shards: int) -> GeneratorSource:
        """The source of shard `shard` of `num_shards`."""
        return GeneratorSource(self.fn, shard, num_shards)

    def samples(self, epoch: int) -> Iterator[Any]:
        if self.takes_epoch:
            return iter(self.fn(self.shard, self.num_shards, epoch))
        return iter(self.fn(self.shard, self.num_shards))

    def first_sample(self) -> Any:
        for sample in self.samples(0):
            return sample
        raise ValueError("The dataset is empty: the generator yielded no sample.")

    def __repr__(self) -> str:
        return f"GeneratorSource({getattr(self.fn, '__qualname__', self.fn)!r})"


def from_generator(fn: Callable[..., Iterable[Any]]) -> GeneratorSource:
    """A source of the samples that `fn(shard, num_shards)` yields, for `fp.Feeder`.

    `fn` is called once per epoch; each call must yield that epoch's samples (a shard of them
    when `num_shards` > 1: with N workers every shard is read, so a `fn` that ignores its shard
    delivers each sample N times). Generators have no indices, so they cannot be shuffled by the
    feeder: shuffle inside `fn`, and take a third argument, `fn(shard, num_shards, epoch)`, to
    seed that shuffle from the epoch. A restore mid-epoch calls `fn` for the restored epoch and
    skips the samples already taken, so `fn` must yield the same order whenever it is called for
    the same epoch.
    """
    return GeneratorSource(fn)


def _accepts(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments."""
    try:
        inspect.signature(fn).bind(*range(count))
    except (TypeError, ValueError):
        return False
    return True


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"
