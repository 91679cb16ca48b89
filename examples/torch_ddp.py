"""DistributedDataParallel fed by `fp.Feeder`: each process stages only its share of every
global batch, on its own device.

    torchrun --nproc-per-node=2 examples/torch_ddp.py [--epochs 3] [--checkpoint PATH]

Every process builds the same `fp.Feeder(Blobs(), 128, workers=2, shuffle=True)` after
`init_process_group` (gloo on the CPU, NCCL where there are GPUs). Its device is this
process's (`LOCAL_RANK`'s GPU, else the CPU), and its rows are rank r's contiguous
128 / world_size rows of each global batch, in the order one process would read them: no
`DistributedSampler`, no `set_epoch`. Processes whose feeders differ (another seed, another
dataset) are refused when the feeders are built, naming the field.

1,000 samples in global batches of 128 leave a last batch of 104 real rows, padded: every
process weighs its padding rows zero and divides by `batch.num_valid`, the real rows of the
whole global batch (the same number in every process), so DDP's average of the processes'
gradients is that of the mean over the real rows. After each epoch rank 0 saves the model,
the optimizer and `feeder.state_dict()`, which is the same in every process; a run whose
checkpoint exists goes on from it, with any number of processes.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from blobs import Blobs
from torch.nn.parallel import DistributedDataParallel
from torch_loop import make_model, masked_step

import feedpipe as fp


def main(epochs: int, path: str) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with fp.Feeder(Blobs(), 128, workers=2, shuffle=True, seed=0) as feeder:
        device = feeder.devices[0]
        model = make_model(device)
        checkpoint = torch.load(path, map_location=device) if os.path.exists(path) else None
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
        ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if checkpoint is not None:
            optimizer.load_state_dict(checkpoint["optimizer"])
            feeder.load_state_dict(checkpoint["feeder"])
            if rank == 0:
                start = checkpoint["feeder"]["epoch"]
                print(f"resumed from {path} at epoch {start} of {epochs}")
                if start >= epochs:
                    print(f"nothing left to train; remove {path} to start over")
        if rank == 0:
            rows = feeder.share.rows
            print(
                f"world size {world_size} on {device.type}; rank 0 stages rows {rows.start} to "
                f"{rows.stop - 1} of each global batch of {feeder.options.global_batch_size}"
            )
        for epoch in range(feeder.state_dict()["epoch"], epochs):
            totals = torch.zeros(3, device=device)
            for batch in feeder:
                totals += masked_step(ddp, optimizer, batch, world_size)
            dist.all_reduce(totals)  # every process's summed loss, correct and real rows
            if rank == 0:
                loss, correct, seen = totals.tolist()
                print(
                    f"epoch {epoch}: loss {loss / seen:.4f}, accuracy {correct / seen:.3f} "
                    f"over {seen:.0f} samples, world size {world_size}"
                )
                checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**checkpoint, "feeder": feeder.state_dict()}, path)
        if rank == 0:
            print(f"rank 0: {feeder.stats()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    default = os.path.join(tempfile.gettempdir(), "feedpipe_torch_ddp.pt")
    parser.add_argument("--checkpoint", default=default, help=f"default {default}")
    args = parser.parse_args()
    main(args.epochs, args.checkpoint)
