"""The PyTorch layer: each replica's rows as a `torch.Tensor` on its device, one process per
device under `torch.distributed` (as `DistributedDataParallel` runs), Keras on its torch backend.

`layer` (the devices, this process's share, staging from slots: `devices`, `stage`, on CUDA
copies on a stream of the feeder's own), `batch` (what the step takes), `feeder` (the feeder
`fp.Feeder(..., devices=[torch.device("cuda:0")])` builds, with `state_dict()`), `agreement`
(the processes' check through `torch.distributed`'s store), `keras` (what Keras's torch trainer
reads), `keras_step` (Keras's train function as `StarvationMonitor` and `diagnose` run it).
"""
