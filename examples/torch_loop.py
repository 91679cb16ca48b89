"""A plain PyTorch training loop fed by `fp.Feeder` where a `DataLoader` was.

    python examples/torch_loop.py [--epochs 3]

The dataset is map-style, as a `DataLoader` takes it (`blobs.py`). Two worker processes run
its `__getitem__` (the per-sample work) and write each sample into the host buffer its batch is
staged from, so the loop receives tensors already on this process's device (its GPU where
there is one). 1,000 samples in batches of 64 leave a last batch of 40 real
rows, padded to 64. On one device the step takes `batch.real_rows()`, those 40 rows alone, as
a `DataLoader`'s short last batch is: a model with Dropout or BatchNorm then trains exactly as
it would on the loader. With several processes (`torch_ddp.py`) every process keeps its padded
rows, so that their shapes agree: the mask zeroes the padding's loss, and dividing by
`batch.num_valid` makes each step the mean over the real samples.

Partway through the second epoch the run stops, as a preempted job would, after saving
`feeder.state_dict()` with `torch.save` beside the model's and the optimizer's. A new model,
optimizer and feeder then load that checkpoint and go on from the very next batch: each epoch
still sees every sample once.
"""

import argparse
import os
import tempfile

import torch
from blobs import CLASSES, FEATURES, Blobs

import feedpipe as fp


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)]
    return torch.nn.Sequential(*layers).to(device)


def step(model, optimizer, batch) -> torch.Tensor:
    """One step on the batch's real rows alone; their summed loss, correct answers and count."""
    x, y = batch.real_rows()  # the padded last batch as its real rows: a DataLoader's batch
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    correct = (logits.argmax(1) == y).sum().float()
    return torch.stack([loss.detach() * len(y), correct, correct.new_tensor(len(y))])


def masked_step(model, optimizer, batch, world_size: int = 1) -> torch.Tensor:
    """One step on the batch's rows, padding weighted zero, as every process of a
    `DistributedDataParallel` model takes them; their summed loss, correct answers and count."""
    (x, y), mask = batch.distributed()
    logits = model(x)
    summed = torch.where(mask, torch.nn.functional.cross_entropy(logits, y, reduction="none"), 0)
    # Padding weighs nothing; num_valid counts the global batch's real rows on every process,
    # so with DDP's average over `world_size` processes this is the mean over the real rows.
    loss = summed.sum() * world_size / batch.num_valid
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    correct = (logits.argmax(1) == y) & mask
    return torch.stack([summed.sum().detach(), correct.sum().float(), mask.sum().float()])


def train(path: str, epochs: int, stop_at: tuple[int, int] | None = None) -> None:
    """Trains to `epochs`, from the checkpoint at `path` where there is one; with `stop_at`
    (epoch, step), saves a checkpoint after that step and returns, as if preempted."""
    with fp.Feeder(Blobs(), 64, workers=2, shuffle=True, seed=0) as feeder:
        device = feeder.devices[0]
        model = make_model(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if os.path.exists(path):
            checkpoint = torch.load(path, map_location=device)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            feeder.load_state_dict(checkpoint["feeder"])
            state = checkpoint["feeder"]
            print(f"resumed from {path} at epoch {state['epoch']} step {state['step']}")
        for epoch in range(feeder.state_dict()["epoch"], epochs):
            first, totals = feeder.state_dict()["step"], torch.zeros(3, device=device)
            for batch in feeder:
                totals += step(model, optimizer, batch)
                if (batch.epoch, batch.step) == stop_at:
                    break
            loss, correct, seen = totals.tolist()
            print(
                f"epoch {epoch}, steps {first}-{batch.step} of {len(feeder)}: loss "
                f"{loss / seen:.4f}, accuracy {correct / seen:.3f} over {seen:.0f} samples"
            )
            if (batch.epoch, batch.step) == stop_at:
                checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**checkpoint, "feeder": feeder.state_dict()}, path)
                print(f"stopped after step {batch.step}: {feeder.state_dict()} saved to {path}")
                return
        print(feeder.stats())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the run stops partway through epoch 1")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "checkpoint.pt")
        train(path, args.epochs, stop_at=(1, 9))  # preempted after 10 of epoch 1's 16 steps
        train(path, args.epochs)
