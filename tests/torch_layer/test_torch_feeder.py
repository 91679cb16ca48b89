"""The PyTorch feeder: each replica's rows as `torch.Tensor`s on its device, every sample once
per epoch in the core's order, padding masked, and a state (`state_dict()`) that resumes
exactly, through `torch.save` too."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.processes import REPO_ROOT
from tests.worker_fakes import index_pairs

CPUS = ["cpu", "cpu"]
"""Two replicas on the host: PyTorch has one CPU device, listed once per replica."""


def _feeder(source, size, **options):
    return fp.Feeder(source, size, devices=CPUS, framework="torch", **options)


def _real_labels(batch) -> list[int]:
    """The labels of a batch's real rows, replica after replica."""
    return [
        int(v)
        for (_, y), mask in zip(batch.replicas, batch.masks, strict=True)
        for v in y[mask].tolist()
    ]


def test_torch_devices_make_a_torch_feeder_whose_batches_are_tensors():
    with fp.Feeder(index_pairs(16), 8, devices=[torch.device("cpu")]) as feeder:
        assert feeder.layer.name == "torch" and isinstance(feeder, fp.Feeder)
        batch = next(iter(feeder))
    assert isinstance(batch, fp.Batch)
    (x, y), mask = batch.distributed()
    assert isinstance(x, torch.Tensor) and x.device == torch.device("cpu")
    assert x.shape == (8, 2) and x.dtype == torch.float32 and mask.dtype == torch.bool
    assert y.tolist() == list(range(8)) and mask.all()


def test_cuda_strings_name_torch_and_cpu_strings_need_the_framework():
    from feedpipe._frameworks import framework_of

    assert framework_of(None, ["cuda:0", "cuda:1"], None) == "torch"
    assert framework_of("torch", ["cpu"], None) == "torch"
    assert framework_of(None, [torch.device("cpu")], None) == "torch"


def test_each_replica_gets_its_own_rows():
    with _feeder(index_pairs(16), 8) as feeder:
        for batch in feeder:
            for replica, (_, y) in enumerate(batch.replicas):
                first = batch.step * 8 + replica * 4
                assert y.tolist() == list(range(first, first + 4))


def test_pad_masks_exactly_the_padding_and_num_valid_counts_real_samples():
    with _feeder(index_pairs(10), 8) as feeder:
        batches = list(feeder)
    assert [b.num_valid for b in batches] == [8, 2]
    assert [m.tolist() for m in batches[1].masks] == [[True, True, False, False], [False] * 4]
    assert _real_labels(batches[1]) == [8, 9]


def test_each_batch_owns_its_masks_so_writing_one_leaves_the_others():
    """A loop that narrows a batch's mask in place (`mask &= y >= 0`) changes that batch's
    mask alone: later batches of the same pattern of real rows still mark every real row."""
    x, y = index_pairs(60)
    y[::7] = -1  # labels to leave out of the loss
    counted = []
    with _feeder((x, y), 8) as feeder:
        for _ in range(2):
            for batch in feeder:
                counted.append(sum(int(mask.sum()) for mask in batch.masks))
                assert counted[-1] == batch.num_valid, (batch.epoch, batch.step)
                for (_, labels), mask in zip(batch.replicas, batch.masks, strict=True):
                    mask &= labels >= 0
    assert sum(counted) == 2 * 60


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_in_the_cores_order(workers):
    length, size = 37, 8
    with _feeder(index_pairs(length), size, shuffle=True, seed=3, workers=workers) as feeder:
        plan = Sampler(length, size, shuffle=True, seed=3)
        for epoch in range(2):
            got = [label for batch in feeder for label in _real_labels(batch)]
            assert got == plan.order(epoch).tolist()


