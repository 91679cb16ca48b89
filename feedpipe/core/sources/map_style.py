"""Map-style objects: samples read one at a time from anything with `__len__` and
`__getitem__(i)`."""

from __future__ import annotations

from typing import Any

from feedpipe.core.sources.base import Source, refuse_empty


class MapSource(Source):
    """Samples come from an object with `__len__` and `__getitem__(i)` returning one sample."""

    indexed = True

    def __init__(self, data: Any):
        self.data = data
        self.length = len(data)
        refuse_empty(self.length)

    def sample(self, index: int) -> Any:
        return self.data[index]

    def __repr__(self) -> str:
        return f"MapSource({type(self.data).__name__}, length={self.length})"
