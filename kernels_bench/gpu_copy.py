"""On a GPU, does feedpipe's copy engine copy from its own host slots at the link's rate?

The host-to-device copy rate from feedpipe's own host slots (a `SlotPool` of shared slots, as
worker processes fill them, page-locked through `feedpipe.core.pinned`), each copy timed alone
to its array being ready, at `--copy-mb` (2, 16 and 64) MiB: feedpipe's copy engine (its own
CUDA stream, then `jax.dlpack.from_dlpack`, as the JAX feeder stages), and for contrast
`jax.device_put` from the same slot and from a pageable one. The ceiling: PyTorch's copy of the
same bytes from its own pinned memory (`torch.empty(n, pin_memory=True).to("cuda",
non_blocking=True)` + `torch.cuda.synchronize()`), and from the page-locked slot itself.
Targets: engine / torch pinned >= 0.9 at 16 and 64 MiB, >= 0.75 at 2 MiB; the engine's fences
<= 0.1 a copy. PyTorch is optional; without it the ratios are not taken.

Run on a CUDA machine with JAX (see `gpu.py` for the wheels to carry), from the repository
root: `KERAS_BACKEND=jax python3 -m kernels_bench.gpu_copy`, which writes
`kernels_bench/results/gpu_copy.json`; `bash kernels_bench/gpu_run.sh` runs it with the other
JAX GPU questions into `gpu.json`. `--smoke` runs it shrunk on CPU JAX (`gpu_copy_smoke.json`),
where `jax.device_put` may wrap host memory instead of copying it: its "copy rates" are not copy
rates.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

from kernels_bench import harness
from kernels_bench.harness import jax_gpu
from kernels_bench.harness.accelerator import add_copy_args
from kernels_bench.harness.jax_staging import EngineTransfer, copy_engine, jax_transfer, slot_region
from kernels_bench.harness.parts import copies_per_rep, copy_reps

PART = "copy"
DESCRIBE_FIRST = True
"""The slots are page-locked by the locker a JAX-only process finds: looked for before the
accelerator's description loads PyTorch (optional) and its own CUDA runtime."""
COPY_PEERS = ("engine", "slot_locked", "slot_pageable", "torch_pinned", "torch_slot_locked")
COPY_TARGETS = {2: 0.75, 16: 0.9, 64: 0.9}
"""engine / torch pinned, by copy size in MiB (smaller copies pay the fixed costs more)."""
FENCES_PER_BATCH = 0.1
"""Fences the copy engine may enqueue per batch per device in the steady state."""
QUESTION = "copy rate of feedpipe's copy engine from its slots / torch pinned, on one accelerator"
NOTE = (
    "copy: each copy timed alone to block_until_ready / synchronize, the median per "
    "repetition; GB/s are 1e9 bytes."
)
COLUMNS = [
    "engine_gb_s",
    "slot_locked_gb_s",
    "torch_pinned_gb_s",
    "engine_over_torch_pinned",
    "slot_locked_over_torch_pinned",
]
add_args = add_copy_args


def smoke(args) -> None:
    args.copy_mb = "2,16"


def _torch_transfer(torch, tensor) -> Callable[[], None]:
    def transfer():
        tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    return transfer


def run(report: harness.Report, settings: harness.Settings, device) -> None:
    """The copy cases, one per `--copy-mb`, and their targets."""
    import jax

    from feedpipe.core.pinned import page_locker

    # Found before PyTorch (optional) loads its own CUDA runtime.
    locker = page_locker()
    torch = jax_gpu.cuda_torch()
    if torch is None:
        report.note(
            "copy: no PyTorch with CUDA in this environment, so no pinned-copy ceiling was "
            "measured and the target (the copy engine from a page-locked slot / torch "
            "pinned) was not taken."
        )
    for mb in settings.args.copy_mb:
        nbytes = int(mb * 2**20)
        locked_owner, locked = slot_region(nbytes, locker)
        pageable_owner, pageable = slot_region(nbytes, None)
        pool = locked_owner[0]
        copies = copies_per_rep(settings, nbytes)

        engine, engine_reason = copy_engine(locked, device)
        peers: dict[str, Callable[[], None]] = {
            "slot_locked": jax_transfer(jax, locked, device),
            "slot_pageable": jax_transfer(jax, pageable, device),
        }
        if engine is not None:
            peers["engine"] = EngineTransfer(engine, locked, device)
        if torch is not None:
            pinned = torch.ones(nbytes // 4, dtype=torch.float32, pin_memory=True)
            peers["torch_pinned"] = _torch_transfer(torch, pinned)
            peers["torch_slot_locked"] = _torch_transfer(torch, torch.from_numpy(locked))
        reps = copy_reps(settings, peers, nbytes, copies)
        for values in reps:
            values["slot_locked_over_pageable"] = (
                values["slot_locked_gb_s"] / values["slot_pageable_gb_s"]
            )
            if engine is not None:
                values["engine_over_slot_locked"] = (
                    values["engine_gb_s"] / values["slot_locked_gb_s"]
                )
        case = f"copy {mb:g} MiB"
        report.add_case(
            case,
            {
                "bytes": nbytes,
                "copies_per_rep": copies,
                "platform": device.platform,
                "slot_page_locked": bool(pool.page_locked),
                "slot_page_lock_reason": pool.page_lock_reason,
                "page_lock_s": pool.page_lock_s,
                "torch": torch is not None,
                "engine": engine is not None,
                "engine_reason": engine_reason,
                "peers": {
                    "engine": "feedpipe's copy engine (own CUDA stream) + jax.dlpack.from_dlpack",
                    "slot_locked": "jax.device_put from the page-locked slot",
                    "slot_pageable": "jax.device_put from a pageable slot",
                    "torch_pinned": "torch pinned tensor .to('cuda', non_blocking=True)",
                    "torch_slot_locked": "torch.from_numpy(page-locked slot).to('cuda')",
                },
            },
            reps,
            units={f"{peer}_gb_s": "GB/s (1e9 bytes)" for peer in COPY_PEERS},
            extra=peers["engine"].per_copy() if engine is not None else None,
        )
        if engine is not None:
            report.target(
                case,
                "engine_fences_per_copy",
                "<=",
                FENCES_PER_BATCH,
                "fences per copy on the copy engine, over every repetition",
                value=report.cases[-1]["engine_fences_per_copy"],
            )
        if torch is not None:
            report.target(
                case,
                "engine_over_torch_pinned",
                ">=",
                COPY_TARGETS.get(round(mb), 0.9),
                "feedpipe's copy engine from a page-locked slot / torch pinned copy",
                applies=engine is not None,
                why_not=f"no copy engine here: {engine_reason}",
            )
        if engine is not None:
            engine.close()
        del locked_owner, pageable_owner, locked, pageable, peers, engine
        gc.collect()


def main(argv=None) -> None:
    jax_gpu.main("gpu_copy", __doc__, QUESTION, [sys.modules[__name__]], argv)


if __name__ == "__main__":
    main()