def test_state_dict_resumes_mid_epoch_exactly_through_torch_save():
    source = index_pairs(40)
    with _feeder(source, 8, shuffle=True, seed=1) as whole:
        expected = [_real_labels(b) for b in whole]
    with _feeder(source, 8, shuffle=True, seed=1) as first:
        loop = iter(first)
        head = [_real_labels(next(loop)), _real_labels(next(loop))]
        loop.close()
        saved = io.BytesIO()
        torch.save({"feeder": first.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved)["feeder"]
    assert state["step"] == 2
    with _feeder(source, 8, shuffle=True, seed=1) as second:
        second.load_state_dict(state)
        assert head + [_real_labels(b) for b in second] == expected


def test_a_loop_left_early_goes_on_where_it_stopped():
    with _feeder(index_pairs(32), 8) as feeder:
        for batch in feeder:
            if batch.step == 1:
                break
        assert [b.step for b in feeder] == [2, 3]


def test_on_the_cpu_a_batch_is_the_slots_memory_and_its_slot_returns_when_freed():
    with _feeder(index_pairs(64), 8, depth=1) as feeder:
        for _ in range(3):
            for batch in feeder:
                del batch
        stats = feeder.stats()
    assert stats.overflow_slots == 0 and stats.slots_allocated <= 3


def test_kept_batches_keep_their_values_while_slots_are_reused():
    with _feeder(index_pairs(64), 8, depth=1) as feeder:
        kept = [(b.step, b) for _ in range(2) for b in feeder]
        assert len(kept) == 16
        for step, batch in kept:
            assert _real_labels(batch) == list(range(step * 8, step * 8 + 8))
        del kept
        gc.collect()


def test_skipped_samples_are_masked_rows():
    class OneBad:
        def __len__(self):
            return 16

        def __getitem__(self, index):
            if index == 5:
                raise ValueError("bad record")
            return np.full(2, index, np.float32), np.int64(index)

    with _feeder(OneBad(), 8, errors="skip", max_skipped=1) as feeder:
        got = [label for batch in feeder for label in _real_labels(batch)]
        assert feeder.stats().skipped
    assert got == [i for i in range(16) if i != 5]


def test_sixty_four_bit_fields_arrive_as_they_are():
    big = np.array([2**40 + i for i in range(8)], np.int64)
    with _feeder((big.astype(np.float64), big), 8) as feeder:
        x, y = next(iter(feeder)).replicas[0]
    assert y.dtype == torch.int64 and x.dtype == torch.float64
    assert y.tolist() == big[:4].tolist()


def test_bfloat16_and_float8_fields_arrive_as_torchs_own_dtypes():
    """numpy's bfloat16 and float8 (ml_dtypes) arrive as torch.bfloat16 and torch.float8_*,
    bit for bit, as they do on JAX and TensorFlow."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.arange(16, dtype=np.float32).reshape(8, 2) / 4
    source = (values.astype(ml_dtypes.bfloat16), values.astype(ml_dtypes.float8_e4m3fn))
    with _feeder(source, 8) as feeder:
        staged = [field for batch in feeder for replica in batch.replicas for field in replica]
    brain, eight = torch.cat(staged[0::2]), torch.cat(staged[1::2])
    assert (brain.dtype, eight.dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert brain.float().numpy().tolist() == values.tolist()
    assert eight.float().numpy().tolist() == source[1].astype(np.float32).tolist()


def test_a_dataset_of_bfloat16_tensors_is_fed_as_bfloat16():
    pytest.importorskip("ml_dtypes")

    class Halves(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return torch.full((2,), index / 2, dtype=torch.bfloat16), torch.tensor(index)

    with _feeder(Halves(), 8) as feeder:
        (x, y), _ = next(iter(feeder)).replicas
    assert x.dtype == torch.bfloat16 and x[:, 0].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert y.tolist() == [0, 1, 2, 3]


def test_a_bfloat16_tensor_without_ml_dtypes_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes fails
    samples = [(torch.zeros(2, dtype=torch.bfloat16), torch.tensor(i)) for i in range(8)]
    with pytest.raises(TypeError, match=r"torch\.bfloat16 tensor.*pip install ml_dtypes"):
        _feeder(samples, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", torch.device("cuda", 1)])
def test_a_cuda_device_where_there_is_none_is_refused_as_the_device(device):
    """Not as a dtype to cast: the device is named, and the devices there are."""
    with pytest.raises(ValueError) as refused:
        fp.Feeder(index_pairs(8), 4, devices=[device], framework="torch")
    message = str(refused.value)
    assert message.startswith(f"`devices` names {device!r}, which is not a device of this")
    assert "CUDA" in message and "the devices are cpu." in message
    assert "dtype" not in message and "cast" not in message


def test_a_cuda_index_past_the_gpus_there_are_is_refused_listing_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        ValueError,
        match=r"`devices` names 'cuda:2', which is not a device of this process: PyTorch sees 2 "
        r"CUDA devices; the devices are cpu, cuda:0, cuda:1\.",
    ):
        fp.Feeder(index_pairs(8), 4, devices=["cuda:2"], framework="torch")


def test_a_device_that_takes_no_array_is_refused_as_the_device_not_a_dtype(monkeypatch):
    def refuses(tensor, *args, **kwargs):
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(torch.Tensor, "to", refuses)
    monkeypatch.setattr("feedpipe.torch.devices._counted", lambda kind: None)
    with pytest.raises(
        ValueError, match=r"PyTorch cannot place any array on cuda:0 .*fell off the bus.*not a "
    ):
        fp.Feeder(index_pairs(8), 4, devices=["cuda:0"], framework="torch")


def test_a_dtype_torch_cannot_hold_is_refused_at_construction_naming_the_field():
    with pytest.raises(TypeError, match=r"Field .* has dtype float128, which PyTorch cannot"):
        _feeder(np.zeros((8, 2), np.longdouble), 4)


def test_bad_devices_and_a_strategy_are_refused_naming_the_fix():
    with pytest.raises(TypeError, match="must be a list of devices"):
        fp.Feeder(index_pairs(8), 4, devices="cpu", framework="torch")
    with pytest.raises(ValueError, match="is not a PyTorch device"):
        fp.Feeder(index_pairs(8), 4, devices=["tpu:7"], framework="torch")
    with pytest.raises(ValueError, match="`devices` is empty"):
        fp.Feeder(index_pairs(8), 4, devices=[], framework="torch")
    with pytest.raises(TypeError, match="is TensorFlow's; a PyTorch feeder"):
        fp.Feeder(index_pairs(8), 4, framework="torch", strategy=object())
    with (
        _feeder(index_pairs(8), 4) as feeder,
        pytest.raises(ValueError, match="one device's tensors, but this feeder stages on 2"),
    ):
        next(iter(feeder)).distributed()


def test_the_default_device_is_this_processs_and_the_copy_path_says_none_on_the_cpu():
    with fp.Feeder(index_pairs(8), 4, framework="torch") as feeder:
        expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        assert feeder.devices == (expected,)
        if not torch.cuda.is_available():
            assert feeder.describe().copy_path == "none"
            list(feeder)
            assert feeder.stats().copies == 0


def test_the_torch_path_imports_neither_tensorflow_nor_jax():
    code = (
        "import sys, numpy as np, torch, feedpipe as fp\n"
        "x = np.arange(20, dtype=np.float32)\n"
        "with fp.Feeder(x, 4, devices=[torch.device('cpu')], workers=1) as f:\n"
        "    total = sum(float(b.distributed()[0].sum()) for b in f)\n"
        "    f.load_state_dict(f.state_dict())\n"
        "    str(f.stats()); f.describe().to_dict()\n"
        "assert total == x.sum(), total\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'jax', 'jaxlib', 'keras'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_ctrl_c_in_a_loop_with_workers_leaves_a_state_and_a_feeder_that_go_on():
    # As in a notebook: Ctrl-C (a real SIGINT) in the loop's body, a checkpoint in the
    # handler, then the cell run again: the feeder goes on from the batch after the one
    # interrupted, its workers still serving, and the checkpoint resumes there too.
    import signal

    with _feeder(index_pairs(48), 8, workers=2, shuffle=True, seed=4) as feeder:
        seen = []
        try:
            for batch in feeder:
                seen += _real_labels(batch)
                if batch.step == 2:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)  # Python raises KeyboardInterrupt here, at the latest
        except KeyboardInterrupt:
            saved = feeder.state_dict()
        assert saved["step"] == 3 and len(seen) == 24
        rest = [label for batch in feeder for label in _real_labels(batch)]
    assert sorted(seen + rest) == list(range(48))
    with _feeder(index_pairs(48), 8, shuffle=True, seed=4) as again:
        again.load_state_dict(saved)
        assert [label for batch in again for label in _real_labels(batch)] == rest


def _dropout_batchnorm_model() -> torch.nn.Module:
    """A small model whose training step reads every row it is given: Dropout draws a mask per
    row, BatchNorm takes the rows' mean and variance."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(16, 1),
    )


