"""feedpipe's own CUDA streams through the driver API: each device gets a non-blocking stream and
a blocking-sync event in its primary context, every copy is issued on that stream with that
context current and the event recorded behind it, the wait polls the event and sleeps on it only
if the copies are not done by then, the bytes land exactly, an exhausted device names the
setting to change, and close frees what it made.

No GPU is needed: a fake driver (`libcuda.so.1`, built here with gcc, "device memory" being host
memory) logs each call. Each scenario runs in a fresh Python that loads it first, as a framework
would load the real driver, so feedpipe finds it in `/proc/self/maps`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.core.test_pinned import REPO

FAKE_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Each call is appended to $FAKE_CUDA_LOG as one line: "call handle detail context". */
static __thread void *stack[16];
static __thread int depth;
static int initialized, streams, events;

static void note(const char *call, uint64_t handle, uint64_t detail) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (!path) return;
    FILE *log = fopen(path, "a");
    fprintf(log, "%s %lu %lu %lu\n", call, (unsigned long)handle, (unsigned long)detail,
            (unsigned long)(depth ? (uintptr_t)stack[depth - 1] : 0));
    fclose(log);
}

int cuInit(unsigned flags) { initialized = 1; return 0; }
int cuDeviceGet(int *device, int ordinal) {
    if (!initialized) return 3;
    *device = ordinal;
    return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    *ctx = (void *)(uintptr_t)(0xC0FFEE00 + device);
    return 0;
}
int cuCtxPushCurrent_v2(void *ctx) { stack[depth++] = ctx; return 0; }
int cuCtxPopCurrent_v2(void **ctx) {
    if (!depth) return 201;
    *ctx = stack[--depth];
    return 0;
}
int cuGetErrorString(int code, const char **text) {
    *text = code == 2 ? "out of memory" : "unknown";
    return 0;
}
int cuStreamCreate(void **stream, unsigned flags) {
    *stream = (void *)(uintptr_t)(0x5000 + ++streams);
    note("stream", (uintptr_t)*stream, flags);
    return 0;
}
int cuStreamDestroy_v2(void *stream) { note("stream_destroy", (uintptr_t)stream, 0); return 0; }
int cuEventCreate(void **event, unsigned flags) {
    *event = (void *)(uintptr_t)(0xE000 + ++events);
    note("event", (uintptr_t)*event, flags);
    return 0;
}
int cuEventDestroy_v2(void *event) { note("event_destroy", (uintptr_t)event, 0); return 0; }
int cuEventRecord(void *event, void *stream) {
    note("record", (uintptr_t)event, (uintptr_t)stream);
    return 0;
}
int cuEventSynchronize(void *event) { note("synchronize", (uintptr_t)event, 0); return 0; }
/* The copies report done at the first query with FAKE_CUDA_DONE, else never (600: not ready). */
int cuEventQuery(void *event) {
    note("query", (uintptr_t)event, 0);
    return getenv("FAKE_CUDA_DONE") ? 0 : 600;
}
int cuMemAlloc_v2(uint64_t *address, size_t nbytes) {
    if (getenv("FAKE_CUDA_FULL")) return 2;
    void *p = NULL;
    if (posix_memalign(&p, 256, nbytes)) return 2;
    *address = (uint64_t)(uintptr_t)p;
    note("alloc", *address, nbytes);
    return 0;
}
int cuMemFree_v2(uint64_t address) {
    note("free", address, 0);
    free((void *)(uintptr_t)address);
    return 0;
}
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t nbytes, void *stream) {
    memcpy((void *)(uintptr_t)dst, src, nbytes);
    note("copy", dst, (uintptr_t)stream);
    return 0;
}
"""

