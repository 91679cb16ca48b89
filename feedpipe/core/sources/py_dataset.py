"""Keras's `PyDataset`: samples that are the rows of its batches, each batch read once an epoch."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import optree

from feedpipe.core.skips import ErrorPolicy, over_budget
from feedpipe.core.sources.base import Source, is_instance_of_loaded
from feedpipe.core.text import listed


class PyDatasetSource(Source):
    """Samples are the rows of a `keras.utils.PyDataset`'s batches.

    Its batches are read whole and kept while their rows are taken, and the sampler shuffles
    whole batches (`block_size` rows), so each batch is read once per epoch. Its batch size and
    length are read from its batches by `measure` (in a worker, where there are workers): the
    last one and the first that reads of the others.
    """

    indexed = True

    @classmethod
    def adapts(cls, data: Any) -> bool:
        return is_instance_of_loaded(data, "keras", "utils.PyDataset")

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.num_batches = dataset.num_batches
        if self.num_batches is None:
            raise ValueError(
                "`source` is a PyDataset without a length (num_batches is None); give it a "
                "`__len__`, or wrap its batches in fp.from_generator."
            )
        if self.num_batches < 1:
            raise ValueError("The dataset is empty (the PyDataset has 0 batches).")
        self.rows: tuple[int, int] | None = None
        """The rows of every batch but the last, and the rows of all, once measured."""
        self._local = threading.local()

    @property
    def block_size(self) -> int:
        return self.measure()[0]

    @property
    def length(self) -> int:
        return self.measure()[1]

    def measure(self, policy: ErrorPolicy | None = None) -> tuple[int, int]:
        """Reads the rows of the last batch, which the length depends on, and of the first of
        the others that reads: under `policy`'s `errors="skip"`, batches that raise are passed
        over, as the epochs will skip their rows, within the budget."""
        if self.rows is None:
            self.rows = self._measure(policy)
        return self.rows

    def learn(self, measured: tuple[int, int]) -> None:
        self.rows = tuple(measured)

    def _measure(self, policy: ErrorPolicy | None) -> tuple[int, int]:
        skips = policy is not None and policy.skips
        last_number = self.num_batches - 1
        last = self._rows_of(
            last_number,
            "count its rows, which the length depends on"
            + (' (errors="skip" cannot pass over it)' if skips else ""),
        )
        if not last_number:
            return last, last
        # Each batch passed over holds at least one sample the epochs will skip, so passing
        # over more than the budget of the longest length possible is sure to exceed it.
        limit = policy.budget(last_number + last) if skips else 0
        failed: list[int] = []
        for number in range(last_number):
            try:
                block = self._rows_of(number, "learn its batch size")
                break
            except Exception as error:
                failed.append(number)
                if len(failed) > limit or number + 1 == last_number:
                    if skips:
                        error.add_note(
                            f'feedpipe: errors="skip" passed over PyDataset batches '
                            f"{listed(failed)}, which all raised, and found none within "
                            f"{policy} to learn its batch size from."
                        )
                    raise
                latest = error
        length = block * last_number + last
        if failed and len(failed) * block > policy.budget(length):
            skipping = f"{len(failed) * block} samples of epoch 0 (batches {listed(failed)})"
            latest.add_note(over_budget(skipping, policy, policy.budget(length)))
            raise latest
        return block, length

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def _cache(self) -> dict[int, tuple[list[np.ndarray], optree.PyTreeSpec]]:
        """The batches this thread is reading (each worker thread keeps its own)."""
        if not hasattr(self._local, "cache"):
            self._local.cache = {}
        return self._local.cache

    def _batch(self, number: int) -> tuple[list[np.ndarray], optree.PyTreeSpec]:
        cache = self._cache
        if number not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            leaves, treespec = optree.tree_flatten(self.dataset[number])
            arrays = [np.asarray(leaf) for leaf in leaves]
            expected = self.block_size if number < self.num_batches - 1 else None
            sizes = {len(a) for a in arrays}
            if len(sizes) != 1 or (expected is not None and sizes != {expected}):
                raise ValueError(
                    f"PyDataset batch {number} has fields with {sorted(sizes)} rows; every "
                    f"batch but the last must have {self.block_size} rows in every field."
                )
            cache[number] = (arrays, treespec)
        return cache[number]

    def _rows_of(self, number: int, why: str) -> int:
        """The rows of batch `number`, read to `why`; an error gets a note saying so."""
        try:
            leaves = optree.tree_leaves(self.dataset[number])
            if not leaves:
                raise ValueError(f"PyDataset batch {number} has no fields.")
            return len(np.asarray(leaves[0]))
        except Exception as error:
            error.add_note(
                f"feedpipe: raised in {threading.current_thread().name} while reading batch "
                f"{number} of the PyDataset, to {why}."
            )
            raise

    def sample(self, index: int) -> Any:
        arrays, treespec = self._batch(index // self.block_size)
        row = index % self.block_size
        return optree.tree_unflatten(treespec, [array[row] for array in arrays])

    def on_epoch_end(self) -> None:
        self._cache.clear()
        self.dataset.on_epoch_end()

    def __repr__(self) -> str:
        rows = "unread" if self.rows is None else self.rows[1]
        return f"PyDatasetSource(batches={self.num_batches}, rows={rows})"
