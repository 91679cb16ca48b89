"""Shared memory: feedpipe's buffers are found by their exact names, and nothing else is."""

from __future__ import annotations

import mmap

import numpy as np

from feedpipe.core._shm import SharedBuffer
from tests.conftest import feedpipe_memory


def test_the_leak_check_ignores_a_checkout_whose_path_holds_feedpipe_dash(tmp_path):
    folder = tmp_path / "feedpipe-0.1.0" / ".venv"  # an unpacked sdist and its venv
    folder.mkdir(parents=True)
    path = folder / "libsomething.so"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), mmap.PAGESIZE):
        assert feedpipe_memory() == []


def test_the_leak_check_finds_a_buffer_still_mapped():
    buffer = SharedBuffer(64, "slot")
    view = buffer.array
    buffer.close()  # the descriptor goes; the mapping lives as long as a view of it
    assert any(buffer.name in entry for entry in feedpipe_memory())
    del view
    assert feedpipe_memory() == []


def test_a_mapping_holds_no_descriptor_and_ends_with_its_last_view():
    buffer = SharedBuffer(4096, "slot")
    view = buffer.array[:16]
    buffer.close()
    fds = [entry for entry in feedpipe_memory() if entry.startswith("fd ")]
    assert fds == []
    view[:] = np.arange(16, dtype=np.uint8)  # still mapped, still writable
    assert view.sum() == sum(range(16))