def _train_epoch(batches) -> tuple[list[float], dict]:
    """One epoch of SGD over `(x, y)` batches, seeded: each step's loss, and the weights."""
    model = _dropout_batchnorm_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # Dropout's masks
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_real_rows_train_as_a_dataloaders_short_last_batch_bit_for_bit():
    # 37 rows in batches of 8: the last batch has 5 real rows, padded to 8 by the feeder.
    x, y = index_pairs(37)
    x = x / 37
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=8,
        generator=torch.Generator(),  # the loader draws its seed there, not from Dropout's
    )
    expected_losses, expected = _train_epoch(loader)
    with fp.Feeder((x, y), 8, devices=["cpu"], framework="torch") as feeder:
        losses, trained = _train_epoch(batch.real_rows() for batch in feeder)
    assert losses == expected_losses
    assert len(losses) == 5
    for name, value in expected.items():
        assert torch.equal(trained[name], value), name


def test_real_rows_are_refused_on_several_devices_naming_the_masks():
    with _feeder(index_pairs(16), 8) as feeder:
        batch = next(iter(feeder))
        with pytest.raises(ValueError, match=r"spans 2 devices.*batch\.masks\[i\]"):
            batch.real_rows()


def test_unpacking_a_torch_batch_names_what_to_read_instead():
    with fp.Feeder(index_pairs(16), 8, devices=["cpu"], framework="torch") as feeder:
        batch = next(iter(feeder))
        with pytest.raises(TypeError, match=r"batch\.real_rows\(\).*batch\.distributed\(\)"):
            _x, _y = batch
