"""Page-locked slots: each pooled slot is registered once, unregistered while still mapped, and
a CUDA that is absent, refuses, or is switched off leaves the slots pageable with the reason.

No GPU is needed: a fake CUDA runtime (and driver), built here with gcc, records every call in a
log. Each scenario runs in a fresh Python that loads the fake first, as a framework would load
the real library, so the locker finds it in `/proc/self/maps`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from feedpipe.core.env import PAGE_LOCK
from feedpipe.core.pinned import PageLocker

REPO = Path(__file__).resolve().parents[2]
SLOT_BYTES = 2**20
"""One pooled slot of the scenario: 16 rows of 64 KiB over 2 replicas."""

FAKE_CUDA = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Every call is appended to $FAKE_CUDA_LOG as "kind address nbytes flags mapped context":
   `mapped` says whether the whole range was mapped at the call (mincore), `context` whether
   the device's primary context was current (always 1 for the runtime API). */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int calls, last_error, live_count;
static struct { uintptr_t address; size_t nbytes; } live[4096];
static void (*hook)(uint64_t);

int fake_is_mapped(uint64_t address, uint64_t nbytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = address & ~(page - 1);
    size_t length = address + nbytes - start;
    unsigned char *pages = malloc(length / page + 2);
    int mapped = mincore((void *)start, length, pages) == 0;
    free(pages);
    return mapped;
}

static void note(const char *kind, uintptr_t address, size_t nbytes, unsigned flags, int ctx) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (!path) return;
    FILE *log = fopen(path, "a");
    fprintf(log, "%s %lu %zu %u %d %d\n", kind, (unsigned long)address, nbytes, flags,
            fake_is_mapped(address, nbytes), ctx);
    fclose(log);
}

/* FAKE_CUDA_FAIL="code" fails every registration with that code; "code:n" the n-th alone. */
static int failure(int call) {
    const char *spec = getenv("FAKE_CUDA_FAIL");
    if (!spec) return 0;
    const char *colon = strchr(spec, ':');
    if (colon && atoi(colon + 1) != call) return 0;
    return atoi(spec);
}

static int do_register(void *p, size_t nbytes, unsigned flags, int ctx) {
    pthread_mutex_lock(&mu);
    int code = failure(++calls);
    note(code ? "fail" : "register", (uintptr_t)p, nbytes, flags, ctx);
    if (code) {
        last_error = code;
    } else {
        live[live_count].address = (uintptr_t)p;
        live[live_count++].nbytes = nbytes;
    }
    pthread_mutex_unlock(&mu);
    return code;
}

static int do_unregister(void *p, int ctx) {
    pthread_mutex_lock(&mu);
    int code = 713; /* cudaErrorHostMemoryNotRegistered */
    for (int i = 0; i < live_count; i++) {
        if (live[i].address == (uintptr_t)p) {
            note("unregister", live[i].address, live[i].nbytes, 0, ctx);
            live[i] = live[--live_count];
            code = 0;
            break;
        }
    }
    if (code) note("unknown", (uintptr_t)p, 1, 0, ctx);
    pthread_mutex_unlock(&mu);
    if (hook) hook((uint64_t)(uintptr_t)p);
    return code;
}

void fake_set_unregister_hook(void (*h)(uint64_t)) { hook = h; }
int fake_registered(void) { return live_count; }

#ifndef DRIVER
int cudaHostRegister(void *p, size_t nbytes, unsigned flags) {
    return do_register(p, nbytes, flags, 1);
}
int cudaHostUnregister(void *p) { return do_unregister(p, 1); }
int cudaGetLastError(void) { int code = last_error; last_error = 0; return code; }
int cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorString(int code) {
    return code == 2 ? "out of memory" : "unrecognized error code";
}
#else
static void *const PRIMARY = (void *)0xC0FFEE;
static __thread void *stack[16];
static __thread int depth;
static int initialized;
int cuInit(unsigned flags) { initialized = 1; return 0; }
int cuDeviceGet(int *device, int ordinal) {
    if (!initialized) return 3;
    *device = ordinal;
    return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = PRIMARY; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { stack[depth++] = ctx; return 0; }
int cuCtxPopCurrent_v2(void **ctx) {
    if (!depth) return 201;
    *ctx = stack[--depth];
    return 0;
}
int fake_context_depth(void) { return depth; }
static int current(void) { return depth > 0 && stack[depth - 1] == PRIMARY; }
int cuMemHostRegister_v2(void *p, size_t nbytes, unsigned flags) {
    return do_register(p, nbytes, flags, current());
}
int cuMemHostUnregister(void *p) { return do_unregister(p, current()); }
int cuGetErrorString(int code, const char **text) {
    *text = code == 2 ? "out of memory" : "unknown";
    return 0;
}
#endif
"""

