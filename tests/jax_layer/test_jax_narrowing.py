"""64-bit fields on JAX with `jax_enable_x64` off (JAX's default): JAX narrows int64, uint64,
float64 and complex128 to their 32-bit kin, so a value that would change is refused, naming the
field, the dtype, the value and both fixes: at construction where the values are known (arrays in
memory), else as the batch holding it is staged, before it crosses to a device. A field whose
every value survives arrives narrowed, and `describe()` says what arrives."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import feedpipe as fp
from tests.processes import REPO_ROOT

FIXES = r"cast it.*astype.*or enable 64-bit types.*jax_enable_x64"


def _with_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((len(ids), 2), np.float32), ids


@pytest.mark.parametrize(
    ("ids", "value", "arrives"),
    [
        (2**40 + np.arange(8, dtype=np.int64), "1099511627776", "int32"),
        (2**32 + np.arange(8, dtype=np.uint64), "4294967296", "uint32"),
        (np.full(8, 0.1, np.float64), "0.1", "float32"),
        (np.full(8, 0.1 + 0.5j, np.complex128), r"\(0\.1\+0\.5j\)", "complex64"),
        (np.full(8, 1e300, np.float64), "1e\\+300", "float32"),
    ],
    ids=["int64", "uint64", "float64", "complex128", "float64 overflow"],
)
def test_a_64_bit_field_whose_values_would_change_is_refused_naming_the_field_and_both_fixes(
    devices, ids, value, arrives
):
    with pytest.raises(
        ValueError,
        match=rf"Field \[1\] has dtype {ids.dtype}, which JAX narrows to {arrives}.*"
        rf"sample 0 holds {value}.*{FIXES}",
    ):
        fp.Feeder(_with_ids(ids), 4, devices=devices)


def test_a_changed_value_deep_in_a_large_field_is_found(devices):
    ids = np.arange(300_000, dtype=np.int64)
    ids[123_457] = 2**31
    with pytest.raises(ValueError, match=r"sample 123457 holds 2147483648"):
        fp.Feeder(_with_ids(ids), 4, devices=devices)


@pytest.mark.parametrize(
    ("ids", "arrives"),
    [
        (np.arange(8, dtype=np.int64) - 4, "int32"),
        (np.arange(8, dtype=np.uint64), "uint32"),
        (np.array([0.5, -2.0, np.nan, np.inf, 3.0, -0.0, 2.0**100, 7.0]), "float32"),
        (np.arange(8) + 0.25j, "complex64"),
    ],
    ids=["int64", "uint64", "float64", "complex128"],
)
def test_a_64_bit_field_that_loses_nothing_arrives_narrowed_and_describe_says_so(
    devices, ids, arrives
):
    with fp.Feeder(_with_ids(ids), 4, devices=devices) as feeder:
        assert feeder.describe().fields == ("[0]: float32[2]", f"[1]: {arrives}[]")
        got = [np.asarray(y) for batch in feeder for _, y in batch.replicas]
    assert {part.dtype.name for part in got} == {arrives}
    np.testing.assert_array_equal(np.concatenate(got), ids)


def _ids_generator(shard: int, num_shards: int):
    for i in range(shard, 8, num_shards):
        yield np.float32(i), np.int64(2**40 if i == 5 else i)


def _small_ids_generator(shard: int, num_shards: int):
    for i in range(shard, 8, num_shards):
        yield np.float32(i), np.int64(i)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_generators_64_bit_field_arrives_narrowed_while_every_value_fits(devices, workers):
    source = fp.from_generator(_small_ids_generator)
    with fp.Feeder(source, 4, devices=devices, workers=workers) as feeder:
        assert feeder.describe().fields == ("[0]: float32[]", "[1]: int32[]")
        got = [np.asarray(y) for batch in feeder for _, y in batch.replicas]
    assert {part.dtype.name for part in got} == {"int32"}
    assert sorted(np.concatenate(got).tolist()) == list(range(8))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_generators_value_that_would_change_stops_the_loop_naming_the_field_and_fixes(
    devices, workers
):
    # Its values are made later: the batch holding one that changes is refused before it
    # crosses to a device, naming the field, the value and both fixes.
    source = fp.from_generator(_ids_generator)
    with (
        fp.Feeder(source, 4, devices=devices, workers=workers) as feeder,
        pytest.raises(
            ValueError,
            match=rf"Field \[1\] has dtype int64, which JAX narrows to int32, and .*holds "
            rf"1099511627776, which would arrive as 0.*{FIXES}",
        ),
    ):
        for _ in feeder:
            pass


def test_a_64_bit_field_made_by_transform_is_checked_sample_by_sample(devices):
    x = np.arange(8, dtype=np.float32)
    with fp.Feeder(x, 4, devices=devices, transform=lambda v: (v, np.float64(v))) as feeder:
        assert feeder.describe().fields == ("[0]: float32[]", "[1]: float32[]")
        assert sum(len(np.asarray(y)) for b in feeder for _, y in b.replicas) == 8
    with (
        fp.Feeder(x, 4, devices=devices, transform=lambda v: (v, np.float64(v) + 0.1)) as feeder,
        pytest.raises(ValueError, match=r"Field \[1\] has dtype float64.*sample 0 \(epoch 0\)"),
    ):
        next(iter(feeder))


def test_a_field_too_large_to_read_at_construction_is_checked_batch_by_batch(devices, monkeypatch):
    monkeypatch.setattr("feedpipe.core.stage.VALUE_CHECK_MAX_BYTES", 32)
    ids = np.arange(8, dtype=np.int64)
    ids[6] = 2**33
    with fp.Feeder(_with_ids(ids), 4, devices=devices) as feeder:
        batches = iter(feeder)
        assert np.asarray(next(batches).replicas[0][1]).tolist() == [0]
        with pytest.raises(ValueError, match=r"sample 6 \(epoch 0\) holds 8589934592"):
            next(batches)


def test_with_x64_enabled_64_bit_fields_arrive_unchanged():
    code = (
        "import numpy as np, jax, feedpipe as fp\n"
        "ids = 2**40 + np.arange(8, dtype=np.int64)\n"
        "with fp.Feeder((np.full(8, 0.1), ids), 4, devices=jax.devices()) as f:\n"
        "    assert f.describe().fields == ('[0]: float64[]', '[1]: int64[]'), f.describe()\n"
        "    got = [y for b in f for _, y in b.replicas]\n"
        "assert {str(y.dtype) for y in got} == {'int64'}\n"
        "assert np.concatenate([np.asarray(y) for y in got]).tolist() == ids.tolist()\n"
    )
    env = {
        **os.environ,
        "JAX_ENABLE_X64": "1",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_jax_narrows_64_bit_types_here():
    """The premise of the tests above: they run with JAX's default, x64 off."""
    assert not jax.config.jax_enable_x64
    assert jax.device_put(np.int64(2**40)).dtype == np.int32