SCENARIO = r"""
import ctypes, gc, json, sys

config = json.loads(sys.argv[1])
ctypes.CDLL(config["driver"], ctypes.RTLD_GLOBAL)

import numpy as np

from feedpipe.core.copy_engine import STAGES, CopyEngine, cuda_devices
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit
from tests.device_fakes import ManualFence

facts = {}
memories, reason = cuda_devices([0, 1])
facts["reason"] = reason
spec = SampleSpec.of((np.zeros(100, np.float32), np.zeros((), np.int64)))
layout = SlotLayout(spec, ReplicaSplit(8, 2))
fences = []
engine = CopyEngine(memories, spec, 4, 2, [lambda: ManualFence(fences)] * 2)
slot = np.zeros(layout.nbytes, np.uint8)
for r, (features, labels) in enumerate(layout.views(slot)):
    labels[:] = np.arange(4) + 4 * r
    features[:] = labels[:, None] * 0.5
try:
    base = slot.ctypes.data
    sources = [[(base + offset, size) for offset, size in row] for row in layout.spans]
    with engine.copy(sources, dict.fromkeys(STAGES, 0.0)) as exports:
        facts["device"] = [fields[0].__dlpack_device__() for fields in exports]
        facts["values"] = [
            [np.frombuffer(ctypes.string_at(e.address, int(np.prod(e.shape)) * e.dtype.itemsize),
                           e.dtype).tolist() for e in fields]
            for fields in exports
        ]
        facts["addresses"] = [[e.address for e in fields] for fields in exports]
except MemoryError as error:
    facts["error"] = str(error)
engine.close()
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build a fake CUDA driver; none is on PATH")
    folder = tmp_path_factory.mktemp("fake_driver")
    (folder / "fake_driver.c").write_text(FAKE_DRIVER)
    path = folder / "libcuda.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-o", str(path), str(folder / "fake_driver.c")],
        check=True,
        capture_output=True,
    )
    return str(path)


def run(tmp_path, fake_driver: str, **env: str) -> tuple[dict, list[list[str]]]:
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "FAKE_CUDA_LOG": str(log), "PYTHONPATH": str(REPO), **env}
    full_env.pop("FEEDPIPE_COPY_STREAM", None)
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, json.dumps({"driver": fake_driver})],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return json.loads(done.stdout.splitlines()[-1]), calls


def test_each_device_copies_on_a_non_blocking_stream_of_its_own_in_its_primary_context(
    tmp_path, fake_driver
):
    facts, calls = run(tmp_path, fake_driver)
    assert "non-blocking CUDA stream of feedpipe's own" in facts["reason"]
    contexts = [0xC0FFEE00, 0xC0FFEE01]
    streams = [c for c in calls if c[0] == "stream"]
    assert [(int(c[2]), int(c[3])) for c in streams] == [(1, ctx) for ctx in contexts]
    events = [c for c in calls if c[0] == "event"]
    assert [int(c[2]) for c in events] == [3, 3], "blocking-sync events without timing"
    for device, (stream, event) in enumerate(zip(streams, events, strict=True)):
        mine = [
            c
            for c in calls
            if c[0] in ("copy", "record", "query", "synchronize") and int(c[3]) == contexts[device]
        ]
        kinds = [c[0] for c in mine]
        polls = kinds.count("query")
        assert polls >= 1, "the wait polls the event first"
        assert kinds == ["copy", "copy", "record"] + ["query"] * polls + ["synchronize"], (
            "copies, then the event; a copy not done within its time is slept on"
        )
        assert all(c[1] == event[1] for c in mine if c[0] in ("query", "synchronize"))
        assert all(c[2] == stream[1] for c in mine if c[0] == "copy"), "on its own stream"
        assert mine[2][1:3] == [event[1], stream[1]], "the event recorded on that stream"
    assert facts["device"] == [[2, 0], [2, 1]], "exported as CUDA memory of each device"


def test_a_copy_done_within_its_expected_time_is_never_slept_on(tmp_path, fake_driver):
    _, calls = run(tmp_path, fake_driver, FAKE_CUDA_DONE="1")
    kinds = [c[0] for c in calls if c[0] in ("copy", "record", "query", "synchronize")]
    assert kinds == ["copy", "copy", "record"] * 2 + ["query"] * 2, "one poll sees each end"


def test_the_bytes_land_exactly_and_aligned_in_each_devices_memory(tmp_path, fake_driver):
    facts, calls = run(tmp_path, fake_driver)
    assert facts["values"][0][1] == [0, 1, 2, 3] and facts["values"][1][1] == [4, 5, 6, 7]
    assert facts["values"][1][0][:100] == [2.0] * 100
    assert all(address % 256 == 0 for fields in facts["addresses"] for address in fields)
    allocated = {c[1] for c in calls if c[0] == "alloc"}
    freed = {c[1] for c in calls if c[0] == "free"}
    assert len(allocated) == 2 and freed == allocated, "close frees every block it made"
    assert sum(c[0] in ("stream_destroy", "event_destroy") for c in calls) == 4


def test_a_full_device_names_the_preallocation_setting_and_the_way_out(tmp_path, fake_driver):
    facts, _ = run(tmp_path, fake_driver, FAKE_CUDA_FULL="1")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in facts["error"]
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in facts["error"]
    assert "FEEDPIPE_COPY_STREAM=0" in facts["error"]