SCENARIO = r"""
import ctypes, gc, json, os, sys, threading, weakref

config = json.loads(sys.argv[1])
fakes = [ctypes.CDLL(path, ctypes.RTLD_GLOBAL) for path in config["load"]]

import numpy as np

from feedpipe.core.pinned import page_locker
from feedpipe.core.slots import SlotLayout, SlotPool
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit

facts = {}
owners = {}  # address -> a weak reference to the object whose death frees the memory
alive_at_unregister = {}


@ctypes.CFUNCTYPE(None, ctypes.c_uint64)
def on_unregister(address):
    alive_at_unregister[address] = owners[address]() is not None


for fake in fakes:
    fake.fake_set_unregister_hook(on_unregister)

if config["load_later"]:
    facts["before"] = [page_locker().available, page_locker().reason]
    fakes = [ctypes.CDLL(path, ctypes.RTLD_GLOBAL) for path in config["load_later"]]
    for fake in fakes:
        fake.fake_set_unregister_hook(on_unregister)
locker = page_locker()
facts["locker"] = [locker.available, locker.reason, locker.library]

layout = SlotLayout(SampleSpec.of(np.zeros(1 << 16, np.uint8)), ReplicaSplit(16, 2))
pool = SlotPool(layout, 3, shared=config["shared"], page_lock=locker)
stop = threading.Event()
slots = [pool.take(stop) for _ in range(3)]
for slot in slots:
    owners[slot.buffer.ctypes.data] = weakref.ref(slot.buffer.base)
facts["pooled"] = [[s.buffer.ctypes.data, s.buffer.nbytes] for s in slots if not s.overflow]
assert pool.take(stop) is None
for slot in slots:
    pool.give_back(slot)
slots = [pool.take(stop) for _ in range(3)]  # the same slots, not registered again
leased = slots[0].lease(pool.give_back)
del leased  # its finalizer gives the slot back
slots[0] = pool.take(stop)
extra = pool.overflow()
facts["overflow"] = extra.buffer.ctypes.data
for value, slot in enumerate([*slots, extra]):
    slot.buffer[:] = value  # every slot holds bytes, locked or not
    assert int(slot.buffer.sum()) == value * slot.buffer.nbytes

facts["pool"] = [pool.page_locked, pool.page_lock_reason, pool.page_locked_bytes, pool.page_lock_s]
facts["locked_bytes"] = locker.locked_bytes
facts["lock_s"] = locker.lock_s
facts["registered"] = fakes[0].fake_registered() if fakes else 0
if fakes and hasattr(fakes[0], "cudaPeekAtLastError"):
    facts["last_error"] = fakes[0].cudaPeekAtLastError()
if fakes and hasattr(fakes[0], "fake_context_depth"):
    facts["context_depth"] = fakes[0].fake_context_depth()

if not config["keep_until_exit"]:
    for slot in slots:
        if slot.shared is not None:
            slot.shared.close()  # the descriptor goes first; the mapping lives on
    del slots, slot, extra, pool
    gc.collect()
    facts["after"] = [locker.locked_bytes, fakes[0].fake_registered() if fakes else 0]
    facts["mapped_after"] = [
        bool(fakes[0].fake_is_mapped(a, n)) for a, n in facts["pooled"]
    ] if config["shared"] and fakes else []
    facts["alive_at_unregister"] = {str(k): v for k, v in alive_at_unregister.items()}
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> dict[str, str]:
    """A fake CUDA runtime (`libcudart.so.99`) and driver (`libcuda.so.1`), built with gcc."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build a fake CUDA library; none is on PATH")
    folder = tmp_path_factory.mktemp("fake_cuda")
    source = folder / "fake_cuda.c"
    source.write_text(FAKE_CUDA)
    built = {}
    for name, flags in (("runtime", []), ("driver", ["-DDRIVER"])):
        path = folder / ("libcudart.so.99" if name == "runtime" else "libcuda.so.1")
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O1", *flags, "-o", str(path), str(source), "-lpthread"],
            check=True,
            capture_output=True,
        )
        built[name] = str(path)
    return built


def run_scenario(
    tmp_path,
    load: list[str],
    *,
    shared: bool = True,
    keep_until_exit: bool = False,
    load_later: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[dict, list[tuple]]:
    """The scenario's facts, and the fake's log as `(kind, address, nbytes, flags, mapped,
    context)` rows, from a fresh Python that loaded `load` first."""
    log = tmp_path / "cuda.log"
    log.unlink(missing_ok=True)
    config = {
        "load": load,
        "shared": shared,
        "keep_until_exit": keep_until_exit,
        "load_later": load_later or [],
    }
    full_env = {**os.environ, "FAKE_CUDA_LOG": str(log), "PYTHONPATH": str(REPO)}
    full_env.pop(PAGE_LOCK, None)
    full_env.pop("FAKE_CUDA_FAIL", None)
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, json.dumps(config)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = []
    if log.exists():
        for line in log.read_text().splitlines():
            kind, *numbers = line.split()
            rows.append((kind, *map(int, numbers)))
    return json.loads(done.stdout.strip().splitlines()[-1]), rows


def of_kind(rows: list[tuple], kind: str) -> list[tuple]:
    return [row for row in rows if row[0] == kind]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_each_pooled_slot_is_registered_once_and_unregistered_while_mapped(
    tmp_path, fake_cuda, shared
):
    facts, rows = run_scenario(tmp_path, [fake_cuda["runtime"]], shared=shared)
    pooled = sorted(tuple(slot) for slot in facts["pooled"])
    assert len(pooled) == 3 and all(nbytes == SLOT_BYTES for _, nbytes in pooled)
    registered = of_kind(rows, "register")
    assert sorted((address, nbytes) for _, address, nbytes, *_ in registered) == pooled, (
        "each pooled slot must be registered exactly once, with its own address and size"
    )
    assert all(flags == 1 for _, _, _, flags, _, _ in registered), "registered PORTABLE"
    assert facts["overflow"] not in {address for address, _ in pooled}
    assert facts["locker"][:2] == [True, None]
    assert facts["locker"][2] == fake_cuda["runtime"]
    page_locked, reason, locked_bytes, lock_s = facts["pool"]
    assert page_locked is True and reason is None
    assert locked_bytes == 3 * SLOT_BYTES == facts["locked_bytes"] and facts["registered"] == 3
    assert lock_s > 0 and facts["lock_s"] > 0

    unregistered = of_kind(rows, "unregister")
    assert sorted((address, nbytes) for _, address, nbytes, *_ in unregistered) == pooled
    assert all(mapped for _, _, _, _, mapped, _ in unregistered), "unregistered after unmap"
    assert set(facts["alive_at_unregister"].values()) == {True}, "memory freed before unregister"
    assert len(facts["alive_at_unregister"]) == 3
    assert facts["after"] == [0, 0]
    assert of_kind(rows, "unknown") == []
    if shared:
        assert facts["mapped_after"] == [False] * 3, "the slots' memory is unmapped afterwards"


def test_slots_still_alive_at_exit_are_unregistered_before_unmapped(tmp_path, fake_cuda):
    _, rows = run_scenario(tmp_path, [fake_cuda["runtime"]], keep_until_exit=True)
    registered = of_kind(rows, "register")
    unregistered = of_kind(rows, "unregister")
    assert len(registered) == 3
    assert sorted(row[1:3] for row in unregistered) == sorted(row[1:3] for row in registered)
    assert all(mapped for _, _, _, _, mapped, _ in unregistered)


def test_a_refused_registration_leaves_every_slot_pageable_and_says_why(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [fake_cuda["runtime"]], env={"FAKE_CUDA_FAIL": "2"})
    assert len(of_kind(rows, "fail")) == 3
    assert of_kind(rows, "unregister") == [] and of_kind(rows, "unknown") == []
    page_locked, reason, locked_bytes, _ = facts["pool"]
    assert page_locked is False and locked_bytes == 0 and facts["locked_bytes"] == 0
    assert re.fullmatch(
        r"3 of 3 pooled slots are pageable: cudaHostRegister returned 2 \(out of memory\) "
        r"for 1 MiB",
        reason,
    ), reason
    assert facts["locker"][0] is True, "a failed registration is not the locker's end"
    assert facts["last_error"] == 0, "the runtime's error was left for the framework to find"


def test_one_refused_slot_stays_pageable_and_the_others_are_locked(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [fake_cuda["runtime"]], env={"FAKE_CUDA_FAIL": "2:2"})
    failed = of_kind(rows, "fail")
    registered = of_kind(rows, "register")
    assert len(failed) == 1 and len(registered) == 2
    page_locked, reason, locked_bytes, _ = facts["pool"]
    assert page_locked is False and locked_bytes == 2 * SLOT_BYTES
    assert reason.startswith("1 of 3 pooled slots are pageable: cudaHostRegister returned 2")
    unregistered = of_kind(rows, "unregister")
    assert sorted(row[1] for row in unregistered) == sorted(row[1] for row in registered)


def test_without_cuda_loaded_nothing_is_locked_and_the_reason_says_so(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [])
    available, reason, library = facts["locker"]
    assert available is False and library is None
    assert reason.startswith("no CUDA runtime (libcudart) or driver (libcuda) is loaded")
    assert facts["pool"][:3] == [False, reason, 0]
    assert rows == []


def test_a_runtime_loaded_after_the_first_look_is_found_at_the_next(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [], load_later=[fake_cuda["runtime"]])
    assert facts["before"][0] is False
    assert facts["locker"][0] is True and facts["pool"][0] is True
    assert len(of_kind(rows, "register")) == 3


def test_the_switch_turns_page_locking_off(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [fake_cuda["runtime"]], env={PAGE_LOCK: "0"})
    assert facts["locker"][:2] == [False, "page-locking was turned off with FEEDPIPE_PAGE_LOCK=0"]
    assert facts["pool"][:3] == [False, facts["locker"][1], 0]
    assert rows == []


def test_the_driver_registers_in_the_primary_context_when_no_runtime_is_loaded(tmp_path, fake_cuda):
    facts, rows = run_scenario(tmp_path, [fake_cuda["driver"]])
    assert facts["locker"][2] == fake_cuda["driver"]
    assert facts["pool"][0] is True
    registered = of_kind(rows, "register")
    unregistered = of_kind(rows, "unregister")
    assert len(registered) == 3 and len(unregistered) == 3
    assert all(context for *_, context in registered + unregistered), (
        "the primary context must be current around every driver call"
    )
    assert facts["context_depth"] == 0, "the primary context was left pushed"
    assert all(mapped for _, _, _, _, mapped, _ in unregistered)


def test_the_runtime_is_preferred_to_the_driver(tmp_path, fake_cuda):
    facts, _ = run_scenario(tmp_path, [fake_cuda["driver"], fake_cuda["runtime"]])
    assert facts["locker"][2] == fake_cuda["runtime"]


def test_a_library_that_is_not_loaded_is_never_loaded(tmp_path, fake_cuda):
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000001000 r-xp 00000000 00:00 0    {fake_cuda['runtime']}\n")
    locker = PageLocker.find(str(maps))
    assert locker.available is False
    assert locker.reason.startswith(f"{fake_cuda['runtime']} cannot page-lock memory")
    assert fake_cuda["runtime"] not in Path("/proc/self/maps").read_text()


def test_an_unknown_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(PAGE_LOCK, "maybe")
    with pytest.raises(ValueError, match=r"FEEDPIPE_PAGE_LOCK='maybe' is neither on nor off"):
        PageLocker.find()


def test_importing_the_locker_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        import feedpipe.core.pinned
        frameworks = {"tensorflow", "jax", "jaxlib", "torch", "keras", "numpy"}
        print(sorted(m for m in sys.modules if m.split(".")[0] in frameworks))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout.strip() == "[]"
